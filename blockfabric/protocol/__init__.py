"""Pure NVMe / NVMe-oF protocol code: wire structures and the controller state machine.

No I/O here: everything takes bytes (or a memoryview of registered memory) and values, and
returns bytes, values or a new state, so the same code serves both providers and both ends.
Every decoder raises only :class:`ProtocolError`, carrying the status the receiver answers.
"""

from blockfabric.protocol.admin import (
    IDENTIFY_DATA_SIZE, OAES_ANA_CHANGE, OAES_DISCOVERY_CHANGE, OAES_NS_ATTR, AsyncEvent,
    AsyncEventConfig, AsyncEventRequest, AsyncEventType, AsyncNotice, FeatureSelect,
    GetFeatures, GetLogPage, Identify, KeepAlive, NumberOfQueues, SetFeatures)
from blockfabric.protocol.capsule import (
    CQE, CQE_SIZE, NSID_ALL, PSDT_SGL, SQE, SQE_SIZE, Command, pack_cqe_into)
from blockfabric.protocol.cm import CMAccept, CMConnectRequest, CMReject, CMRejectStatus
from blockfabric.protocol.controller import (
    CC_TRANSITIONS, COMMAND_RULES, PHASE_CSTS, CCEvent, CommandClass, ControllerState, Phase,
    QueueState, admit, command_class)
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.fabrics import (
    CAP, CC, CSTS, DISCOVERY_NQN, DYNAMIC_CNTLID, IATTR, VS, ConnectCommand, ConnectData,
    Property, PropertyGet, PropertySet, Shutdown, ShutdownStatus, connect_invalid_param,
    connect_invalid_param_result)
from blockfabric.protocol.identify import (
    ONCS_DSM, ONCS_WRITE_ZEROES, SGLS_KEYED, SGLS_OFFSET, SGLS_SUPPORTED, ActiveNamespaceList,
    IdentifyController, IdentifyNamespace, LBAFormat, NamespaceIdDescriptor,
    NamespaceIdDescriptorList, NidType)
from blockfabric.protocol.io import (
    DSM_MAX_RANGES, DatasetManagement, DSMRange, Flush, ReadWrite, WriteZeroes)
from blockfabric.protocol.logpages import (
    AddressFamily, ChangedNamespaceList, DiscoveryLogEntry, DiscoveryLogHeader, ErrorLogEntry,
    RdmaProviderType, RdmaQpType, RdmaTsas, SmartLog, SubsystemType, TransportType,
    discovery_log_size, pack_discovery_log)
from blockfabric.protocol.opcodes import (
    AdminOpcode, FabricsType, FeatureId, IdentifyCNS, IOOpcode, LogPageId)
from blockfabric.protocol.sgl import (
    KEYED_MAX_LENGTH, NULL_SGL, SGL, KeyedSGL, OffsetSGL, unpack_sgl)
from blockfabric.protocol.status import (
    StatusCode, decode_status, decode_status_word, encode_status, encode_status_word)

__all__ = [
    "ActiveNamespaceList", "AddressFamily", "AdminOpcode", "AsyncEvent", "AsyncEventConfig",
    "AsyncEventRequest", "AsyncEventType", "AsyncNotice", "CAP", "CC", "CC_TRANSITIONS",
    "CCEvent", "ChangedNamespaceList", "CMAccept", "CMConnectRequest", "CMReject",
    "CMRejectStatus", "COMMAND_RULES", "Command", "CommandClass", "ConnectCommand",
    "ConnectData", "ControllerState", "CQE", "CQE_SIZE", "CSTS", "DISCOVERY_NQN",
    "DSM_MAX_RANGES", "DSMRange", "DYNAMIC_CNTLID", "DatasetManagement", "DiscoveryLogEntry",
    "DiscoveryLogHeader", "ErrorLogEntry", "FabricsType", "FeatureId", "FeatureSelect",
    "Flush", "GetFeatures", "GetLogPage", "IATTR", "IDENTIFY_DATA_SIZE", "IOOpcode",
    "Identify", "IdentifyCNS", "IdentifyController", "IdentifyNamespace", "KEYED_MAX_LENGTH",
    "KeepAlive", "KeyedSGL", "LBAFormat", "LogPageId", "NSID_ALL", "NULL_SGL",
    "NamespaceIdDescriptor", "NamespaceIdDescriptorList", "NidType", "NumberOfQueues",
    "OAES_ANA_CHANGE", "OAES_DISCOVERY_CHANGE", "OAES_NS_ATTR", "ONCS_DSM",
    "ONCS_WRITE_ZEROES", "OffsetSGL", "PHASE_CSTS", "PSDT_SGL", "Phase", "Property",
    "PropertyGet", "PropertySet", "ProtocolError", "QueueState", "RdmaProviderType",
    "RdmaQpType", "RdmaTsas", "ReadWrite", "SGL", "SGLS_KEYED", "SGLS_OFFSET",
    "SGLS_SUPPORTED", "SQE", "SQE_SIZE", "SetFeatures", "Shutdown", "ShutdownStatus",
    "SmartLog", "StatusCode", "SubsystemType", "TransportType", "VS", "WriteZeroes", "admit",
    "command_class", "connect_invalid_param", "connect_invalid_param_result",
    "decode_status", "decode_status_word", "discovery_log_size", "encode_status",
    "encode_status_word", "pack_cqe_into", "pack_discovery_log", "unpack_sgl",
]

"""Command opcodes and selector values (NVMe base 2.0 figure 139, NVM command set figure 16,
NVMe-oF 1.1 figure 17; kernel include/linux/nvme.h)."""

from __future__ import annotations

import enum


class AdminOpcode(enum.IntEnum):
    """Admin command set opcodes (the ones a fabrics controller meets)."""

    DELETE_SQ = 0x00
    CREATE_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_CQ = 0x04
    CREATE_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    NS_MANAGEMENT = 0x0D
    KEEP_ALIVE = 0x18
    FABRICS = 0x7F


class IOOpcode(enum.IntEnum):
    """NVM command set opcodes."""

    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_UNCORRECTABLE = 0x04
    COMPARE = 0x05
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    VERIFY = 0x0C
    RESV_REGISTER = 0x0D
    RESV_REPORT = 0x0E
    RESV_ACQUIRE = 0x11
    RESV_RELEASE = 0x15
    FABRICS = 0x7F


FABRICS_OPCODE = 0x7F


class FabricsType(enum.IntEnum):
    """Fabrics command type, ``fctype`` at SQE @4."""

    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class IdentifyCNS(enum.IntEnum):
    """Identify CNS values this project serves; others are answered 'invalid field'."""

    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02
    NS_ID_DESCRIPTORS = 0x03


class LogPageId(enum.IntEnum):
    """Log page identifiers a Linux host asks a fabrics controller for (sheet section 9)."""

    ERROR = 0x01
    SMART = 0x02
    FW_SLOT = 0x03
    CHANGED_NS = 0x04
    CMD_EFFECTS = 0x05
    ANA = 0x0C
    DISCOVERY = 0x70
    RESV_NOTIFY = 0x80


class FeatureId(enum.IntEnum):
    """Feature identifiers (nvmet's set; others are answered 'invalid field')."""

    ARBITRATION = 0x01
    POWER_MGMT = 0x02
    TEMP_THRESHOLD = 0x04
    ERROR_RECOVERY = 0x05
    VOLATILE_WC = 0x06
    NUM_QUEUES = 0x07
    IRQ_COALESCE = 0x08
    IRQ_CONFIG = 0x09
    WRITE_ATOMIC = 0x0A
    ASYNC_EVENT = 0x0B
    KATO = 0x0F
    HOST_ID = 0x81
    RESV_MASK = 0x82
    RESV_PERSIST = 0x83
    WRITE_PROTECT = 0x84

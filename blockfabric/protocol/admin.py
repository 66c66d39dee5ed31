"""Admin commands and the values carried in their dwords (spec sheet sections 6 and 10;
kernel struct nvme_identify, nvme_get_log_page_command, nvme_features)."""

from __future__ import annotations

import enum

from blockfabric.protocol._wire import Bits, bitfields, bits
from blockfabric.protocol.capsule import Command, cmd, command
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.opcodes import AdminOpcode, FeatureId, IdentifyCNS, LogPageId
from blockfabric.protocol.status import StatusCode

IDENTIFY_DATA_SIZE = 4096


@command(AdminOpcode.IDENTIFY)
class Identify(Command):
    """Identify: 4096 bytes of the structure ``cns`` selects."""

    nsid: int = cmd(4, 32)  # @4
    cns: IdentifyCNS = cmd(40, 8, enum=IdentifyCNS)  # @40; unsupported -> invalid field
    cntid: int = cmd(42, 16)  # @42 controller identifier (CNS 0x12/0x13)
    cns_specific_id: int = cmd(44, 16)  # @44
    csi: int = cmd(47, 8)  # @47 command set identifier (0 = NVM)


@command(AdminOpcode.GET_LOG_PAGE)
class GetLogPage(Command):
    """Get Log Page.  ``numd`` is NUMDU:NUMDL, 0-based dwords: see :attr:`length`.

    An unknown ``lid`` is refused with Invalid Log Page (0x109) as the NVMe spec says;
    nvmet answers invalid field instead, and the Linux host tolerates both.
    """

    nsid: int = cmd(4, 32)  # @4
    # @40: any int sent (a host may ask for any page); a LogPageId as decoded
    lid: int = cmd(40, 8, enum=LogPageId, status=StatusCode.INVALID_LOG_PAGE)
    lsp: int = cmd(41, 7)  # @41 bits 6:0 log specific field
    rae: bool = cmd(41, 1, bit=7)  # @41 bit 7: retain asynchronous event
    numd: int = cmd(42, 32)  # @42 NUMDL u16, @44 NUMDU u16
    lsi: int = cmd(46, 16)  # @46 log specific identifier
    lpo: int = cmd(48, 64)  # @48 LPOL/LPOU: byte offset, dword aligned
    csi: int = cmd(59, 8)  # @59 command set identifier

    def _check(self) -> None:
        if self.lpo & 3:
            raise ProtocolError(f"log page offset {self.lpo} not dword aligned",
                                StatusCode.INVALID_FIELD)

    @property
    def length(self) -> int:
        """Bytes requested."""
        return (self.numd + 1) * 4

    @staticmethod
    def numd_for(length: int) -> int:
        """NUMD for a read of ``length`` bytes (a multiple of 4)."""
        if length <= 0 or length & 3:
            raise ValueError(f"log page length {length} is not a positive multiple of 4")
        return length // 4 - 1


@command(AdminOpcode.SET_FEATURES)
class SetFeatures(Command):
    """Set Features; ``value`` is cdw11 (see :class:`NumberOfQueues`, :class:`AsyncEventConfig`;
    the keep-alive timer is plain ms)."""

    nsid: int = cmd(4, 32)  # @4
    fid: FeatureId = cmd(40, 8, enum=FeatureId)  # @40; unsupported -> invalid field
    save: bool = cmd(43, 1, bit=7)  # @43 bit 7 (cdw10 bit 31)
    value: int = cmd(44, 32)  # @44 cdw11
    cdw12: int = cmd(48, 32)  # @48 feature specific


class FeatureSelect(enum.IntEnum):
    """Get Features SEL."""

    CURRENT = 0
    DEFAULT = 1
    SAVED = 2
    SUPPORTED = 3


@command(AdminOpcode.GET_FEATURES)
class GetFeatures(Command):
    """Get Features; the value comes back in the CQE result."""

    nsid: int = cmd(4, 32)  # @4
    fid: FeatureId = cmd(40, 8, enum=FeatureId)  # @40
    sel: FeatureSelect = cmd(41, 3, enum=FeatureSelect)  # @41 bits 2:0 (cdw10 10:8)
    value: int = cmd(44, 32)  # @44 cdw11, feature specific


@command(AdminOpcode.KEEP_ALIVE)
class KeepAlive(Command):
    """Keep Alive: re-arms the controller's KATO timer; no fields."""


@command(AdminOpcode.ASYNC_EVENT_REQUEST)
class AsyncEventRequest(Command):
    """Asynchronous Event Request: stays outstanding until an event (see :class:`AsyncEvent`)."""


@bitfields
class NumberOfQueues(Bits):
    """FID 0x07 cdw11 and its result: 0-based counts of I/O SQs and CQs."""

    nsqr: int = bits(0, 16)  # number of I/O submission queues, 0-based
    ncqr: int = bits(16, 16)  # number of I/O completion queues, 0-based


@bitfields
class AsyncEventConfig(Bits):
    """FID 0x0B cdw11: which notices the host wants (the OAES bits, section 10)."""

    smart: int = bits(0, 8)  # SMART / health critical warnings
    ns_attr: bool = bits(8)  # namespace attribute notices
    fw_activation: bool = bits(9)
    telemetry: bool = bits(10)
    ana_change: bool = bits(11)
    discovery_change: bool = bits(31)


OAES_NS_ATTR = 1 << 8
OAES_ANA_CHANGE = 1 << 11
OAES_DISCOVERY_CHANGE = 1 << 31


class AsyncEventType(enum.IntEnum):
    """AER completion dword 0 bits 2:0."""

    ERROR = 0
    SMART = 1
    NOTICE = 2
    IMMEDIATE = 3
    IO_CMD_SET = 6
    VENDOR = 7


class AsyncNotice(enum.IntEnum):
    """Event information for ``NOTICE`` events (dword 0 bits 15:8)."""

    NS_ATTR_CHANGED = 0x00
    FW_ACTIVATION = 0x01
    TELEMETRY = 0x02
    ANA_CHANGE = 0x03
    DISCOVERY_CHANGE = 0xF0


@bitfields
class AsyncEvent(Bits):
    """The AER completion's dword 0: what happened and which log page to read (re-arms it)."""

    event_type: AsyncEventType = bits(0, 3, enum=AsyncEventType)  # bits 2:0
    info: int = bits(8, 8)  # bits 15:8 (an AsyncNotice for NOTICE events)
    log_page: int = bits(16, 8)  # bits 23:16 e.g. 0x04 changed namespaces, 0x70 discovery

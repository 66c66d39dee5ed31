"""Fabrics commands (opcode 0x7F) and the controller registers reached through Property
Get/Set (spec sheet section 5; kernel struct nvmf_connect_command, nvmf_connect_data,
nvmf_property_{get,set}_command; NVMe base 2.0 section 3.1.3 for the registers)."""

from __future__ import annotations

import enum
import re

from blockfabric.protocol._wire import (Bits, Packed, bitfields, bits, packed, raw, text,
                                        u16)
from blockfabric.protocol.capsule import Command, cmd, command
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.opcodes import FABRICS_OPCODE, FabricsType
from blockfabric.protocol.status import StatusCode

DYNAMIC_CNTLID = 0xFFFF  # admin Connect: 'give me a new controller'
CONNECT_DATA_SIZE = 1024
NQN_SIZE = 256
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
MAX_NQN_BYTES = 223  # NVMe base 2.0 section 4.7: at most 223 bytes of UTF-8, then a NUL
#: The NQN grammar (base spec 4.7): "nqn." yyyy-mm "." reverse domain, then optionally ":"
#: and a name of printable characters without white space.
NQN_PATTERN = re.compile(r"nqn\.[0-9]{4}-(0[1-9]|1[0-2])\.[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*"
                         r"(:[^\s\x00-\x1f\x7f]+)?")
#: The UUID form: this prefix and a UUID in its 36-character text form, nothing else.
UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"
_UUID_TEXT = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                        r"[0-9a-fA-F]{12}")
CATTR_DISABLE_SQFLOW = 1 << 2  # sq_head is then reported as 0xFFFF


@command(FABRICS_OPCODE, FabricsType.CONNECT)
class ConnectCommand(Command):
    """Connect: binds the queue it arrives on to a controller (data: :class:`ConnectData`)."""

    recfmt: int = cmd(40, 16)  # @40 record format, 0
    qid: int = cmd(42, 16)  # @42 0 = admin
    sqsize: int = cmd(44, 16)  # @44 0-based
    cattr: int = cmd(46, 8)  # @46 bit 2: disable SQ flow control
    kato: int = cmd(48, 32)  # @48 keep-alive timeout, ms (admin queue only)

    def _check(self) -> None:
        if self.recfmt != 0:
            raise ProtocolError(f"Connect recfmt {self.recfmt}",
                                StatusCode.CONNECT_INCOMPATIBLE_FORMAT)

    @property
    def sq_flow_control_disabled(self) -> bool:
        return bool(self.cattr & CATTR_DISABLE_SQFLOW)


@packed(CONNECT_DATA_SIZE, short=StatusCode.SGL_DATA_LENGTH_INVALID)
class ConnectData(Packed):
    """The 1024 bytes a Connect carries (nvmet answers a short transfer 0x00F | DNR)."""

    hostid: bytes = raw(0, 16)  # @0 host identifier (UUID)
    cntlid: int = u16(16, DYNAMIC_CNTLID)  # @16; 0xFFFF on the admin queue
    subnqn: str = text(256, NQN_SIZE)  # @256 NUL terminated
    hostnqn: str = text(512, NQN_SIZE)  # @512 NUL terminated; @768..1023 reserved


def nqn_problem(nqn: str) -> str | None:
    """Why ``nqn`` (as :class:`ConnectData` decodes it: up to the first NUL, undecodable
    bytes as surrogate escapes) is not a valid NQN, or None if it is one.  A field without a
    NUL in its first 224 bytes is too long; the checks are those of base spec 4.7."""
    raw = nqn.encode("utf-8", "surrogateescape")
    if not raw:
        return "empty"
    if len(raw) > MAX_NQN_BYTES:
        return f"{len(raw)} bytes, more than {MAX_NQN_BYTES} (or not NUL terminated)"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    if not nqn.isprintable():
        return "holds characters that are not printable"
    if not NQN_PATTERN.fullmatch(nqn):
        return "not of the form nqn.yyyy-mm.reverse.domain[:name]"
    if nqn.startswith(UUID_NQN_PREFIX) and not _UUID_TEXT.fullmatch(nqn[len(UUID_NQN_PREFIX):]):
        return f"{UUID_NQN_PREFIX} not followed by a UUID"
    return None


class IATTR(enum.IntEnum):
    """Where the invalid Connect parameter is: IATTR in CQE dword 0 bits 23:16."""

    SQE = 0
    DATA = 1


def connect_invalid_param_result(where: IATTR, offset: int) -> int:
    """CQE dword 0 nvmet reports with 0x182: IATTR<<16 | IPO (byte offset in the SQE or data),
    as the kernel's IPO_IATTR_CONNECT_SQE/_DATA."""
    return int(where) << 16 | offset


# offsets nvmet reports, from the declarations above
IPO_SQE_QID = 42
IPO_SQE_SQSIZE = 44
IPO_DATA_CNTLID = 16
IPO_DATA_SUBNQN = 256
IPO_DATA_HOSTNQN = 512


def connect_invalid_param(message: str, where: IATTR, offset: int) -> ProtocolError:
    """The error for a bad Connect field, with IATTR/IPO in ``result``."""
    return ProtocolError(message, StatusCode.CONNECT_INVALID_PARAM,
                         result=connect_invalid_param_result(where, offset))


class Property(enum.IntEnum):
    """Register offsets reachable with Property Get/Set."""

    CAP = 0x00
    VS = 0x08
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20


PROPERTY_ATTRIB_SIZE8 = 1  # attrib bit 0: 8-byte access


@command(FABRICS_OPCODE, FabricsType.PROPERTY_GET)
class PropertyGet(Command):
    """Read a register; the value comes back in the CQE result."""

    attrib: int = cmd(40, 8)  # @40 bit 0: 8 bytes, else 4
    offset: int = cmd(44, 32)  # @44 register offset

    @property
    def size(self) -> int:
        return 8 if self.attrib & PROPERTY_ATTRIB_SIZE8 else 4


@command(FABRICS_OPCODE, FabricsType.PROPERTY_SET)
class PropertySet(Command):
    """Write a register (in practice CC)."""

    attrib: int = cmd(40, 8)  # @40 bit 0: 8 bytes, else 4
    offset: int = cmd(44, 32)  # @44 register offset
    value: int = cmd(48, 64)  # @48

    @property
    def size(self) -> int:
        return 8 if self.attrib & PROPERTY_ATTRIB_SIZE8 else 4


# --------------------------------------------------------------------------- registers

@bitfields
class CAP(Bits):
    """Controller Capabilities (8 bytes, read only)."""

    mqes: int = bits(0, 16)  # max queue entries supported, 0-based
    cqr: bool = bits(16)  # contiguous queues required
    ams: int = bits(17, 2)  # arbitration mechanisms supported
    to: int = bits(24, 8)  # ready timeout, units of 500 ms
    dstrd: int = bits(32, 4)  # doorbell stride
    nssrs: bool = bits(36)  # NVM subsystem reset supported
    css: int = bits(37, 8)  # command sets supported: bit 37 = NVM
    bps: bool = bits(45)  # boot partition support
    mpsmin: int = bits(48, 4)  # min page size 2^(12+n)
    mpsmax: int = bits(52, 4)  # max page size 2^(12+n)

    CSS_NVM = 1  # css bit 0 (register bit 37)


@bitfields
class VS(Bits):
    """Version (4 bytes), e.g. 1.3.0 = 0x00010300."""

    ter: int = bits(0, 8)
    mnr: int = bits(8, 8)
    mjr: int = bits(16, 16)


class Shutdown(enum.IntEnum):
    """CC.SHN."""

    NONE = 0
    NORMAL = 1
    ABRUPT = 2


class ShutdownStatus(enum.IntEnum):
    """CSTS.SHST."""

    NORMAL = 0
    IN_PROGRESS = 1
    COMPLETE = 2


CC_IOSQES = 6  # 64-byte SQEs
CC_IOCQES = 4  # 16-byte CQEs


@bitfields
class CC(Bits):
    """Controller Configuration (4 bytes, written by the host)."""

    en: bool = bits(0)  # enable
    css: int = bits(4, 3)  # I/O command set selected (0 = NVM)
    mps: int = bits(7, 4)  # memory page size 2^(12+n)
    ams: int = bits(11, 3)  # arbitration mechanism
    shn: int = bits(14, 2)  # shutdown notification (a Shutdown; 3 is reserved)
    iosqes: int = bits(16, 4)  # I/O SQ entry size, log2
    iocqes: int = bits(20, 4)  # I/O CQ entry size, log2
    crime: bool = bits(24)  # controller ready independent of media


@bitfields
class CSTS(Bits):
    """Controller Status (4 bytes, read only)."""

    rdy: bool = bits(0)  # ready
    cfs: bool = bits(1)  # controller fatal status
    shst: int = bits(2, 2)  # a ShutdownStatus
    nssro: bool = bits(4)  # NVM subsystem reset occurred
    pp: bool = bits(5)  # processing paused

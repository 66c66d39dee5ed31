"""The NVMe/TCP transport binding's PDUs (spec sheet ``nvmeof-tcp-ana-resv.md`` section 1;
include/linux/nvme-tcp.h): sans-I/O, a codec and its checks, nothing that touches a socket.

Every PDU starts with the 8-byte common header (type, flags, hlen, pdo, plen).  A receiver
reads those 8 bytes, asks :func:`check_header` whether the rest may be read (every field is
checked against the PDU type, the direction, the negotiated digests and the receiver's size
limits *before* a byte more is buffered), and then decodes the type's fields with the
``unpack_*`` helpers, which check what depends on them.  A violation raises
:class:`PduError` carrying the Fatal Error Status (FES) and Fatal Error Information (FEI,
the byte offset of the offending field in the PDU header) of the termination request the
receiver sends before it closes the connection.

Data alignment: a receiver may ask for the data of the PDUs it receives to start at a
multiple of (PDA + 1) dwords from the PDU's start (HPDA in ICReq for the host's,
CPDA in ICResp for the controller's; 0's based, at most 31: 128 bytes).  The sender then
sets PDO to the header's length (and its digest) rounded up to that multiple and fills the
gap with zero bytes; PDA 0 means no padding, as every header is a multiple of 4 bytes.

Digests are CRC32C (Castagnoli) as an LE u32: the header digest follows the ``hlen`` header
bytes, the data digest is the last 4 bytes of a PDU that carries data.  ICReq, ICResp and the
termination requests never carry digests.

The per-I/O helpers pack into and unpack from precompiled structs, without objects.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from crc32c import crc32c

from blockfabric.protocol._wire import Buffer

# -- types, flags, sizes ---------------------------------------------------------------------

# PDU types
ICREQ = 0x0
ICRESP = 0x1
H2C_TERM = 0x2
C2H_TERM = 0x3
CAPSULE_CMD = 0x4
CAPSULE_RESP = 0x5
H2C_DATA = 0x6
C2H_DATA = 0x7
R2T = 0x9

F_HDGST = 0x01
F_DDGST = 0x02
F_DATA_LAST = 0x04
F_DATA_SUCCESS = 0x08

#: the header length (hlen) of each type: the Linux target checks it per type, the host
#: wants 24 on every PDU it receives after ICResp
HLEN = {ICREQ: 128, ICRESP: 128, H2C_TERM: 24, C2H_TERM: 24, CAPSULE_CMD: 72,
        CAPSULE_RESP: 24, H2C_DATA: 24, C2H_DATA: 24, R2T: 24}
COMMON_SIZE = 8
IC_SIZE = 128
DIGEST_SIZE = 4
TERM_HLEN = 24
#: a termination request carries at most 128 bytes of the offending PDU after its header
TERM_MAX_PLEN = TERM_HLEN + 128
SQE_OFFSET = 8                  # the SQE inside a CapsuleCmd, the CQE inside a CapsuleResp
PFV_1_0 = 0
DIGEST_HDGST = 0x01             # ICReq/ICResp digest byte
DIGEST_DDGST = 0x02
#: the largest HPDA/CPDA (0's based dwords: 128-byte alignment)
MAX_PDA = 31
#: the least MAXH2CDATA a Linux host accepts (NVME_TCP_MIN_MAXH2CDATA)
MIN_MAXH2CDATA = 4096
#: NVME_TCP_ADMIN_CCSZ: in-capsule data the Linux host sends on the admin queue and with
#: any Fabrics command (Connect carries its 1024 bytes that way), whatever IOCCSZ says
ADMIN_CCSZ = 8192
#: the discovery port (NVME_TCP_DISC_PORT) and the I/O port
DISCOVERY_PORT = 8009
IO_PORT = 4420
#: the SGL descriptor types NVMe/TCP uses (SQE byte 39): in-capsule data at an offset, and
#: a transport data block that the controller moves with R2T/H2CData or C2HData
SGL_INCAPSULE = 0x01
SGL_TRANSPORT = 0x5A

#: who receives: the controller (target) gets host-to-controller PDUs, the host the others
TO_CONTROLLER = frozenset((ICREQ, H2C_TERM, CAPSULE_CMD, H2C_DATA))
TO_HOST = frozenset((ICRESP, C2H_TERM, CAPSULE_RESP, C2H_DATA, R2T))
_HAS_DATA = frozenset((CAPSULE_CMD, H2C_DATA, C2H_DATA))


class Fes(enum.IntEnum):
    """Fatal Error Status of a termination request."""

    INVALID_HEADER_FIELD = 0x01
    SEQUENCE_ERROR = 0x02
    HEADER_DIGEST = 0x03
    DATA_OUT_OF_RANGE = 0x04
    DATA_LIMIT_EXCEEDED = 0x05      # also "R2T limit exceeded"
    UNSUPPORTED_PARAMETER = 0x06


# FEI values: offsets of the common header's fields
FEI_TYPE, FEI_FLAGS, FEI_HLEN, FEI_PDO, FEI_PLEN = 0, 1, 2, 3, 4


class PduError(Exception):
    """A PDU the receiver must not accept: terminate the connection with ``fes``/``fei``."""

    #: the PDU bytes that broke the rule, for the termination request (set by the receiver)
    offending: bytes = b""

    def __init__(self, message: str, fes: int, fei: int = 0) -> None:
        super().__init__(message)
        self.fes = int(fes)
        self.fei = fei


# -- the common header -------------------------------------------------------------------

COMMON = struct.Struct("<BBBBI")
_unpack_common = COMMON.unpack_from
_pack_common_into = COMMON.pack_into


@dataclass(frozen=True, slots=True)
class Limits:
    """What one receiver accepts, fixed once the connection is initialised.

    ``max_capsule_data``: in-capsule bytes a CapsuleCmd may carry; ``max_data``: data bytes
    in one H2CData or C2HData PDU (MAXH2CDATA for a controller, the largest read a host
    expects); ``hdgst``/``ddgst``: the digests negotiated (False before ICReq/ICResp);
    ``align``: the data alignment in bytes this receiver asked for ((PDA + 1) * 4)."""

    hdgst: bool = False
    ddgst: bool = False
    max_capsule_data: int = 0
    max_data: int = 0
    align: int = 4


def header(buf: Buffer, offset: int = 0) -> tuple[int, int, int, int, int]:
    """(type, flags, hlen, pdo, plen) of the PDU at ``offset`` (8 bytes must be there)."""
    return _unpack_common(buf, offset)


def check_header(ptype: int, flags: int, hlen: int, pdo: int, plen: int, *,
                 to_controller: bool, initialized: bool, limits: Limits) -> int:
    """Check a received common header; returns the length of its data (0: none).

    ``initialized``: ICReq/ICResp have been exchanged.  Raises :class:`PduError` with the
    FES the spec names: a type the receiver never takes or a field out of place is an
    Invalid PDU Header Field (FEI: the field), a type out of order a PDU Sequence Error, a
    data PDU longer than the receiver allows a Data Transfer Limit Exceeded."""
    accepted = TO_CONTROLLER if to_controller else TO_HOST
    if ptype not in accepted:
        raise PduError(f"PDU type {ptype:#x} is not one a "
                       f"{'controller' if to_controller else 'host'} receives",
                       Fes.INVALID_HEADER_FIELD, FEI_TYPE)
    want = HLEN[ptype]
    if hlen != want:
        raise PduError(f"PDU type {ptype:#x}: hlen {hlen}, not {want}",
                       Fes.INVALID_HEADER_FIELD, FEI_HLEN)
    if ptype == ICREQ or ptype == ICRESP:
        if initialized:
            raise PduError("a second connection initialisation PDU", Fes.SEQUENCE_ERROR,
                           FEI_TYPE)
        if flags:
            raise PduError(f"IC PDU flags {flags:#x}", Fes.INVALID_HEADER_FIELD, FEI_FLAGS)
        if pdo:
            raise PduError(f"IC PDU pdo {pdo}", Fes.INVALID_HEADER_FIELD, FEI_PDO)
        if plen != IC_SIZE:
            raise PduError(f"IC PDU plen {plen}, not {IC_SIZE}", Fes.INVALID_HEADER_FIELD,
                           FEI_PLEN)
        return 0
    if not initialized and ptype != H2C_TERM and ptype != C2H_TERM:
        raise PduError(f"PDU type {ptype:#x} before connection initialisation",
                       Fes.SEQUENCE_ERROR, FEI_TYPE)
    if ptype == H2C_TERM or ptype == C2H_TERM:
        # never digests: their header is read as it is, whatever was negotiated
        if flags & (F_HDGST | F_DDGST) or pdo:
            raise PduError("termination request with digest flags or data offset",
                           Fes.INVALID_HEADER_FIELD, FEI_FLAGS if flags else FEI_PDO)
        if not TERM_HLEN <= plen <= TERM_MAX_PLEN:
            raise PduError(f"termination request plen {plen}", Fes.INVALID_HEADER_FIELD,
                           FEI_PLEN)
        return plen - TERM_HLEN
    hd = DIGEST_SIZE if limits.hdgst else 0
    if bool(flags & F_HDGST) != limits.hdgst:
        raise PduError("header digest flag %s but header digests %s" % (
            "set" if flags & F_HDGST else "clear", "negotiated" if limits.hdgst else "not"),
            Fes.INVALID_HEADER_FIELD, FEI_FLAGS)
    known = F_HDGST | F_DDGST | (F_DATA_LAST if ptype in (H2C_DATA, C2H_DATA) else 0) | \
        (F_DATA_SUCCESS if ptype == C2H_DATA else 0)
    if flags & ~known:
        raise PduError(f"PDU type {ptype:#x}: flags {flags:#x}", Fes.INVALID_HEADER_FIELD,
                       FEI_FLAGS)
    head = hlen + hd
    if ptype not in _HAS_DATA:
        if flags & F_DDGST or pdo or plen != head:
            raise PduError(f"PDU type {ptype:#x}: pdo {pdo}, plen {plen}, flags {flags:#x}: "
                           f"it carries no data", Fes.INVALID_HEADER_FIELD,
                           FEI_FLAGS if flags & F_DDGST else FEI_PDO if pdo else FEI_PLEN)
        return 0
    if plen < head:
        raise PduError(f"plen {plen} shorter than the header", Fes.INVALID_HEADER_FIELD,
                       FEI_PLEN)
    if plen == head:
        if ptype != CAPSULE_CMD:
            raise PduError("a data PDU without data", Fes.INVALID_HEADER_FIELD, FEI_PLEN)
        if pdo or flags & F_DDGST:
            raise PduError("capsule without data: pdo and the data digest flag must be 0",
                           Fes.INVALID_HEADER_FIELD, FEI_PDO if pdo else FEI_FLAGS)
        return 0
    # data follows: after the header (and its digest), padded to the receiver's alignment
    align = limits.align
    if align > 4:
        head = -(-head // align) * align
    if pdo != head:
        raise PduError(f"pdo {pdo}, the data must start at {head}",
                       Fes.INVALID_HEADER_FIELD, FEI_PDO)
    dd = DIGEST_SIZE if limits.ddgst else 0
    if bool(flags & F_DDGST) != limits.ddgst:
        raise PduError("data digest flag %s but data digests %s" % (
            "set" if flags & F_DDGST else "clear", "negotiated" if limits.ddgst else "not"),
            Fes.INVALID_HEADER_FIELD, FEI_FLAGS)
    length = plen - head - dd
    if length <= 0:
        raise PduError(f"plen {plen} leaves no room for data", Fes.INVALID_HEADER_FIELD,
                       FEI_PLEN)
    most = limits.max_capsule_data if ptype == CAPSULE_CMD else limits.max_data
    if length > most:
        raise PduError(f"PDU type {ptype:#x} carries {length} bytes, more than {most}",
                       Fes.DATA_LIMIT_EXCEEDED if ptype != CAPSULE_CMD
                       else Fes.INVALID_HEADER_FIELD, FEI_PLEN)
    return length


def digest(data: Buffer, value: int = 0) -> int:
    """CRC32C as NVMe/TCP stores it (seed and final XOR ~0: what ``crc32c`` returns);
    ``value``: the digest of the bytes before ``data`` (0: none)."""
    return crc32c(data, value)


_DIGEST = struct.Struct("<I")
pack_digest = _DIGEST.pack
unpack_digest = _DIGEST.unpack_from


# -- connection initialisation ------------------------------------------------------------

_IC = struct.Struct("<BBBBIHBBI")     # common header, pfv, hpda|cpda, digest, maxr2t|maxdata


def _pack_ic(ptype: int, pfv: int, pda: int, hdgst: bool, ddgst: bool, last: int) -> bytes:
    """An ICReq or ICResp: the two share one layout (``pda``: HPDA or CPDA; ``last``:
    MAXR2T or MAXH2CDATA)."""
    buf = bytearray(IC_SIZE)
    _IC.pack_into(buf, 0, ptype, 0, IC_SIZE, 0, IC_SIZE, pfv, pda,
                  (DIGEST_HDGST if hdgst else 0) | (DIGEST_DDGST if ddgst else 0), last)
    return bytes(buf)


def _unpack_ic(buf: Buffer, what: str, pda_name: str) -> tuple[int, int, int, int]:
    """(pfv, pda, digest bits, last field) of an ICReq or ICResp, with the checks both
    get: PFV 1.0, the PDA up to 31."""
    _t, _f, _h, _p, _l, pfv, pda, dig, last = _IC.unpack_from(buf)
    if pfv != PFV_1_0:
        raise PduError(f"{what} PFV {pfv}", Fes.INVALID_HEADER_FIELD, 8)
    if pda > MAX_PDA:
        raise PduError(f"{what} {pda_name} {pda}: at most {MAX_PDA}",
                       Fes.INVALID_HEADER_FIELD, 10)
    return pfv, pda, dig, last


@dataclass(frozen=True, slots=True)
class ICReq:
    pfv: int = PFV_1_0
    hpda: int = 0                   # host PDU data alignment, dwords, 0's based
    hdgst: bool = False
    ddgst: bool = False
    maxr2t: int = 0                 # 0's based: outstanding R2Ts per command

    def pack(self) -> bytes:
        return _pack_ic(ICREQ, self.pfv, self.hpda, self.hdgst, self.ddgst, self.maxr2t)

    @classmethod
    def unpack(cls, buf: Buffer) -> ICReq:
        """Decode (the header already passed :func:`check_header`) and check what a
        controller supports: PFV 1.0, HPDA up to 31, known digest bits."""
        pfv, hpda, dig, maxr2t = _unpack_ic(buf, "ICReq", "HPDA")
        if dig & ~(DIGEST_HDGST | DIGEST_DDGST):
            raise PduError(f"ICReq digest {dig:#x}", Fes.INVALID_HEADER_FIELD, 11)
        return cls(pfv, hpda, bool(dig & DIGEST_HDGST), bool(dig & DIGEST_DDGST), maxr2t)


@dataclass(frozen=True, slots=True)
class ICResp:
    pfv: int = PFV_1_0
    cpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxh2cdata: int = 0

    def pack(self) -> bytes:
        return _pack_ic(ICRESP, self.pfv, self.cpda, self.hdgst, self.ddgst, self.maxh2cdata)

    @classmethod
    def unpack(cls, buf: Buffer, request: ICReq) -> ICResp:
        """Decode and check against the ``request`` sent, as the Linux host does: PFV 1.0,
        the digests exactly as asked, CPDA up to 31, MAXH2CDATA a multiple of 4 of at least
        4096."""
        pfv, cpda, dig, maxdata = _unpack_ic(buf, "ICResp", "CPDA")
        hd, dd = bool(dig & DIGEST_HDGST), bool(dig & DIGEST_DDGST)
        if dig & ~(DIGEST_HDGST | DIGEST_DDGST) or hd != request.hdgst or \
                dd != request.ddgst:
            raise PduError(f"ICResp digest {dig:#x} differs from the request's",
                           Fes.INVALID_HEADER_FIELD, 11)
        if maxdata % 4 or maxdata < MIN_MAXH2CDATA:
            raise PduError(f"ICResp MAXH2CDATA {maxdata}", Fes.INVALID_HEADER_FIELD, 12)
        return cls(pfv, cpda, hd, dd, maxdata)


# -- capsules, data, R2T -----------------------------------------------------------------

_H24 = struct.Struct("<BBBBIHHII4x")     # common header + cccid, ttag, offset, length
pack_h24_into = _H24.pack_into
H24 = _H24.size


#: (cccid, ttag, data offset, data length) @8 of an H2CData, C2HData or R2T header
DATA_FIELDS = struct.Struct("<HHII")


def unpack_data_fields(buf: Buffer, offset: int = 0) -> tuple[int, int, int, int]:
    """(cccid, ttag, data offset, data length) of an H2CData, C2HData or R2T header."""
    return DATA_FIELDS.unpack_from(buf, offset + 8)


def align_of(pda: int) -> int:
    """The alignment in bytes that a PDA (0's based dwords) asks for."""
    return (pda + 1) * 4


def pdu_lengths(ptype: int, data_len: int, hdgst: bool, ddgst: bool,
                align: int = 4) -> tuple[int, int, int]:
    """(flags, pdo, plen) of a PDU of ``ptype`` with ``data_len`` bytes of data, which the
    receiver wants ``align``-byte aligned."""
    hd = DIGEST_SIZE if hdgst else 0
    head = HLEN[ptype] + hd
    flags = F_HDGST if hdgst else 0
    if not data_len:
        return flags, 0, head
    if align > 4:
        head = -(-head // align) * align
    if ddgst:
        flags |= F_DDGST
        return flags, head, head + data_len + DIGEST_SIZE
    return flags, head, head + data_len


def capsule_cmd_header(sqe: Buffer, data_len: int, hdgst: bool, ddgst: bool,
                       align: int = 4) -> bytearray:
    """The CapsuleCmd header (and its digest, and the zero padding to ``align``) for a
    64-byte ``sqe`` with ``data_len`` bytes of in-capsule data to follow (whose digest the
    caller appends)."""
    if hdgst or ddgst or align > 4:
        flags, pdo, plen = pdu_lengths(CAPSULE_CMD, data_len, hdgst, ddgst, align)
    else:                               # the common case, without the general sums
        flags, pdo, plen = 0, 72 if data_len else 0, 72 + data_len
    out = bytearray(pdo or 72 + (DIGEST_SIZE if hdgst else 0))
    _pack_common_into(out, 0, CAPSULE_CMD, flags, 72, pdo, plen)
    out[8:72] = sqe
    if hdgst:
        out[72:76] = pack_digest(crc32c(memoryview(out)[:72]))
    return out


def data_header(ptype: int, flags: int, cccid: int, ttag: int, offset: int, length: int,
                hdgst: bool, ddgst: bool, align: int = 4) -> bytearray:
    """An H2CData, C2HData or R2T header (with its digest, and for data the zero padding
    to ``align``); ``flags``: LAST/SUCCESS."""
    if hdgst or ddgst or align > 4:
        f, pdo, plen = pdu_lengths(ptype, length if ptype != R2T else 0, hdgst, ddgst, align)
    elif ptype == R2T:                  # the common cases, without the general sums
        f, pdo, plen = 0, 0, H24
    else:
        f, pdo, plen = 0, H24, H24 + length
    out = bytearray(pdo or H24 + (DIGEST_SIZE if hdgst else 0))
    pack_h24_into(out, 0, ptype, f | flags, H24, pdo, plen, cccid, ttag, offset, length)
    if hdgst:
        out[24:28] = pack_digest(crc32c(memoryview(out)[:24]))
    return out


def capsule_resp(cqe: Buffer, hdgst: bool) -> bytearray:
    """A CapsuleResp carrying the 16-byte ``cqe``."""
    out = bytearray(24 + (DIGEST_SIZE if hdgst else 0))
    COMMON.pack_into(out, 0, CAPSULE_RESP, F_HDGST if hdgst else 0, 24, 0, len(out))
    out[8:24] = cqe
    if hdgst:
        out[24:28] = pack_digest(crc32c(memoryview(out)[:24]))
    return out


def term_req(ptype: int, fes: int, fei: int, offending: Buffer = b"") -> bytes:
    """An H2C or C2H termination request: FES, FEI and up to 128 bytes of the offending
    PDU's header; never digests.  FEI says where the error is only for FES 01h (Invalid
    Header Field) and 06h (Unsupported Parameter); for the others it is reserved, so zero
    (as SPDK sends it), whatever ``fei`` the error noted."""
    if fes != Fes.INVALID_HEADER_FIELD and fes != Fes.UNSUPPORTED_PARAMETER:
        fei = 0
    extra = bytes(offending[:TERM_MAX_PLEN - TERM_HLEN])
    out = bytearray(TERM_HLEN)
    COMMON.pack_into(out, 0, ptype, 0, TERM_HLEN, 0, TERM_HLEN + len(extra))
    struct.pack_into("<HI", out, 8, fes, fei)
    return bytes(out) + extra


def unpack_term(buf: Buffer) -> tuple[int, int]:
    """(FES, FEI) of a termination request."""
    return struct.unpack_from("<HI", buf, 8)

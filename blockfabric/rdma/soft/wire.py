"""The soft provider's wire: one fixed 32-byte frame header, declared once.

Pure code (no I/O), so it can be tested and reused without sockets.  The layout and the
meaning of each field per frame type are documented in :mod:`blockfabric.rdma.soft`;
:func:`decode` is the one place that says which values each frame type may carry.
"""

from __future__ import annotations

import enum
import struct

MAGIC = 0xBF
VERSION = 3
PSN_MASK = 0xFFFFFFFF

#: magic u8, version u8, type u8, flags u8, psn u32, length u32, key u32, extra u32, ack u32,
#: addr u64
HEADER = struct.Struct("<BBBBIIIIIQ")
HEADER_SIZE = HEADER.size  # 32
FLAGS_AT = 3               # where a header's flags byte is

#: Version 1 (until this one): b"BFRD", version u8, type u8, flags u16, psn, length, key,
#: extra (u32 each), addr u64.  Kept only to recognise such a peer and to refuse it in a
#: way it understands (a version-1 CONN_REJ).
V1_MAGIC = b"BFRD"
V1_HEADER = struct.Struct("<4sBBHIIIIQ")

MAX_REQ_PRIVATE_DATA = 56      # IB CM REQ private data
MAX_REP_PRIVATE_DATA = 196     # IB CM REP / REJ private data
MAX_MESSAGE = 1 << 31          # ibv_port_attr.max_msg_sz of a typical HCA
MAX_QP_NUM = 0xFFFFFF          # QP numbers are 24 bits


class Frame(enum.IntEnum):
    """Frame types.  CM frames set up and tear down a connection; request frames consume one
    PSN of the sender's request stream; response frames travel the other way."""

    CONN_REQ = 1      # payload: REQ private data; extra: requester qp_num
    CONN_REP = 2      # payload: REP private data; extra: responder qp_num
    CONN_REJ = 3      # payload: REJ private data
    CONN_RTU = 4      # ready to use: the active side saw the REP
    DREQ = 5          # disconnect request; the socket closes after it
    SHARE = 6         # same-host only: the region [addr, addr+length) under key (extra:
    #                   its access bits) is the memfd passed with these bytes (SCM_RIGHTS)
    FORGET = 7        # same-host only: the region under key is gone; unmap it
    SEND = 16         # payload: message; extra: imm_data or invalidate rkey (flags say which)
    WRITE = 17        # payload: data for [addr, addr+length) under key
    READ_REQ = 18     # no payload: read `length` bytes at addr under key
    READ_RESP = 32    # payload: the data read for request `psn`
    ACK = 33          # every request up to and including `psn` was executed (coalesced)
    NAK = 34          # request `psn` failed; key = WcStatus the requester reports
    RNR_NAK = 35      # request `psn` found no receive posted; retry later


class FrameFlags(enum.IntFlag):
    """Header flag bits."""

    WITH_IMM = 1
    WITH_INV = 2
    ACK = 4         # the ack field carries a cumulative ACK of the other direction's requests
    SHM = 8         # WRITE, READ_REQ, READ_RESP: the data moves through the shared region
                    # under key (same-host connections), no payload follows
    ACK_REQ = 16    # ACK: the sender waits on the other direction's acknowledgement:
                    # send it at the end of this pass, not later (IB's AckReq)


REQUEST_FRAMES = frozenset((Frame.SEND, Frame.WRITE, Frame.READ_REQ))
PAYLOAD_FRAMES = frozenset((Frame.CONN_REQ, Frame.CONN_REP, Frame.CONN_REJ, Frame.SEND,
                            Frame.WRITE, Frame.READ_RESP))


def pack(ftype: int, psn: int = 0, length: int = 0, key: int = 0, extra: int = 0,
         addr: int = 0, flags: int = 0, ack: int = 0, version: int = VERSION) -> bytes:
    """One header, ready for the wire (``ack`` means something only with FrameFlags.ACK;
    ``version``: another only to refuse a peer of that version in its own terms)."""
    return HEADER.pack(MAGIC, version, ftype, flags, psn & PSN_MASK, length, key, extra, ack,
                       addr)


def pack_v1(ftype: int, length: int = 0) -> bytes:
    """A version-1 header (CM frames only): how a version-1 peer is told no."""
    return V1_HEADER.pack(V1_MAGIC, 1, ftype, 0, 0, length, 0, 0, 0)


def psn_le(a: int, b: int) -> bool:
    """``a <= b`` in 32-bit serial-number arithmetic (PSNs wrap)."""
    return ((b - a) & PSN_MASK) < 0x80000000


class WireError(ValueError):
    """A frame that is not ours or not this version: the connection is dropped."""


class VersionError(WireError):
    """The peer speaks another version of this wire (``version``)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the peer speaks soft-RDMA wire version {version}, this side "
                         f"version {VERSION}: upgrade the older side")
        self.version = version


def _foreign(buf) -> WireError:
    """Why a header with a wrong magic or version is refused."""
    if bytes(buf[:4]) == V1_MAGIC:
        return VersionError(buf[4])
    if buf[0] == MAGIC:
        return VersionError(buf[1])
    return WireError(f"bad magic {bytes(buf[:4])!r}")


def unpack(buf) -> tuple[int, int, int, int, int, int, int]:
    """(type, flags, psn, length, key, extra, addr) of a header; WireError if foreign.
    Only magic and version are checked: a peer's own frames go through :func:`decode`."""
    magic, version, ftype, flags, psn, length, key, extra, _ack, addr = HEADER.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise _foreign(buf)
    return ftype, flags, psn, length, key, extra, addr


def unpack_ack(buf) -> int | None:
    """The ACK a header carries (FrameFlags.ACK), else None."""
    return HEADER.unpack_from(buf)[8] if buf[3] & FrameFlags.ACK else None


#: The statuses a NAK may carry: the remote errors a responder reports (REM_INV_REQ_ERR,
#: REM_ACCESS_ERR, REM_OP_ERR, as ibv_wc_status numbers them).
NAK_STATUSES = frozenset((9, 10, 11))

# Per frame type: (flags it may set, largest length, fields that must be zero).  Fields:
_PSN, _KEY, _EXTRA, _ADDR = 1, 2, 4, 8
_F_IMM, _F_INV = int(FrameFlags.WITH_IMM), int(FrameFlags.WITH_INV)
_F_ACK, _F_SHM = int(FrameFlags.ACK), int(FrameFlags.SHM)
_F_ACK_REQ = int(FrameFlags.ACK_REQ)
_RULES: dict[int, tuple[int, int, int]] = {
    Frame.CONN_REQ: (0, MAX_REQ_PRIVATE_DATA, _PSN | _KEY | _ADDR),
    Frame.CONN_REP: (0, MAX_REP_PRIVATE_DATA, _PSN | _KEY | _ADDR),
    Frame.CONN_REJ: (0, MAX_REP_PRIVATE_DATA, _PSN | _KEY | _EXTRA | _ADDR),
    Frame.CONN_RTU: (0, 0, _PSN | _KEY | _EXTRA | _ADDR),
    Frame.DREQ: (0, 0, _PSN | _KEY | _EXTRA | _ADDR),
    Frame.SHARE: (0, MAX_MESSAGE, _PSN),
    Frame.FORGET: (0, 0, _PSN | _EXTRA | _ADDR),
    Frame.SEND: (_F_IMM | _F_INV | _F_ACK, MAX_MESSAGE, _KEY | _EXTRA | _ADDR),
    Frame.WRITE: (_F_IMM | _F_ACK | _F_SHM, MAX_MESSAGE, _EXTRA),
    Frame.READ_REQ: (_F_ACK | _F_SHM, MAX_MESSAGE, _EXTRA),
    Frame.READ_RESP: (_F_SHM, MAX_MESSAGE, _KEY | _EXTRA | _ADDR),
    Frame.ACK: (_F_ACK_REQ, 0, _KEY | _EXTRA | _ADDR),
    Frame.NAK: (0, 0, _EXTRA | _ADDR),
    Frame.RNR_NAK: (0, 0, _KEY | _EXTRA | _ADDR),
}
_unpack_from = HEADER.unpack_from
_BOTH = _F_IMM | _F_INV
_MEANING = _F_IMM | _F_INV      # the flags that give ``extra`` a meaning
_NAK, _CONN_REP = int(Frame.NAK), int(Frame.CONN_REP)


def decode(buf, at: int = 0) -> tuple[int, int, int, int, int, int, int, int]:
    """The header at ``buf[at:]`` as (type, flags, psn, length, key, extra, addr, ack), every
    field checked against what its frame type allows: a known type, only its flags (and not
    immediate data and invalidate together), a length within its bound (private data sizes,
    MAX_MESSAGE), zero in the fields it does not use (``extra`` only with a flag that gives
    it a meaning, ``ack`` only with FrameFlags.ACK), a 24-bit QP number in CONN_REQ and
    CONN_REP, a remote error status in a NAK.  Anything else raises WireError (VersionError
    for a peer of another version)."""
    magic, version, ftype, flags, psn, length, key, extra, ack, addr = _unpack_from(buf, at)
    if magic != MAGIC or version != VERSION:
        raise _foreign(buf[at:at + 5])
    rule = _RULES.get(ftype)
    if rule is None:
        raise WireError(f"unknown frame type {ftype}")
    allowed, longest, zero = rule
    if flags & ~allowed or flags & _BOTH == _BOTH or length > longest or (ack and not (
            flags & _F_ACK)) or (zero and (
            (zero & _PSN and psn) or (zero & _KEY and key) or (zero & _ADDR and addr)
            or (zero & _EXTRA and extra and not flags & _MEANING))):
        raise WireError(f"frame type {ftype} with a field outside what it allows (flags "
                        f"{flags:#x}, length {length}, key {key:#x}, extra {extra:#x}, "
                        f"ack {ack:#x}, address {addr:#x})")
    if ftype <= _CONN_REP and extra > MAX_QP_NUM:
        raise WireError(f"QP number {extra:#x} is not 24 bits")
    if ftype == _NAK and key not in NAK_STATUSES:
        raise WireError(f"NAK with status {key}, not a remote error")
    return ftype, flags, psn, length, key, extra, addr, ack

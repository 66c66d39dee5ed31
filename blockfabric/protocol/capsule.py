"""The 64-byte SQE and 16-byte CQE (spec sheet section 2), and the declarative base of the
typed commands that live in the SQE's command dwords.

SQE and CQE are written by hand: one of each is decoded/encoded per I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar, dataclass_transform

from blockfabric.protocol._wire import Buffer, Encodable, enum_lookup, need_bytes
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.sgl import NULL_SGL, SGL, TYPE_OFFSET, sgl_from_words
from blockfabric.protocol.status import STATUS_MASK, StatusCode, status_code

SQE_SIZE = 64
CQE_SIZE = 16
PSDT_SGL = 0x40  # flags bits 7:6 = 01: SGLs, the only form a fabrics transport uses
FLAGS_FUSE_MASK = 0x03
FLAGS_PSDT_MASK = 0xC0
NSID_ALL = 0xFFFFFFFF

# opcode @0, flags @1, command_id @2, nsid @4, cdw2 @8, cdw3 @12, mptr @16, SGL1 @24 as two
# u64s (@24 addr, @32 length/key/type), cdw10..cdw15 @40..63
_SQE = struct.Struct("<BBHIIIQQQ6I")
# result u64 @0, sq_head @8, sq_id @10, command_id @12, status word @14
_CQE = struct.Struct("<QHHHH")
_WORD_MASKS = (0xFFFFFFFF, 0xFFFFFF, 0xFFFFFFFF)


@dataclass(slots=True)
class SQE(Encodable):
    """A submission queue entry: the generic view every typed command is built on."""

    opcode: int  # @0
    flags: int = PSDT_SGL  # @1 bits 1:0 fused, 7:6 PSDT
    cid: int = 0  # @2 command identifier, echoed in the CQE
    nsid: int = 0  # @4 (fabrics commands: fctype in its low byte)
    cdw2: int = 0  # @8
    cdw3: int = 0  # @12
    mptr: int = 0  # @16 metadata pointer
    sgl: SGL = NULL_SGL  # @24 SGL1, 16 bytes
    cdw10: int = 0  # @40
    cdw11: int = 0  # @44
    cdw12: int = 0  # @48
    cdw13: int = 0  # @52
    cdw14: int = 0  # @56
    cdw15: int = 0  # @60

    SIZE: ClassVar[int] = SQE_SIZE

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        sgl = self.sgl
        if sgl.type_byte == TYPE_OFFSET:
            addr, word = sgl.offset, sgl.length | TYPE_OFFSET << 56  # type: ignore[union-attr]
        else:
            addr = sgl.addr  # type: ignore[union-attr]
            word = sgl.length | sgl.key << 24 | sgl.type_byte << 56  # type: ignore[union-attr]
        _SQE.pack_into(buf, offset, self.opcode, self.flags, self.cid, self.nsid, self.cdw2,
                       self.cdw3, self.mptr, addr, word, self.cdw10, self.cdw11, self.cdw12,
                       self.cdw13, self.cdw14, self.cdw15)

    @classmethod
    def unpack_from(cls, buf: Buffer, offset: int = 0) -> SQE:
        """Decode, checking flags and SGL1 as nvmet does; errors carry the cid."""
        try:
            (opcode, flags, cid, nsid, cdw2, cdw3, mptr, addr, word,
             c10, c11, c12, c13, c14, c15) = _SQE.unpack_from(buf, offset)
        except struct.error:
            need_bytes(buf, offset, SQE_SIZE, "SQE", StatusCode.INVALID_FIELD)
            raise  # pragma: no cover - need_bytes raised
        if flags & (FLAGS_FUSE_MASK | FLAGS_PSDT_MASK) != PSDT_SGL:
            raise ProtocolError(f"SQE flags {flags:#04x}: fused or not SGL",
                                StatusCode.INVALID_FIELD, cid=cid)
        try:
            sgl = sgl_from_words(addr, word)
        except ProtocolError as exc:
            exc.cid = cid
            raise
        return cls(opcode, flags, cid, nsid, cdw2, cdw3, mptr, sgl, c10, c11, c12, c13, c14,
                   c15)

    @property
    def fctype(self) -> int:
        """The fabrics command type (meaningful when opcode is 0x7F)."""
        return self.nsid & 0xFF


@dataclass(slots=True)
class CQE(Encodable):
    """A completion queue entry."""

    result: int = 0  # @0 dword 0 and 1, command specific
    sq_head: int = 0  # @8
    sq_id: int = 0  # @10
    cid: int = 0  # @12
    status: StatusCode = StatusCode.SUCCESS  # @14 bits 11:1 (SCT<<8|SC)
    dnr: bool = False  # @14 bit 15
    more: bool = False  # @14 bit 14
    crd: int = 0  # @14 bits 13:12
    phase: int = 0  # @14 bit 0 (unused on fabrics, kept for completeness)

    SIZE: ClassVar[int] = CQE_SIZE

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        if not 0 <= self.crd <= 3 or not 0 <= self.status <= STATUS_MASK:
            raise ValueError(f"status {self.status!r}/crd {self.crd} do not fit")
        _CQE.pack_into(buf, offset, self.result, self.sq_head, self.sq_id, self.cid,
                       (self.status | self.crd << 11 | self.more << 13 | self.dnr << 14) << 1
                       | (self.phase & 1))

    @classmethod
    def unpack_from(cls, buf: Buffer, offset: int = 0) -> CQE:
        try:
            result, sq_head, sq_id, cid, word = _CQE.unpack_from(buf, offset)
        except struct.error:
            # a host that gets a short response capsule has lost the transfer
            need_bytes(buf, offset, CQE_SIZE, "CQE", StatusCode.DATA_TRANSFER_ERROR)
            raise  # pragma: no cover - need_bytes raised
        return cls(result, sq_head, sq_id, cid, status_code(word >> 1), bool(word & 0x8000),
                   bool(word & 0x4000), (word >> 12) & 3, word & 1)


def pack_cqe_into(buf: Buffer, offset: int, cid: int, status: int = 0, *, result: int = 0,
                  sq_head: int = 0, sq_id: int = 0, dnr: bool = False) -> None:
    """Encode a response without building a :class:`CQE` (the target's per-I/O path)."""
    _CQE.pack_into(buf, offset, result, sq_head, sq_id, cid, (status | dnr << 14) << 1)


# --------------------------------------------------------------------------- typed commands

@dataclass(frozen=True)
class _CmdField:
    byte: int  # SQE byte offset: 4..7 (nsid dword) or 40..63 (cdw10..cdw15)
    bit: int
    width: int
    enum: type[enum.IntEnum] | None
    status: StatusCode


def cmd(byte: int, width: int, bit: int = 0, default: Any = 0, *,
        enum: type[enum.IntEnum] | None = None,
        status: StatusCode = StatusCode.INVALID_FIELD) -> Any:
    """A command field at SQE byte ``byte`` (the spec's offset), bits ``bit..bit+width-1``
    from there.  With ``enum``, other values are refused with ``status`` | DNR."""
    if not (4 <= byte <= 7 or 40 <= byte <= 63):
        raise TypeError(f"command fields live at @4..7 or @40..63, not @{byte}")
    if width == 1 and enum is None and default == 0:
        default = False
    spec = _CmdField(byte, bit, width, enum, status)
    return dataclasses.field(default=default, metadata={"cmd": spec})


C = TypeVar("C", bound="Command")


class Command:
    """Base of the typed commands: ``from_sqe`` / ``to_sqe`` from the field declarations."""

    __slots__ = ()
    OPCODE: ClassVar[int]
    FCTYPE: ClassVar[int | None] = None
    _FIELDS: ClassVar[tuple[tuple[str, bool, int, int, dict[int, Any] | None, StatusCode,
                                  bool], ...]]

    @classmethod
    def from_sqe(cls: type[C], sqe: SQE) -> C:
        """Decode from a generic SQE; a wrong opcode/fctype is INVALID_OPCODE | DNR."""
        if sqe.opcode != cls.OPCODE or (cls.FCTYPE is not None and sqe.fctype != cls.FCTYPE):
            raise ProtocolError(f"{cls.__name__}: opcode {sqe.opcode:#x}/nsid {sqe.nsid:#x}",
                                StatusCode.INVALID_OPCODE, cid=sqe.cid)
        dwords = (sqe.cdw10 | sqe.cdw11 << 32 | sqe.cdw12 << 64 | sqe.cdw13 << 96
                  | sqe.cdw14 << 128 | sqe.cdw15 << 160)
        args = []
        for name, in_nsid, shift, mask, lookup, status, is_bool in cls._FIELDS:
            v = ((sqe.nsid if in_nsid else dwords) >> shift) & mask
            if lookup is not None:
                member = lookup.get(v)
                if member is None:
                    raise ProtocolError(f"{cls.__name__}.{name}: unsupported value {v:#x}",
                                        status, cid=sqe.cid)
                v = member
            elif is_bool:
                v = bool(v)
            args.append(v)
        obj = cls(*args)
        try:
            obj._check()
        except ProtocolError as exc:
            exc.cid = sqe.cid
            raise
        return obj

    def to_sqe(self, cid: int = 0, sgl: SGL = NULL_SGL, flags: int = PSDT_SGL) -> SQE:
        """Encode into a generic SQE."""
        nsid = int(self.FCTYPE or 0)
        dwords = 0
        for name, in_nsid, shift, mask, _lookup, _status, _is_bool in self._FIELDS:
            v = int(getattr(self, name))
            if not 0 <= v <= mask:
                raise ValueError(f"{type(self).__name__}.{name}={v} does not fit")
            if in_nsid:
                nsid |= v << shift
            else:
                dwords |= v << shift
        m = 0xFFFFFFFF
        return SQE(self.OPCODE, flags, cid, nsid, 0, 0, 0, sgl, dwords & m, dwords >> 32 & m,
                   dwords >> 64 & m, dwords >> 96 & m, dwords >> 128 & m, dwords >> 160 & m)

    def _check(self) -> None:
        """Reject field values the spec forbids (override)."""


@dataclass_transform(frozen_default=True)
def command(opcode: int, fctype: int | None = None) -> Callable[[type[C]], type[C]]:
    """Make a frozen, slotted dataclass of ``cmd`` fields bound to ``opcode`` (/``fctype``)."""
    def build(cls: type[C]) -> type[C]:
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        plan = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec: _CmdField = f.metadata["cmd"]
            in_nsid = spec.byte < 8
            shift = (spec.byte - (4 if in_nsid else 40)) * 8 + spec.bit
            lookup = enum_lookup(spec.enum) if spec.enum else None
            plan.append((f.name, in_nsid, shift, (1 << spec.width) - 1, lookup, spec.status,
                         spec.width == 1 and spec.enum is None))
        klass: Any = cls
        klass.OPCODE = opcode
        klass.FCTYPE = fctype
        klass._FIELDS = tuple(plan)
        return cls
    return build

"""SGL descriptors as they appear at SQE @24 (spec sheet section 3; kernel struct
nvme_keyed_sgl_desc / nvme_sgl_desc, nvmet_rdma_map_sgl for the statuses).

Written by hand rather than declared: one is decoded per command on the I/O path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Union

from blockfabric.protocol._wire import Buffer, Encodable
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.status import StatusCode

SGL_SIZE = 16
KEYED_MAX_LENGTH = (1 << 24) - 1  # 24-bit length: one descriptor addresses < 16 MiB

# type byte @15: descriptor type in bits 7:4, subtype in bits 3:0
SGL_TYPE_DATA_BLOCK = 0x0
SGL_TYPE_KEYED_DATA_BLOCK = 0x4
SGL_SUBTYPE_ADDRESS = 0x0
SGL_SUBTYPE_OFFSET = 0x1
SGL_SUBTYPE_INVALIDATE = 0xF
TYPE_KEYED = SGL_TYPE_KEYED_DATA_BLOCK << 4 | SGL_SUBTYPE_ADDRESS  # 0x40
TYPE_KEYED_INVALIDATE = SGL_TYPE_KEYED_DATA_BLOCK << 4 | SGL_SUBTYPE_INVALIDATE  # 0x4F
TYPE_OFFSET = SGL_TYPE_DATA_BLOCK << 4 | SGL_SUBTYPE_OFFSET  # 0x01

# addr u64 @0, then bytes @8..15 read as one u64: keyed length 24 bits @8, key u32 @11,
# type @15; the offset form's length is the low u32 @8 (bytes @12..14 reserved).
_SGL = struct.Struct("<QQ")
_NULL_WORD = TYPE_KEYED << 56


class _Descriptor(Encodable):
    """What both descriptor forms share: 16 bytes, decoded by :func:`unpack_sgl`."""

    __slots__ = ()
    SIZE = SGL_SIZE

    @classmethod
    def unpack_from(cls, buf: Buffer, offset: int = 0) -> Any:
        """Decode a descriptor that must be of this form."""
        sgl = unpack_sgl(buf, offset)
        if not isinstance(sgl, cls):
            raise ProtocolError(f"expected a {cls.__name__} descriptor", StatusCode.INVALID_FIELD)
        return sgl


@dataclass(frozen=True, slots=True)
class KeyedSGL(_Descriptor):
    """Keyed data block (0x40, or 0x4F asking the target to invalidate ``key`` with its
    response).  All zero is the null descriptor: a command without data."""

    addr: int = 0  # @0 host virtual address (or offset into the MR, as the host chose)
    length: int = 0  # @8 24 bits
    key: int = 0  # @11 rkey of the host's memory region
    invalidate: bool = False  # @15 subtype 0xF instead of 0x0

    @property
    def is_null(self) -> bool:
        """True for the 'no data' descriptor."""
        return not (self.addr or self.length or self.key)

    @property
    def type_byte(self) -> int:
        return TYPE_KEYED_INVALIDATE if self.invalidate else TYPE_KEYED

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        if not 0 <= self.length <= KEYED_MAX_LENGTH:
            raise ValueError(f"keyed SGL length {self.length} exceeds 24 bits")
        _SGL.pack_into(buf, offset, self.addr,
                       self.length | self.key << 24 | self.type_byte << 56)


@dataclass(frozen=True, slots=True)
class OffsetSGL(_Descriptor):
    """Data block with an offset (0x01): data in the capsule after the SQE."""

    offset: int = 0  # @0 offset into the in-capsule data (ICDOFF = 0)
    length: int = 0  # @8 u32

    type_byte = TYPE_OFFSET

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        _SGL.pack_into(buf, offset, self.offset, self.length | TYPE_OFFSET << 56)

    def check_inline(self, inline_size: int) -> None:
        """Offset + length must lie inside the in-capsule data actually received."""
        if self.offset + self.length > inline_size:
            raise ProtocolError(f"in-capsule data {self.offset}+{self.length} beyond "
                                f"{inline_size} bytes", StatusCode.SGL_INVALID_OFFSET)


SGL = Union[KeyedSGL, OffsetSGL]
NULL_SGL = KeyedSGL()


def sgl_from_words(addr: int, word: int) -> SGL:
    """Decode from the two u64s @0 and @8; the statuses are nvmet's (section 3)."""
    type_byte = word >> 56
    if type_byte == TYPE_KEYED:
        if not addr and word == _NULL_WORD:
            return NULL_SGL
        return KeyedSGL(addr, word & 0xFFFFFF, (word >> 24) & 0xFFFFFFFF, False)
    if type_byte == TYPE_OFFSET:
        return OffsetSGL(addr, word & 0xFFFFFFFF)
    if type_byte == TYPE_KEYED_INVALIDATE:
        return KeyedSGL(addr, word & 0xFFFFFF, (word >> 24) & 0xFFFFFFFF, True)
    kind = type_byte >> 4
    if kind in (SGL_TYPE_KEYED_DATA_BLOCK, SGL_TYPE_DATA_BLOCK):
        raise ProtocolError(f"SGL type {kind:#x}: invalid subtype {type_byte & 0xF:#x}",
                            StatusCode.INVALID_FIELD)
    raise ProtocolError(f"SGL descriptor type {kind:#x} not supported",
                        StatusCode.SGL_DESCRIPTOR_TYPE_INVALID)


def unpack_sgl(buf: Buffer, offset: int = 0) -> SGL:
    """Decode a 16-byte descriptor from ``buf`` at ``offset``."""
    try:
        addr, word = _SGL.unpack_from(buf, offset)
    except struct.error:
        raise ProtocolError(f"SGL descriptor: need {SGL_SIZE} bytes at offset {offset}",
                            StatusCode.INVALID_FIELD) from None
    return sgl_from_words(addr, word)

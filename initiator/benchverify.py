"""``blockfabric bench --verify crc32c``: the header that seals every written block, and its check.

As fio's verify header: enough to tell that a block read back is the one written at its
offset, by which job and which write, and intact (CRC-32C over the block).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

VERIFY_MAGIC = 0x31564642  # "BFV1" little-endian
_VERIFY_HEADER = struct.Struct("<IIQQQII")


@dataclass(frozen=True, slots=True)
class VerifyHeader:
    """The 40 bytes that start every block written with ``--verify crc32c``, as fio's
    verify header does: enough to tell that a block is the one written at this offset, by
    which job and which write, and intact.  The CRC-32C covers the whole block except its
    own field (bytes 32..35)."""

    magic: int       # @0 u32 VERIFY_MAGIC
    length: int      # @4 u32 block length in bytes
    offset: int      # @8 u64 byte offset in the namespace the block was written to
    seed: int        # @16 u64 the writing job's seed
    numberio: int    # @24 u64 the job's write sequence number
    crc32c: int = 0  # @32 u32 CRC-32C of bytes 0..31 and 36..length-1
    reserved: int = 0  # @36 u32 zero

    SIZE = 40
    CRC_AT = 32

    def pack_into(self, buf: Any) -> None:
        _VERIFY_HEADER.pack_into(buf, 0, self.magic, self.length, self.offset, self.seed,
                                 self.numberio, self.crc32c, self.reserved)

    @classmethod
    def unpack_from(cls, buf: Any) -> VerifyHeader:
        return cls(*_VERIFY_HEADER.unpack_from(buf, 0))


def _crc32c() -> Callable[..., int]:
    """The crc32c package's CRC-32C (hardware-assisted), else a slow pure-Python one, so
    that --verify still works, only slower, where the package is not installed."""
    try:
        import crc32c
    except ModuleNotFoundError:
        return crc32c_py
    return crc32c.crc32c


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1   # Castagnoli, reflected
        table.append(n)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c_py(data: Any, value: int = 0) -> int:
    """CRC-32C (RFC 3720), continuing from ``value`` like ``crc32c.crc32c``."""
    crc = value ^ 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def block_crc(crc: Callable[..., int], view: memoryview) -> int:
    at = VerifyHeader.CRC_AT
    return crc(view[at + 4:], crc(view[:at]))


def fill_block(crc: Callable[..., int], buf: bytearray | memoryview, offset: int, seed: int,
               numberio: int) -> None:
    """Stamp the header into ``buf`` (already holding the data pattern) and seal it."""
    view = memoryview(buf)
    VerifyHeader(VERIFY_MAGIC, len(buf), offset, seed, numberio).pack_into(view)
    struct.pack_into("<I", view, VerifyHeader.CRC_AT, block_crc(crc, view))


def check_block(crc: Callable[..., int], data: bytes | memoryview, offset: int,
                expect: tuple[int, int] | None) -> str | None:
    """Why ``data`` read at ``offset`` is not the block that belongs there, or None.
    ``expect`` is (seed, numberio) of the last write this run made there, if any."""
    if len(data) < VerifyHeader.SIZE:
        return f"short block of {len(data)} bytes"
    hdr = VerifyHeader.unpack_from(data)
    if hdr.magic != VERIFY_MAGIC:
        return (f"bad magic {hdr.magic:#010x}, wanted {VERIFY_MAGIC:#010x} (was this block "
                f"written with --verify crc32c?)")
    if hdr.length != len(data):
        return f"header says {hdr.length} bytes, read {len(data)}"
    if hdr.offset != offset:
        return f"block belongs at offset {hdr.offset:#x}"
    actual = block_crc(crc, memoryview(data))
    if actual != hdr.crc32c:
        return f"bad crc32c: header has {hdr.crc32c:#010x}, data gives {actual:#010x}"
    if expect is not None and (hdr.seed, hdr.numberio) != expect:
        return (f"stale block: write {hdr.numberio} of seed {hdr.seed}, wanted write "
                f"{expect[1]} of seed {expect[0]}")
    return None

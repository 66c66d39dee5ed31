"""The Read and Write SQE's fast layout: the one place that writes and reads a Read (0x02) or
Write (0x01) command without building objects, for the per-I/O path of both sides.

It describes exactly the bytes :class:`~blockfabric.protocol.capsule.SQE` and
:class:`~blockfabric.protocol.io.ReadWrite` describe (``tests/protocol/test_rw.py`` checks
the two against each other); those stay the readable, validating form for everything that is
not a read or a write.

Layout (NVM command set figures 28-55): opcode @0, flags @1, cid @2, nsid @4, cdw2/cdw3 @8,
mptr @16, SGL1 @24 (addr u64, then length/key/type as one u64 @32), SLBA u64 @40, NLB u16
@48 (0-based) and control u16 @50 (cdw12), dsmgmt @52 (cdw13), reftag @56, cdw15 @60.
"""

from __future__ import annotations

import struct

from blockfabric.protocol._wire import Buffer
from blockfabric.protocol.capsule import PSDT_SGL
from blockfabric.protocol.sgl import TYPE_KEYED, TYPE_KEYED_INVALIDATE, TYPE_OFFSET

#: the whole 64-byte SQE of a Read/Write: opcode, flags, cid, nsid, cdw2|cdw3, mptr,
#: SGL addr, SGL word, SLBA, cdw12, cdw13, cdw14, cdw15
RW_SQE = struct.Struct("<BBHIQQQQQIIII")
#: an NVMe/TCP CapsuleCmd's first 72 bytes with a Read/Write SQE: the common header (type,
#: flags, hlen, pdo, plen), then the SQE's fields as RW_SQE has them (one pack per command)
TCP_CAPSULE_RW = struct.Struct("<BBBBI" + RW_SQE.format[1:])
#: what the target reads of one: opcode, flags, cid, nsid, SGL addr, SGL word, SLBA, cdw12
RW_FIELDS = struct.Struct("<BBHI16xQQQI")
_pack_into = RW_SQE.pack_into


def keyed_word(length: int, key: int, invalidate: bool = False) -> int:
    """SGL1's second u64 for a keyed data block of ``length`` (< 2**24) under ``key``."""
    return length | key << 24 | (TYPE_KEYED_INVALIDATE if invalidate else TYPE_KEYED) << 56


def offset_word(length: int) -> int:
    """SGL1's second u64 for in-capsule data of ``length`` bytes at offset 0."""
    return length | TYPE_OFFSET << 56


def pack_rw_into(buf: bytearray | memoryview, opcode: int, cid: int, nsid: int, slba: int, nlb: int,
                 sgl_addr: int, sgl_word: int, control: int = 0) -> None:
    """Write a whole Read/Write SQE into ``buf`` @0.  ``nlb`` is 0-based; the caller keeps
    every field in range (it built them from its own namespace and buffers)."""
    _pack_into(buf, 0, opcode, PSDT_SGL, cid, nsid, 0, 0, sgl_addr, sgl_word, slba,
               nlb | control << 16, 0, 0, 0)


def unpack_rw(buf: Buffer) -> tuple[int, int, int, int, int, int, int, int]:
    """(opcode, flags, cid, nsid, sgl_addr, sgl_word, slba, cdw12) of a 64-byte SQE: raw
    words, nothing checked; ``cdw12 & 0xFFFF`` is NLB (0-based), ``cdw12 >> 16`` control.
    The caller checks flags and the SGL word as :meth:`SQE.unpack_from` does."""
    return RW_FIELDS.unpack_from(buf)


#: the 16-byte CQE as :func:`~blockfabric.protocol.capsule.pack_cqe_into` writes it: result
#: u64, sq_head, sq_id, cid, then the status word (status | dnr << 14) << 1; for the target's
#: per-I/O success answers (``pack_into(buf, 0, 0, sq_head, sq_id, cid, 0)``)
CQE_FIELDS = struct.Struct("<QHHHH")

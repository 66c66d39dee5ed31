"""NVM command set I/O commands (spec sheet sections 2 and 7; NVM command set 1.0 figures
28-55; kernel struct nvme_rw_command, nvme_write_zeroes_cmd, nvme_dsm_cmd / nvme_dsm_range).

Read/Write and the DSM ranges are written by hand: they are decoded per I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

from blockfabric.protocol._wire import Buffer, Encodable, need_bytes
from blockfabric.protocol.capsule import PSDT_SGL, SQE, Command, cmd, command
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.sgl import NULL_SGL, SGL
from blockfabric.protocol.opcodes import IOOpcode
from blockfabric.protocol.status import StatusCode

CONTROL_FUA = 1 << 14  # control bit 14 (cdw12 bit 30): force unit access
CONTROL_LIMITED_RETRY = 1 << 15  # control bit 15 (cdw12 bit 31)
_RW_OPCODES = {int(IOOpcode.READ): IOOpcode.READ, int(IOOpcode.WRITE): IOOpcode.WRITE}


@dataclass(frozen=True, slots=True)
class ReadWrite:
    """Read (0x02) or Write (0x01).  ``nlb`` is 0-based as on the wire; see :attr:`blocks`."""

    opcode: IOOpcode  # @0 READ or WRITE
    nsid: int  # @4
    slba: int  # @40 u64 starting LBA
    nlb: int  # @48 u16 number of logical blocks, 0-based
    control: int = 0  # @50 u16: bit 14 FUA, bit 15 limited retry
    dsmgmt: int = 0  # @52 u32 dataset management hints
    reftag: int = 0  # @56 u32 expected initial logical block reference tag

    @property
    def blocks(self) -> int:
        return self.nlb + 1

    @property
    def fua(self) -> bool:
        return bool(self.control & CONTROL_FUA)

    @property
    def is_write(self) -> bool:
        return self.opcode == IOOpcode.WRITE

    @classmethod
    def from_sqe(cls, sqe: SQE) -> ReadWrite:
        opcode = _RW_OPCODES.get(sqe.opcode)
        if opcode is None:
            raise ProtocolError(f"opcode {sqe.opcode:#x} is not read/write",
                                StatusCode.INVALID_OPCODE, cid=sqe.cid)
        c12 = sqe.cdw12
        return cls(opcode, sqe.nsid, sqe.cdw10 | sqe.cdw11 << 32, c12 & 0xFFFF, c12 >> 16,
                   sqe.cdw13, sqe.cdw14)

    def to_sqe(self, cid: int = 0, sgl: SGL = NULL_SGL, flags: int = PSDT_SGL) -> SQE:
        if not (0 <= self.nlb <= 0xFFFF and 0 <= self.control <= 0xFFFF
                and 0 <= self.slba < 1 << 64):
            raise ValueError(f"{self} does not fit its fields")
        return SQE(int(self.opcode), flags, cid, self.nsid, 0, 0, 0, sgl,
                   self.slba & 0xFFFFFFFF, self.slba >> 32, self.nlb | self.control << 16,
                   self.dsmgmt, self.reftag, 0)


@command(IOOpcode.FLUSH)
class Flush(Command):
    """Flush: make completed writes to ``nsid`` durable."""

    nsid: int = cmd(4, 32)  # @4


@command(IOOpcode.WRITE_ZEROES)
class WriteZeroes(Command):
    """Write Zeroes; with ``deac`` the blocks may be deallocated instead of written."""

    nsid: int = cmd(4, 32)  # @4
    slba: int = cmd(40, 64)  # @40
    nlb: int = cmd(48, 16)  # @48 0-based
    deac: bool = cmd(51, 1, bit=1)  # @48 cdw12 bit 25: deallocate
    fua: bool = cmd(51, 1, bit=6)  # @48 cdw12 bit 30
    limited_retry: bool = cmd(51, 1, bit=7)  # @48 cdw12 bit 31

    @property
    def blocks(self) -> int:
        return self.nlb + 1


DSM_MAX_RANGES = 256
DSM_RANGE_SIZE = 16
# cattr u32 @0 context attributes, nlb u32 @4 (1-based here), slba u64 @8
_DSM_RANGE = struct.Struct("<IIQ")


@dataclass(frozen=True, slots=True)
class DSMRange(Encodable):
    """One 16-byte Dataset Management range.  ``nlb`` is a count (not 0-based)."""

    cattr: int = 0  # @0 context attributes
    nlb: int = 0  # @4 length in logical blocks
    slba: int = 0  # @8 starting LBA

    SIZE = DSM_RANGE_SIZE

    def pack_into(self, buf: Buffer, offset: int = 0) -> None:
        _DSM_RANGE.pack_into(buf, offset, self.cattr, self.nlb, self.slba)

    @classmethod
    def unpack_from(cls, buf: Buffer, offset: int = 0) -> DSMRange:
        need_bytes(buf, offset, DSM_RANGE_SIZE, "DSM range", StatusCode.SGL_DATA_LENGTH_INVALID)
        return cls(*_DSM_RANGE.unpack_from(buf, offset))

    @staticmethod
    def iter_from(buf: Buffer, count: int, offset: int = 0) -> Iterator[DSMRange]:
        """Decode ``count`` ranges lazily straight from the (registered) buffer.  The length
        is checked at once: the transfer must hold them all (else 0x00F | DNR, as nvmet)."""
        need_bytes(buf, offset, count * DSM_RANGE_SIZE, "DSM ranges",
                   StatusCode.SGL_DATA_LENGTH_INVALID)
        items = _DSM_RANGE.iter_unpack(memoryview(buf)[offset:offset + count * DSM_RANGE_SIZE])
        return (DSMRange(cattr, nlb, slba) for cattr, nlb, slba in items)

    @staticmethod
    def pack_ranges(ranges: Sequence[DSMRange]) -> bytes:
        return b"".join(r.pack() for r in ranges)


@command(IOOpcode.DATASET_MANAGEMENT)
class DatasetManagement(Command):
    """Dataset Management: ``nr`` ranges (0-based) follow as data; ``ad`` = deallocate."""

    nsid: int = cmd(4, 32)  # @4
    nr: int = cmd(40, 8)  # @40 number of ranges, 0-based (max 256)
    idr: bool = cmd(44, 1, bit=0)  # @44 cdw11 bit 0: integral dataset for read
    idw: bool = cmd(44, 1, bit=1)  # @44 cdw11 bit 1: integral dataset for write
    ad: bool = cmd(44, 1, bit=2)  # @44 cdw11 bit 2: deallocate

    @property
    def ranges(self) -> int:
        return self.nr + 1

    @property
    def data_length(self) -> int:
        """Bytes of range data the command's SGL must describe."""
        return self.ranges * DSM_RANGE_SIZE

"""One namespace of a connected controller, as the library's users see it (bytes, futures)."""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from blockfabric.protocol import (DatasetManagement, DSMRange, Flush, IdentifyNamespace, IOOpcode,
                                  WriteZeroes)

if TYPE_CHECKING:
    from blockfabric.initiator.host import Controller

log = logging.getLogger(__name__)


@dataclass
class HostNamespace:
    """One namespace of a connected controller.  Offsets and lengths are in bytes and must
    be multiples of ``block_size``."""

    ctrl: Controller
    nsid: int
    block_size: int
    nblocks: int
    read_only: bool
    nguid: bytes = b""
    identify: IdentifyNamespace | None = field(default=None, repr=False)
    #: False once the target removed the namespace (I/O then fails with invalid namespace).
    active: bool = True

    @property
    def size(self) -> int:
        return self.nblocks * self.block_size

    def _check(self, offset: int, length: int) -> None:
        bs = self.block_size
        if offset % bs or length % bs or length <= 0:
            raise ValueError(f"offset {offset} and length {length} must be positive "
                             f"multiples of the {bs}-byte block size")
        if offset < 0:
            raise ValueError(f"negative offset {offset}")

    def submit_read(self, offset: int, length: int) -> concurrent.futures.Future:
        """Start a read; the future's result is the bytes read."""
        self._check(offset, length)
        return self.ctrl._io(self, IOOpcode.READ, offset, length, None)

    def submit_write(self, offset: int, data) -> concurrent.futures.Future:
        view = memoryview(data).cast("B")
        self._check(offset, len(view))
        return self.ctrl._io(self, IOOpcode.WRITE, offset, len(view), view)

    def read(self, offset: int, length: int) -> bytes:
        return self.submit_read(offset, length).result()

    def readinto(self, offset: int, buf) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(offset, len(view))
        view[:] = data
        return len(view)

    def write(self, offset: int, data) -> None:
        self.submit_write(offset, data).result()

    def flush(self) -> None:
        self.ctrl.wait_io(self.nsid, lambda: Flush(nsid=self.nsid).to_sqe(), "Flush")

    def write_zeroes(self, offset: int, length: int, deallocate: bool = False) -> None:
        self._check(offset, length)
        bs = self.block_size
        for start, count in chunks(offset // bs, length // bs, 0x10000):
            self.ctrl.wait_io(self.nsid, lambda: WriteZeroes(
                nsid=self.nsid, slba=start, nlb=count - 1, deac=deallocate).to_sqe(),
                "Write Zeroes")

    def discard(self, offset: int, length: int) -> None:
        """Dataset Management, deallocate (what blkdiscard / punch hole send)."""
        self._check(offset, length)
        bs = self.block_size
        ranges = [DSMRange(0, count, start)
                  for start, count in chunks(offset // bs, length // bs, 0xFFFFFFFF)]
        for i in range(0, len(ranges), 256):
            batch = ranges[i:i + 256]
            payload = b"".join(r.pack() for r in batch)
            nr = len(batch) - 1
            self.ctrl.wait_io(self.nsid, lambda: DatasetManagement(nsid=self.nsid, nr=nr,
                                                                   ad=True).to_sqe(),
                              "Dataset Management", data_out=payload)


def chunks(start: int, count: int, most: int) -> Iterable[tuple[int, int]]:
    """(start, count) pieces of ``count`` units from ``start``, at most ``most`` each."""
    while count > 0:
        n = min(count, most)
        yield start, n
        start += n
        count -= n

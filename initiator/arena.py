"""Registered host memory: the controller's I/O arena and the regions callers register.

Both are :class:`~blockfabric.fabric.buffers.BufferPool` slabs (the project's one
registered-buffer pool), registered for both RDMA directions: the arena cuts its one slab
into size classes for the copying calls (namespace futures, admin data); a
:class:`HostMemory` is memory a caller keeps and names itself (the bench's slots, tests).
"""

from __future__ import annotations

import threading
import time

from blockfabric.fabric.buffers import BufferPool
from blockfabric.protocol import KeyedSGL
from blockfabric.rdma import PD, Access

#: what host memory is registered for: the target RDMA-READs write data from it and
#: RDMA-WRITEs read data into it (nothing else of the host is exposed)
HOST_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE


class Arena:
    """Registered host memory for I/O buffers, in power-of-two blocks of 4 KiB and up.

    Freed blocks go back to their size class and are never merged: I/O sizes repeat, so the
    classes settle quickly and an allocation is a list pop.
    """

    MIN_BLOCK = 4096

    def __init__(self, pd: PD, size: int) -> None:
        self.size = size
        self._slab = BufferPool(pd, 1, size, HOST_ACCESS)
        self.mr = self._slab.mr
        self.view = self._slab.views[0]
        self._bump = 0
        self._free: dict[int, list[int]] = {}
        self._cond = threading.Condition()

    def alloc(self, nbytes: int, timeout: float | None = 30.0) -> tuple[int, int]:
        """(offset, block size) of a block of at least ``nbytes``."""
        block = max(self.MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())
        if block > self.size:
            raise ValueError(f"{nbytes} bytes exceed the {self.size}-byte I/O arena")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                free = self._free.get(block)
                if free:
                    return free.pop(), block
                if self._bump + block <= self.size:
                    offset = self._bump
                    self._bump += block
                    return offset, block
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError("no free I/O buffer")
                self._cond.wait(wait)

    def free(self, offset: int, block: int) -> None:
        with self._cond:
            self._free.setdefault(block, []).append(offset)
            self._cond.notify()

    def sgl(self, offset: int, length: int) -> KeyedSGL:
        return KeyedSGL(self.mr.addr + offset, length, self.mr.rkey, False)

    def close(self) -> None:
        self.view = None  # type: ignore[assignment]  # closed: no view of freed memory
        self._slab.close()


class HostMemory(BufferPool):
    """``size`` bytes of this process's memory registered with a controller's PD for both
    RDMA directions: where a caller's own reads land and its writes come from, named in a
    keyed SGL by ``addr`` and ``rkey``, with no arena block and no copy.  A one-slot
    :class:`BufferPool` (``BufferPool(pd, count, size, HOST_ACCESS)`` for many slots)."""

    def __init__(self, pd: PD, size: int) -> None:
        super().__init__(pd, 1, size, HOST_ACCESS)
        self.view: memoryview = self.views[0]
        self.addr: int = self.addrs[0]

"""Registered host memory: the controller's I/O arena and the regions callers register."""

from __future__ import annotations

import logging
import mmap
import threading
import time

from blockfabric.protocol import (KeyedSGL)
from blockfabric.rdma import PD, Access

log = logging.getLogger(__name__)


class Arena:
    """Registered host memory for I/O buffers, in power-of-two blocks of 4 KiB and up.

    Freed blocks go back to their size class and are never merged: I/O sizes repeat, so the
    classes settle quickly and an allocation is a list pop.
    """

    MIN_BLOCK = 4096

    def __init__(self, pd: PD, size: int) -> None:
        self.size = size
        self._mem = mmap.mmap(-1, size)
        self.mr = pd.reg_mr(self._mem, Access.LOCAL_WRITE | Access.REMOTE_READ
                            | Access.REMOTE_WRITE)
        self.view = self.mr.buf
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
        self.view = None
        self.mr.close()
        try:
            self._mem.close()
        except BufferError:
            pass


class HostMemory:
    """``size`` bytes of this process's memory registered with a controller's PD for both
    RDMA directions: where a caller's own reads land and its writes come from (the FUSE
    server's request buffers, the bench's slots), named in a keyed SGL by ``addr`` and
    ``rkey``, with no arena block and no copy."""

    def __init__(self, pd: PD, size: int) -> None:
        self._mem = mmap.mmap(-1, size)
        self.mr = pd.reg_mr(self._mem, Access.LOCAL_WRITE | Access.REMOTE_READ
                            | Access.REMOTE_WRITE)
        self.view: memoryview = self.mr.buf
        self.addr: int = self.mr.addr
        self.rkey: int = self.mr.rkey

    def close(self) -> None:
        """Deregister and unmap (views of it taken by the caller must be released first)."""
        try:
            self.mr.close()
        finally:
            try:
                self._mem.close()
            except BufferError:     # a view still exported elsewhere keeps it alive
                pass

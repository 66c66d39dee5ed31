"""Registered buffer pools: one memory region cut into fixed-size slots.

The project's one registered-slab allocator: queue capsules and responses, the target's data
buffers, the FUSE server's request buffers, the bench's slots and any region a host caller
registers (``HostMemory``) are pools of it; the host's I/O arena is a size-class allocator
over a one-slot pool.

Both ends of a queue need many small registered buffers (receive slots for capsules, send
slots for responses, data buffers for I/O).  Registering each one separately would cost a
registration per buffer and an MR lookup per work request; one slab per pool costs one.
Slots are handed out LIFO so the hottest ones stay in cache.
"""

from __future__ import annotations

import mmap

from blockfabric import numa
from blockfabric.rdma import PD, SGE, Access

_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE


class BufferPool:
    """``count`` slots of ``size`` bytes in one registered, page-aligned slab."""

    def __init__(self, pd: PD, count: int, size: int,
                 access: Access = Access.LOCAL_WRITE) -> None:
        if count <= 0 or size <= 0:
            raise ValueError(f"a buffer pool needs count > 0 and size > 0, got {count}x{size}")
        self.count = count
        self.size = size
        # memory the peer reads and writes: shared with it where the provider can (the soft
        # provider's same-host connections copy it instead of sending it)
        shared = getattr(pd, "shared_slab", None) if access & _REMOTE else None
        slab: mmap.mmap | None = None
        if shared is not None:
            try:
                slab = shared(count * size)
            except OSError:         # no memfd here (a seccomp filter, say): plain memory
                pass
        self._slab = slab if slab is not None else mmap.mmap(-1, count * size)
        numa.bind_region(self._slab, "buffer pools")    # on the placement's node, if any
        self.mr = pd.reg_mr(self._slab, access)
        base = self.mr.buf
        self.views: list[memoryview] = [base[i * size:(i + 1) * size] for i in range(count)]
        self.addrs: list[int] = [self.mr.addr + i * size for i in range(count)]
        self._free = list(range(count - 1, -1, -1))
        #: the free slot indexes (the list get/put use): a caller that owns the pool on one
        #: thread may pop and append them directly, as the FUSE server does per request
        self.free = self._free

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        return self.mr.rkey

    @property
    def available(self) -> int:
        return len(self._free)

    def get(self) -> int | None:
        """A free slot index, or None when every slot is in use."""
        return self._free.pop() if self._free else None

    def put(self, index: int) -> None:
        self._free.append(index)

    def sge(self, index: int, length: int | None = None) -> SGE:
        """The scatter/gather element for slot ``index`` (the first ``length`` bytes)."""
        return SGE(self.addrs[index], self.size if length is None else length, self.mr.lkey)

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.views = []
        self.mr.close()
        try:
            self._slab.close()
        except BufferError:
            # A view still exported elsewhere keeps the slab alive until it is released.
            pass

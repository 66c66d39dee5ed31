"""A ramdisk registered as an RDMA memory region keeps its pages on write-zeroes/discard.

Found in the lab: the kernel host's blkdiscard on a ramdisk namespace, then a read, returned
the old data over rxe.  Write Zeroes / deallocate handed whole pages back with MADV_DONTNEED,
so the process got fresh zero pages while the pinned MR (through which reads are RDMA
WRITTEN to the host) still held the old ones.  The soft provider reads through the same
virtual memory and cannot show it, so this checks the mechanism: while registered, the
pages stay (RSS does not drop) and are zeroed in place; once deregistered, they are handed
back again."""

from __future__ import annotations

import os

from blockfabric.sizes import MiB
from blockfabric.target.backends import RamdiskBackend
from blockfabric.target.config import Namespace as NsConf
from blockfabric.target.namespace import Namespace


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class _MR:
    """Holds the buffer as a real memory region does (its pages stay referenced)."""

    def __init__(self, buf) -> None:
        self.view = memoryview(buf)

    def close(self) -> None:
        self.view.release()


class _PD:
    def reg_mr(self, buf, access) -> _MR:
        return _MR(buf)


def test_registered_ramdisk_is_zeroed_in_place_and_released_only_when_unregistered():
    ns = Namespace(NsConf(nsid=1, backend="ramdisk", size=64 * MiB))
    try:
        ns.backend.write(0, b"\x01" * (32 * MiB))
        mr = ns.mr(_PD())
        assert mr is not None and ns.backend.pinned
        touched = _rss()
        ns.backend.write_zeroes(0, 32 * MiB)
        assert bytes(ns.memory[:4096]) == bytes(4096)
        assert touched - _rss() < 8 * MiB        # pages kept: the MR still maps them
        ns._deregister()
        assert not ns.backend.pinned
        ns.backend.write(0, b"\x02" * (32 * MiB))
        touched = _rss()
        ns.backend.write_zeroes(0, 32 * MiB)
        assert touched - _rss() > 24 * MiB       # unregistered: handed back as before
    finally:
        ns.close()


def test_shared_ramdisk_is_zeroed_in_place_by_every_group():
    """With poll groups a ramdisk is one memfd that every process maps, and ``pinned`` is
    each process's own: a group that has not registered the volume must not punch holes
    under another's registration (nor have it fault every page back in, the 2.5x CPU per
    Write Zeroes measured in docs/scaling.md).  Its pages stay: the memfd keeps its blocks."""
    RamdiskBackend.shared = True
    try:
        registered = RamdiskBackend(64 * MiB)
    finally:
        RamdiskBackend.shared = False
    worker = RamdiskBackend(64 * MiB, fd=os.dup(registered.memfd))
    try:
        registered.pinned = True                # its memory is in a memory region here
        registered.write(0, b"\x01" * (32 * MiB))
        held = os.fstat(registered.memfd).st_blocks * 512
        assert held >= 32 * MiB
        assert not worker.pinned
        worker.write_zeroes(0, 32 * MiB)        # on the other group's queue
        assert bytes(registered.memory[:4096]) == bytes(4096)
        assert bytes(registered.memory[32 * MiB - 4096:32 * MiB]) == bytes(4096)
        assert os.fstat(registered.memfd).st_blocks * 512 >= held   # no page handed back
    finally:
        worker.close()
        registered.close()

"""The provider and its device are one per process even when several threads open them at
once: a multipath host connects its paths in parallel threads, and two soft devices there
(one path's CQs served through one, another's QPs registered in the other) left a path whose
sockets no reactor read once the first path's queues were torn down (fio EIO on failover)."""

from __future__ import annotations

import threading
import time

import blockfabric.rdma as rdma
import blockfabric.rdma.soft as soft
from blockfabric.rdma.soft import SoftProvider


def _at_once(fn, n: int = 8) -> list:
    barrier = threading.Barrier(n)
    got: list = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        got[i] = fn()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return got


def test_soft_device_is_opened_once_by_racing_threads():
    for _ in range(20):
        provider = SoftProvider()
        try:
            contexts = _at_once(lambda: provider.context)
            assert all(c is contexts[0] for c in contexts), \
                f"{len({id(c) for c in contexts})} soft devices opened at once"
        finally:
            for c in {id(c): c for c in contexts}.values():
                c.close()


class _SlowSoftProvider(SoftProvider):
    """A provider that takes a while to make: threads asking for one at once all arrive
    while the first is being made (without the lock, each made its own)."""

    def __init__(self) -> None:
        time.sleep(0.05)
        super().__init__()


def test_get_provider_makes_one_instance_for_racing_threads(monkeypatch):
    monkeypatch.setattr(soft, "SoftProvider", _SlowSoftProvider)
    for _ in range(5):
        monkeypatch.setattr(rdma, "_instances", {})
        providers = _at_once(lambda: rdma.get_provider("soft"))
        assert all(p is providers[0] for p in providers), \
            f"{len({id(p) for p in providers})} soft providers made at once"

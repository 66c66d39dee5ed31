"""Soft provider memory keys are capabilities: random 32-bit numbers, unique among the live
keys of the device, never sequential (issue 13: keys counted up from small numbers)."""

from __future__ import annotations

from blockfabric.rdma import Access
from blockfabric.rdma.soft.device import SoftContext
from blockfabric.rdma.soft.memory import KeyAllocator


def test_keys_are_random_unique_and_come_back() -> None:
    keys = KeyAllocator()
    pairs = [keys.pair() for _ in range(5000)]
    flat = [k for p in pairs for k in p]
    assert len(set(flat)) == len(flat) and 0 not in flat
    assert max(flat) >= 1 << 31 and min(flat) < 1 << 30    # spread over all 32 bits
    gaps = {b - a for a, b in zip(flat, flat[1:])}
    assert len(gaps) > len(flat) // 2                      # no stride to follow
    keys.release(*pairs[0])
    assert pairs[0][0] not in keys._live and pairs[1][0] in keys._live


def test_registered_regions_get_distinct_unguessable_keys() -> None:
    ctx = SoftContext(progress="poll")
    try:
        pd = ctx.alloc_pd()
        mrs = [pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE | Access.REMOTE_READ)
               for _ in range(64)]
        keys = [k for mr in mrs for k in (mr.lkey, mr.rkey)]
        assert len(set(keys)) == len(keys)
        assert sum(1 for k in keys if k < 1 << 24) <= 2     # not small numbers
        for mr in mrs:
            mr.close()
        assert ctx.lkeys == {} and ctx.rkeys == {} and ctx._keys._live == {0}
    finally:
        ctx.close()

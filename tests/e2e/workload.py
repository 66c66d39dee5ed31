"""A verify workload over the host library: random writes and reads, many in flight, checked
against a model.  Runs in-process, or as ``python -m tests.e2e.workload`` (for a host in
another network namespace), printing a JSON summary."""

from __future__ import annotations

import argparse
import json
import random
import sys

from blockfabric.initiator.host import HostNamespace, connect

from .conftest import via


def verify_workload(ns: HostNamespace, seed: int, ops: int = 300, max_blocks: int = 64,
                    inflight: int = 32, span_blocks: int | None = None) -> dict:
    """Random-size writes at random block offsets, ``inflight`` at a time, then read every
    written block back and compare with the model.  Returns counts; raises on mismatch."""
    rng = random.Random(seed)
    bs = ns.block_size
    span = min(span_blocks or ns.nblocks, ns.nblocks)
    model: dict[int, bytes] = {}
    written = 0
    pending = []
    for _ in range(ops):
        nblocks = rng.randint(1, max_blocks)
        start = rng.randrange(0, span - nblocks + 1)
        data = rng.randbytes(nblocks * bs)
        # Keep overlapping writes out of the same batch: their order is not defined.
        if any(not (start + nblocks <= s or s + n <= start) for s, n, _ in pending):
            for _, _, fut in pending:
                fut.result()
            pending.clear()
        pending.append((start, nblocks, ns.submit_write(start * bs, data)))
        for i in range(nblocks):
            model[start + i] = data[i * bs:(i + 1) * bs]
        written += len(data)
        if len(pending) >= inflight:
            for _, _, fut in pending:
                fut.result()
            pending.clear()
    for _, _, fut in pending:
        fut.result()
    blocks = sorted(model)
    reads = []
    i = 0
    while i < len(blocks):          # read back in runs of contiguous blocks, many in flight
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1 and j - i < 255:
            j += 1
        reads.append((blocks[i], j - i + 1, ns.submit_read(blocks[i] * bs, (j - i + 1) * bs)))
        i = j + 1
    verified = 0
    for start, count, fut in reads:
        data = fut.result()
        for k in range(count):
            if data[k * bs:(k + 1) * bs] != model[start + k]:
                raise AssertionError(f"block {start + k}: data read back differs")
        verified += count * bs
    return {"bytes_written": written, "bytes_verified": verified, "blocks": len(model)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--traddr", required=True)
    p.add_argument("--trsvcid", type=int, required=True)
    p.add_argument("--nqn", required=True)
    p.add_argument("--hostnqn", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--netns")
    p.add_argument("--transport", choices=("rdma", "tcp", "verbs"), default="rdma")
    args = p.parse_args(argv)
    if args.netns:
        from blockfabric.net import enter_netns
        enter_netns(args.netns)
    how = via(args.transport)
    with connect(args.traddr, args.nqn, args.trsvcid, **how,
                 hostnqn=args.hostnqn, nr_io_queues=2) as ctrl:
        summary = verify_workload(ctrl.namespaces[1], args.seed, args.ops)
        summary["queues"] = ctrl.queue_stats()
    json.dump(summary, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

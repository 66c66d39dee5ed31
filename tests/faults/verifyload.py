"""A verify workload that runs *through* faults: each thread owns a region of blocks, writes
a block run, reads it back, and now and then re-reads an older run, checking every block
against the CRC-32C of what was last acknowledged.  Errors are timed (so a test can show
they came only after ctrl_loss_tmo); a wrong block is a mismatch, never an error.

In-process (:func:`verify_load`), or as ``python tests/faults/verifyload.py`` for a host in
another network namespace (a JSON summary on stdout).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

from crc32c import crc32c

from blockfabric.initiator.host import Controller, ConnectOptions


def verify_load(ctrl: Controller, seconds: float, *, threads: int = 4, seed: int = 1,
                region_blocks: int = 256, max_run: int = 8, nsid: int = 1,
                first_block: int = 0, stop: threading.Event | None = None,
                completions: list[float] | None = None) -> dict:
    """Run for ``seconds`` (or until ``stop``); returns counts, error times and mismatches.
    Thread ``t`` owns blocks ``first_block + t * region_blocks`` onwards (several hosts
    share a namespace with disjoint ``first_block``).  ``completions``, if given, gets the
    ``time.monotonic()`` of every I/O that completed successfully (a test measures the
    longest gap without progress from it)."""
    ns = ctrl.namespaces[nsid]
    bs = ns.block_size
    start = time.monotonic()
    deadline = start + seconds
    stop = stop or threading.Event()
    lock = threading.Lock()
    out = {"ios": 0, "bytes_verified": 0, "errors": 0, "mismatches": 0,
           "error_times": [], "error_samples": [], "mismatch_samples": []}

    def note_error(exc: BaseException) -> None:
        with lock:
            out["errors"] += 1
            out["error_times"].append(round(time.monotonic() - start, 3))
            if len(out["error_samples"]) < 5:
                out["error_samples"].append(f"{type(exc).__name__}: {exc}")

    def worker(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        base = first_block + t * region_blocks
        # block -> the CRCs it may hold (two after a failed write: old or new, both right)
        model: dict[int, set[int]] = {}
        ios = verified = mismatches = 0

        def check(first: int, data: bytes) -> int:
            bad = 0
            for i in range(len(data) // bs):
                want = model.get(first + i)
                block = data[i * bs:(i + 1) * bs]
                if want is not None and crc32c(block) not in want:
                    bad += 1
                    with lock:      # which block, and what it held instead (its first bytes)
                        if len(out["mismatch_samples"]) < 5:
                            out["mismatch_samples"].append(
                                f"block {first + i}: {bytes(block[:16]).hex()}...")
            return bad

        while time.monotonic() < deadline and not stop.is_set():
            n = rng.randint(1, max_run)
            first = base + rng.randrange(region_blocks - n + 1)
            data = rng.randbytes(n * bs)
            crcs = [crc32c(data[i * bs:(i + 1) * bs]) for i in range(n)]
            try:
                ns.write(first * bs, data)
            except Exception as exc:  # the write may or may not have landed
                note_error(exc)
                for i, c in enumerate(crcs):
                    model.setdefault(first + i, set()).add(c)
                continue
            for i, c in enumerate(crcs):
                model[first + i] = {c}
            ios += 1
            if completions is not None:
                completions.append(time.monotonic())
            if rng.random() < 0.3 and model:       # an older block, from before any fault
                old = rng.choice(list(model))
                first, n = old, 1
            try:
                back = ns.read(first * bs, n * bs)
            except Exception as exc:
                note_error(exc)
                continue
            ios += 1
            if completions is not None:
                completions.append(time.monotonic())
            mismatches += check(first, back)
            verified += len(back)
        if not stop.is_set() and model:             # a last pass over the whole region
            try:
                back = ns.read(base * bs, region_blocks * bs)
                mismatches += check(base, back)
                verified += len(back)
                ios += 1
            except Exception as exc:
                note_error(exc)
        with lock:
            out["ios"] += ios
            out["bytes_verified"] += verified
            out["mismatches"] += mismatches

    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    out["seconds"] = round(time.monotonic() - start, 3)
    out["recovery"] = ctrl.recovery_stats()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traddr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", action="append", default=[], metavar="ADDR:PORT",
                   help="another listener of the subsystem (multipath)")
    p.add_argument("--nqn", required=True)
    p.add_argument("--hostnqn", required=True)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--queues", type=int, default=2)
    p.add_argument("--kato", type=float, default=1)
    p.add_argument("--reconnect-delay", type=float, default=0.5)
    p.add_argument("--ctrl-loss-tmo", type=float, default=10)
    p.add_argument("--connect-timeout", type=float, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--region-blocks", type=int, default=256)
    p.add_argument("--first-block", type=int, default=0)
    p.add_argument("--netns", help="enter this network namespace first")
    p.add_argument("--provider", default="soft", help="the RDMA provider (soft or verbs)")
    args = p.parse_args(argv)
    if args.netns:
        from blockfabric.net import enter_netns
        enter_netns(args.netns)
    paths = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in args.path]
    opts = ConnectOptions(traddr=args.traddr, trsvcid=args.port, subnqn=args.nqn,
                          hostnqn=args.hostnqn, provider=args.provider, nr_io_queues=args.queues,
                          keep_alive_tmo=args.kato, reconnect_delay=args.reconnect_delay,
                          ctrl_loss_tmo=args.ctrl_loss_tmo,
                          connect_timeout=args.connect_timeout, paths=paths)
    with Controller(opts).connect() as ctrl:
        print("connected", file=sys.stderr, flush=True)
        result = verify_load(ctrl, args.seconds, threads=args.threads, seed=args.seed,
                             region_blocks=args.region_blocks,
                             first_block=args.first_block)
    json.dump(result, sys.stdout)
    print()
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())

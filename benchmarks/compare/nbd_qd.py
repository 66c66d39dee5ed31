"""The libnbd side of the library-level comparison: ``blockfabric bench``'s job, through
libnbd's Python bindings (no FUSE), at a fixed queue depth.

``python nbd_qd.py --port P --rw randread --bs 4096 --iodepth 16 --runtime 5`` prints one JSON
object: ios, seconds (the counted run, which ended at timestamp_ms), iops, bw_bytes and clat
percentiles in microseconds.  Buffers are allocated once; completions are collected by
callback and resubmitted after each poll (libnbd forbids calls on the handle from inside its
callbacks).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import nbd


def run(port: int, rw: str, bs: int, iodepth: int, runtime: float, ramp: float,
        seed: int = 1) -> dict[str, float]:
    h = nbd.NBD()
    h.connect_tcp("127.0.0.1", str(port))
    blocks = h.get_size() // bs
    rng = random.Random(seed)
    bufs = [nbd.Buffer(bs) for _ in range(iodepth)]
    started = [0] * iodepth
    ready = list(range(iodepth))
    lat: list[int] = []
    errors = 0
    nxt = 0

    def done(slot: int, err: object) -> int:
        nonlocal errors
        lat.append(time.perf_counter_ns() - started[slot])
        errors += bool(err[0] if isinstance(err, list) else err)
        ready.append(slot)
        return 1   # retire the command

    t0 = time.perf_counter()
    count_from = t0 + ramp
    stop = count_from + runtime
    counted = 0
    while True:
        now = time.perf_counter()
        if now >= count_from and counted == 0:
            lat.clear()
            counted = now
        if now >= stop:
            break
        for slot in ready:
            if rw == "randread":
                block = rng.randrange(blocks)
            else:
                block, nxt = nxt, (nxt + 1) % blocks
            started[slot] = time.perf_counter_ns()
            h.aio_pread(bufs[slot], block * bs,
                        completion=lambda err, s=slot: done(s, err))
        ready.clear()
        while not ready:
            h.poll(-1)
    seconds = time.perf_counter() - counted
    end_ms = time.time() * 1000    # the counted run: the seconds before this wall-clock instant
    while h.aio_in_flight():
        h.poll(-1)
    h.shutdown()
    lat.sort()
    n = len(lat)
    pct = {p: lat[min(n - 1, int(n * p / 100))] / 1000 for p in (50, 99, 99.9)} if n else {}
    if errors:
        raise SystemExit(f"{errors} libnbd reads failed")
    return {"ios": n, "seconds": seconds, "timestamp_ms": end_ms, "iops": n / seconds,
            "bw_bytes": n * bs / seconds,
            "p50_us": pct.get(50, 0), "p99_us": pct.get(99, 0), "p99.9_us": pct.get(99.9, 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rw", choices=("randread", "read"), default="randread")
    p.add_argument("--bs", type=int, default=4096)
    p.add_argument("--iodepth", type=int, default=16)
    p.add_argument("--runtime", type=float, default=5.0)
    p.add_argument("--ramp", type=float, default=1.0)
    a = p.parse_args()
    print(json.dumps(run(a.port, a.rw, a.bs, a.iodepth, a.runtime, a.ramp)))


if __name__ == "__main__":
    main()

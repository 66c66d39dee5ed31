#!/usr/bin/env python3
"""Reservations: what a command costs on each store, and what a held reservation costs the
I/O path.  A target subprocess on loopback (soft provider) exports a ramdisk (state in
memory) and a file volume (state in a flock'd, fsync'd sidecar); the host library times:

* Register + Unregister pairs, and Report, per store (median and p90 of ``--ops``);
* 4 KiB reads at QD1 on the ramdisk with nothing reserved (the I/O path's one attribute
  test) and while another host holds Write Exclusive (the full access check), in
  interleaved rounds so that a burst of load elsewhere hits both alike.

    python benchmarks/resv_ops.py [--ops 300] [--reads 3000] [--rounds 5]

Timings, not assertions: the machine is shared, compare medians.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from e2e.conftest import TargetProc, free_port  # noqa: E402

from blockfabric.initiator import resv  # noqa: E402
from blockfabric.initiator.host import ConnectOptions, Controller  # noqa: E402

NQN = "nqn.2026-12.io.blockfabric:resv-bench"


def host(port: int, name: str) -> Controller:
    hid = uuid.uuid5(uuid.NAMESPACE_DNS, name)
    return Controller(ConnectOptions(traddr="127.0.0.1", trsvcid=port, subnqn=NQN,
                                     provider="soft", hostid=hid.bytes,
                                     hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{hid}")
                      ).connect()


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def summary(samples: list[float]) -> str:
    s = sorted(samples)
    return f"median {statistics.median(s):8.1f} us  p90 {s[int(len(s) * 0.9)]:8.1f} us"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="resv-bench."))
    port = free_port()
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
              "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                  {"nsid": 1, "backend": "ramdisk", "size": "64MiB"},
                  {"nsid": 2, "backend": "file", "path": str(tmp / "vol.img"),
                   "size": "64MiB"}]}]}
    target = TargetProc(config, tmp).start()
    try:
        a, b = host(port, "bench-a"), host(port, "bench-b")
        for nsid, store in ((1, "memory"), (2, "file sidecar")):
            ns = a.namespaces[nsid]

            def pair() -> None:
                resv.register(ns, nrkey=0x11)
                resv.register(ns, crkey=0x11, rrega=1)
            print(f"{store:13} register+unregister  {summary(timed(pair, args.ops))}")
            print(f"{store:13} report               "
                  f"{summary(timed(lambda: resv.report(ns), args.ops))}")
        ns_b, ns_a = b.namespaces[1], a.namespaces[1]
        resv.register(ns_a, nrkey=0xA)
        free: list[float] = []
        held: list[float] = []
        for _ in range(args.rounds):
            free += timed(lambda: ns_b.read(0, 4096), args.reads // args.rounds)
            resv.acquire(ns_a, crkey=0xA, rtype=1)
            held += timed(lambda: ns_b.read(0, 4096), args.reads // args.rounds)
            resv.release(ns_a, crkey=0xA, rtype=1)
        print(f"4 KiB read QD1, nothing reserved          {summary(free)}")
        print(f"4 KiB read QD1, another host holds WE      {summary(held)}")
        a.close()
        b.close()
    finally:
        target.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

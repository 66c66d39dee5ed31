#!/usr/bin/env python3
"""Where one QD1 read's microseconds go: timestamps from both processes, merged.

    git -C TREE apply benchmarks/prototypes/qd1_chain/marks.patch   # a scratch tree
    (cd TREE && make venv)
    python benchmarks/prototypes/qd1_chain/chain.py TREE [-t rdma|tcp] [--runtime 5]

TREE's target and mount (started as cost_per_io.py starts them) record
``time.perf_counter_ns()`` (CLOCK_MONOTONIC: one clock for both processes) at the marks of
marks.patch: the FUSE request read and the reply written, each sendmsg and each receive,
and on the soft provider the spin's hit, the end of parsing, the CQ poll, the target's
respond and post.  Each process writes its first 60000 marks to BF_TRACE.<pid>.  fio runs
randread 4 KiB QD1 (psync); the report gives, per segment of the chain (FUSE request in ->
capsule sent -> target received -> answer sent -> host received -> FUSE reply written ->
next FUSE request), the median over the cycles, and one cycle's timeline.  The marks cost
about 0.3 us each: compare segments and transports, not totals with fio's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "compare"))

import systems  # noqa: E402

CHAIN = ("H:fuse_in", "H:send", "T:recv", "T:send", "H:recv", "H:fuse_out", "H:fuse_in")
SEGMENTS = ("host issues", "to the target", "target works", "to the host",
            "host completes", "fio's turn")


def merged(prefix: str, pids: dict[str, int]) -> list[tuple[str, int]]:
    seq = []
    for side, pid in pids.items():
        with open(f"{prefix}.{pid}") as f:
            seq.extend((f"{side}:{tag}", ns) for tag, ns in json.load(f))
    seq.sort(key=lambda e: e[1])
    return seq


def segments(seq: list[tuple[str, int]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    i = 0
    while i < len(seq):
        if seq[i][0] != CHAIN[0]:
            i += 1
            continue
        j, times = i, [seq[i][1]]
        for want in CHAIN[1:]:
            j += 1
            while j < len(seq) and seq[j][0] != want:
                j += 1
            if j >= len(seq):
                return out
            times.append(seq[j][1])
        for name, a, b in zip(SEGMENTS, times, times[1:]):
            out[name].append((b - a) / 1e3)
        i = j
    return out


def steps(seq: list[tuple[str, int]], reads: int) -> None:
    """The median gap from each mark to the next mark of the same process."""
    last: dict[str, tuple[str, int]] = {}
    gaps: dict[tuple[str, str], list[float]] = {}
    for tag, ns in seq:
        side = tag[0]
        if side in last:
            prev, at = last[side]
            gaps.setdefault((prev, tag), []).append((ns - at) / 1e3)
        last[side] = (tag, ns)
    print("steps within one process (median us, how many per read):")
    for (a, b), values in sorted(gaps.items(), key=lambda kv: (kv[0][0][0], -len(kv[1]))):
        if len(values) * 4 >= reads:
            print(f"  {a:>14} -> {b:<14} {statistics.median(values):6.1f}  "
                  f"{len(values) / reads:4.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", type=pathlib.Path, help="a tree with marks.patch applied")
    ap.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="rdma")
    ap.add_argument("--runtime", type=float, default=5.0)
    ap.add_argument("--steps", action="store_true",
                    help="also the median time between consecutive marks of one process "
                         "(each pair of marks seen at least once per 4 reads)")
    args = ap.parse_args()
    systems.BIN = args.tree.resolve() / ".venv" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "marks")
        os.environ["BF_TRACE"] = prefix
        with systems.Workspace() as ws:
            s = ws.blockfabric("tcp" if args.transport == "tcp" else "poll")
            subprocess.run(["fio", "--name=chain", f"--filename={s.path}", "--rw=randread",
                            "--bs=4k", "--direct=1", "--ioengine=psync", "--time_based",
                            f"--runtime={args.runtime}", "--output-format=json"],
                           capture_output=True, check=True)
            pids = {"T": s.server_pid, "H": s.client_pid}
        seq = merged(prefix, pids)
    segs = segments(seq)
    n = len(segs[SEGMENTS[0]])
    print(f"{args.transport}: {n} QD1 reads, median us per segment")
    for name, values in segs.items():
        print(f"  {name:15s} {statistics.median(values):6.1f}")
    print(f"  {'sum':15s} {sum(statistics.median(v) for v in segs.values()):6.1f}")
    if args.steps:
        steps(seq, n)
    mid = len(seq) // 2
    while seq[mid][0] != CHAIN[0]:
        mid += 1
    base = seq[mid][1]
    print("one cycle (us from the FUSE request):")
    for tag, ns in seq[mid:mid + 12]:
        print(f"  {(ns - base) / 1e3:7.1f}  {tag}")
        if tag == CHAIN[-1] and ns != base:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())

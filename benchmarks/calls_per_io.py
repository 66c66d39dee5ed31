#!/usr/bin/env python3
"""Python calls per I/O on the target: cProfile over the target's reactor thread while
``blockfabric bench`` makes a fixed number of 4 KiB I/Os (one pass over --size, not timed).

    python benchmarks/calls_per_io.py [--rw randread] [--qd 16] [--size 64M] [--top 25]

A ramdisk target on the soft provider (poll progress, as ``cost_per_io.py`` runs it) is
started with its ``Reactor.run_forever`` under cProfile; the bench runs; the target is told
to stop (SIGTERM, an orderly drain) and writes its profile; the report divides every count
by the number of I/Os the bench made.  Connection set-up and teardown are in the counts too
(a few thousand calls: small next to 16k I/Os).  cProfile slows the target several times,
so use this for *counts*, never for time; time is ``cost_per_io.py``'s business.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pstats
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import systems  # noqa: E402

# Run inside the target process: profile every thread that runs a reactor, dump on the way out.
WRAPPER = r"""
import cProfile, sys, threading
from blockfabric.fabric import reactor as _r
_orig = _r.Reactor.run_forever
_profiles = []
_out = sys.argv[1]
def run_forever(self):
    p = cProfile.Profile()
    _profiles.append(p)
    p.enable()
    try:
        _orig(self)
    finally:
        p.disable()
        p.dump_stats(_out + f".{len(_profiles)}")
_r.Reactor.run_forever = run_forever
sys.argv = ["blockfabric-target", "run", "-C", sys.argv[2]]
from blockfabric.target.cli import main
sys.exit(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rw", default="randread")
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--size", default="64M", help="bench --size: I/Os = size / 4 KiB")
    ap.add_argument("--top", type=int, default=25, help="functions listed (by calls)")
    ap.add_argument("--builtins", action="store_true", help="list built-ins too")
    args = ap.parse_args()
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        prof = pathlib.Path(tmp) / "target.prof"
        real_spawn = ws.spawn

        def spawn(name, argv, env=None):
            if name.startswith("target-"):
                argv = [sys.executable, "-c", WRAPPER, prof, argv[-1]]
            return real_spawn(name, argv, env)
        ws.spawn = spawn
        port, pid, _ = ws.target("poll")
        bench = subprocess.run(
            [systems.BIN / "blockfabric", "bench", *systems.connect_flags(port), "-i", "1",
             "--rw", args.rw, "--bs", "4k", "--iodepth", str(args.qd), "--size", args.size,
             "--no-time_based", "-o", "json"], capture_output=True, text=True, check=True)
        job = json.loads(bench.stdout)["jobs"][0]
        ios = sum(job[d]["total_ios"] for d in ("read", "write"))
        systems.stop(pid, None)
        dumps = sorted(pathlib.Path(tmp).glob("target.prof.*"))
        if not dumps:
            print("the target wrote no profile", file=sys.stderr)
            return 1
        st = pstats.Stats(*map(str, dumps))
    total = sum(v[1] for v in st.stats.values())
    python = sum(v[1] for k, v in st.stats.items() if k[0] != "~")
    print(f"{args.rw} 4k QD{args.qd}: {ios} I/Os; the target's reactor made "
          f"{total / ios:.1f} calls per I/O, {python / ios:.1f} of them to Python functions")
    rows = sorted(((k, v) for k, v in st.stats.items() if args.builtins or k[0] != "~"),
                  key=lambda kv: -kv[1][1])[:args.top]
    for (path, line, func), (_cc, nc, _tt, _ct, _callers) in rows:
        where = "/".join(pathlib.Path(path).parts[-2:]) if path != "~" else ""
        print(f"  {nc / ios:6.2f}  {func}  {where}:{line}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())

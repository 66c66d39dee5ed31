#!/usr/bin/env python3
"""System calls per I/O on each side: ``strace -c -f`` attached to the target and to the
mount daemon while fio runs through the mount, every count divided by fio's I/O count.

    python benchmarks/syscalls_per_io.py [-t tcp|rdma] [--qd 16] [--rw randread] [--runtime 4]

A ramdisk target and its FUSE mount (NVMe/TCP, or the soft provider with poll progress) are
started as ``cost_per_io.py`` starts them; strace slows every system call, so the I/O rate
under it means nothing and the batching it sees is larger than without it: use this for what
each I/O costs in calls (which ones, how many wake-ups), never for time.  Needs strace.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import systems  # noqa: E402


def counts(path: pathlib.Path) -> dict[str, int]:
    """{syscall: calls} from an ``strace -c`` summary."""
    out = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            out[f[-1]] = int(f[3])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="tcp")
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--rw", default="randread")
    ap.add_argument("--runtime", type=float, default=4.0, help="fio seconds")
    ap.add_argument("--top", type=int, default=8, help="system calls listed per side")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        print("strace is not installed", file=sys.stderr)
        return 1
    engine = ["--ioengine=psync"] if args.qd == 1 else \
        ["--ioengine=libaio", f"--iodepth={args.qd}"]
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        s = ws.blockfabric("tcp" if args.transport == "tcp" else "poll")
        tracers = {}
        for label, pid in (("target", s.server_pid), ("host", s.client_pid)):
            out = pathlib.Path(tmp) / f"{label}.strace"
            tracers[label] = (subprocess.Popen(
                ["strace", "-c", "-f", "-p", str(pid), "-o", str(out)],
                stderr=subprocess.DEVNULL), out)
        time.sleep(1)                       # attached to every thread
        try:
            fio = subprocess.run(
                ["fio", "--name=syscalls", f"--filename={s.path}", f"--rw={args.rw}",
                 "--bs=4k", "--direct=1", *engine, "--time_based",
                 f"--runtime={args.runtime}", "--output-format=json"],
                capture_output=True, text=True, check=True)
        finally:
            for proc, _out in tracers.values():
                proc.send_signal(signal.SIGINT)
                proc.wait(10)
        job = json.loads(fio.stdout)["jobs"][0]
        ios = sum(job[d]["total_ios"] for d in ("read", "write"))
        print(f"{args.rw} 4k QD{args.qd} ({args.transport}): {ios} I/Os under strace")
        for label, (_proc, out) in tracers.items():
            per = sorted(((n / ios, name) for name, n in counts(out).items()), reverse=True)
            print(f"  {label}: {sum(c for c, _ in per):.2f} system calls per I/O: " +
                  ", ".join(f"{name} {c:.2f}" for c, name in per[:args.top]))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())

#!/usr/bin/env python3
"""Python calls per I/O on the target: cProfile over the target's reactor thread while
``blockfabric bench`` makes a fixed number of 4 KiB I/Os (one pass over --size, not timed).

    python benchmarks/calls_per_io.py [--rw randread] [--qd 16] [--size 64M] [--top 25]
    python benchmarks/calls_per_io.py --mount [--qd 1]   # fio through the FUSE mount: the
                                                         # mount's reactor and the target's
    python benchmarks/calls_per_io.py -t tcp [--mount]   # the same over NVMe/TCP

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
import os
import pathlib
import pstats
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import systems  # noqa: E402

# Run inside the target process: profile every thread that runs a reactor, dump on the way out.
WRAPPER = r"""
import cProfile, json, sys, threading
from blockfabric.fabric import reactor as _r
_orig = _r.Reactor.run_forever
_profiles = []
_out = sys.argv[1]
import os as _os
_opcodes = _os.environ.get("CALLS_PER_IO_OPCODES") in ("1", "lines")
_by_line = _os.environ.get("CALLS_PER_IO_OPCODES") == "lines"
def run_forever(self):
    if _opcodes:
        _profiles.append(None)      # (numbers this reactor's dump, as for cProfile)
        _run_counting_opcodes(self, _out + f".{len(_profiles)}")
        return
    p = cProfile.Profile()
    _profiles.append(p)
    p.enable()
    try:
        _orig(self)
    finally:
        p.disable()
        p.dump_stats(_out + f".{len(_profiles)}")
def _run_counting_opcodes(self, out):
    # every bytecode the reactor's thread executes, per code object (sys.settrace with
    # f_trace_opcodes): what the interpreter's eval loop, most of a side's CPU, works through
    counts = {}
    def local(frame, event, arg):
        if event == "opcode":
            key = (frame.f_code, frame.f_lineno) if _by_line else (frame.f_code, 0)
            counts[key] = counts.get(key, 0) + 1
        return local
    def enter(frame, event, arg):
        frame.f_trace_opcodes = True
        return local
    sys.settrace(enter)
    try:
        _orig(self)
    finally:
        sys.settrace(None)
        with open(out, "w") as f:
            json.dump([[c.co_filename, c.co_firstlineno, c.co_name, n, line]
                       for (c, line), n in counts.items()], f)
_r.Reactor.run_forever = run_forever
_reactors = []
_orig_init = _r.Reactor.__init__
def __init__(self, *a, **k):
    _orig_init(self, *a, **k)
    _reactors.append(self)
_r.Reactor.__init__ = __init__
import os
_exit = os._exit
def _dump_then_exit(code):
    # the mount daemon leaves by os._exit: stop its reactors first, so each dumps
    for r in _reactors:
        if r.thread is not None and r.thread.is_alive():
            r.stop()
            r.join(5)
    _exit(code)
os._exit = _dump_then_exit
if sys.argv[2] == "mount":
    sys.argv = ["blockfabric"] + sys.argv[3:]
    from blockfabric.initiator.cli import main
else:
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
    ap.add_argument("--by-time", action="store_true",
                    help="order by own time per I/O (cProfile's, inflated) instead of calls")
    ap.add_argument("--opcodes", action="store_true",
                    help="count the bytecodes each function executes (sys.settrace, opcode "
                         "events) instead of calls: deterministic, and what the interpreter's "
                         "time follows; much slower, so use a smaller --size")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="with --opcodes: also the N lines of each listed function that "
                         "executed most bytecodes (per I/O)")
    ap.add_argument("--mount", action="store_true",
                    help="fio (direct, QD1 psync or libaio) through the FUSE mount instead of "
                         "bench, and the mount's reactor profiled too")
    ap.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="rdma",
                    help="rdma: the soft provider, poll progress (default); tcp: NVMe/TCP")
    args = ap.parse_args()
    if args.opcodes:
        # (the wrapper, in the spawned processes)
        os.environ["CALLS_PER_IO_OPCODES"] = "lines" if args.lines else "1"
    if args.mount:
        return mount_counts(args)
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        prof = pathlib.Path(tmp) / "target.prof"
        real_spawn = ws.spawn

        def spawn(name, argv, env=None):
            if name.startswith("target-"):
                argv = [sys.executable, "-c", WRAPPER, prof, argv[-1]]
            return real_spawn(name, argv, env)
        ws.spawn = spawn
        progress = "tcp" if args.transport == "tcp" else "poll"
        port, pid, _ = ws.target(progress)
        bench = subprocess.run(
            [systems.BIN / "blockfabric", "bench", *systems.connect_flags(port, args.transport),
             "-i", "1",
             "--rw", args.rw, "--bs", "4k", "--iodepth", str(args.qd), "--size", args.size,
             "--no-time_based", "-o", "json"], capture_output=True, text=True, check=True)
        job = json.loads(bench.stdout)["jobs"][0]
        ios = sum(job[d]["total_ios"] for d in ("read", "write"))
        systems.stop(pid, None)
        dumps = sorted(pathlib.Path(tmp).glob("target.prof.*"))
        if not dumps:
            print("the target wrote no profile", file=sys.stderr)
            return 1
        report("target", dumps, ios, args)
    return 0


def report(label: str, dumps: list[pathlib.Path], ios: int, args) -> None:
    """Calls per I/O in the profiles ``dumps`` of one process, and the functions most called."""
    if args.opcodes:
        report_opcodes(label, dumps, ios, args)
        return
    st = pstats.Stats(*map(str, dumps))
    total = sum(v[1] for v in st.stats.values())
    python = sum(v[1] for k, v in st.stats.items() if k[0] != "~")
    print(f"{args.rw} 4k QD{args.qd} ({args.transport}): {ios} I/Os; the {label}'s reactor made "
          f"{total / ios:.1f} calls per I/O, {python / ios:.1f} of them to Python functions")
    by_time = getattr(args, "by_time", False)
    rows = sorted(((k, v) for k, v in st.stats.items() if args.builtins or k[0] != "~"),
                  key=lambda kv: -kv[1][2 if by_time else 1])[:args.top]
    if by_time:
        print(f"  own time per I/O under cProfile (inflated; compare rows): "
              f"{sum(v[2] for v in st.stats.values()) * 1e6 / ios:.1f} us in all")
    for (path, line, func), (_cc, nc, tt, _ct, _callers) in rows:
        where = "/".join(pathlib.Path(path).parts[-2:]) if path != "~" else ""
        extra = f"  {tt * 1e6 / ios:6.2f} us" if by_time else ""
        print(f"  {nc / ios:6.2f}{extra}  {func}  {where}:{line}")


def report_opcodes(label: str, dumps: list[pathlib.Path], ios: int, args) -> None:
    """Bytecodes per I/O in the counts ``dumps`` of one process, and the functions that
    executed most."""
    per: dict[tuple[str, int, str], int] = {}
    lines: dict[tuple[str, int, str], dict[int, int]] = {}
    for dump in dumps:
        for path, line, func, n, at in json.loads(dump.read_text()):
            key = (path, line, func)
            per[key] = per.get(key, 0) + n
            if at:
                own = lines.setdefault(key, {})
                own[at] = own.get(at, 0) + n
    total = sum(per.values())
    print(f"{args.rw} 4k QD{args.qd} ({args.transport}): {ios} I/Os; the {label}'s reactor "
          f"executed {total / ios:.0f} bytecodes per I/O")
    for key, n in sorted(per.items(), key=lambda kv: -kv[1])[:args.top]:
        path, line, func = key
        where = "/".join(pathlib.Path(path).parts[-2:])
        print(f"  {n / ios:7.1f}  {func}  {where}:{line}")
        own = sorted(lines.get(key, {}).items(), key=lambda kv: -kv[1])[:args.lines]
        for at, k in own:
            print(f"           {k / ios:6.1f}  line {at}")


def mount_counts(args) -> int:
    """fio through the mount, both the target's and the mount's reactors under cProfile."""
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        profs = {"target": pathlib.Path(tmp) / "target.prof",
                 "mount": pathlib.Path(tmp) / "mount.prof"}
        real_spawn = ws.spawn

        def spawn(name, argv, env=None):
            if name.startswith("target-"):
                argv = [sys.executable, "-c", WRAPPER, profs["target"], argv[-1]]
            elif name.startswith("mount-"):
                argv = [sys.executable, "-c", WRAPPER, profs["mount"], "mount", *argv[1:]]
            return real_spawn(name, argv, env)
        ws.spawn = spawn
        s = ws.blockfabric("tcp" if args.transport == "tcp" else "poll")
        engine = ["--ioengine=psync"] if args.qd == 1 else \
            ["--ioengine=libaio", f"--iodepth={args.qd}"]
        fio = subprocess.run(
            ["fio", "--name=calls", f"--filename={s.path}", f"--rw={args.rw}", "--bs=4k",
             "--direct=1", *engine, f"--size={args.size}", "--output-format=json"],
            capture_output=True, text=True, check=True)
        job = json.loads(fio.stdout)["jobs"][0]
        ios = sum(job[d]["total_ios"] for d in ("read", "write"))
        systems.unmount(s.path.parent)
        deadline = time.monotonic() + 20      # it dumps its profile on the way out
        while systems.alive(s.client_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        systems.stop(s.client_pid, None)
        systems.stop(s.server_pid, None)
        for label, prof in profs.items():
            dumps = sorted(pathlib.Path(tmp).glob(prof.name + ".*"))
            if not dumps:
                print(f"the {label} wrote no profile", file=sys.stderr)
                return 1
            report(label, dumps, ios, args)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())

#!/usr/bin/env python3
"""How IOPS scale from 1 to 4 I/O queues and from 1 to 4 hosts, with the CPU each side uses,
and where the time goes: py-spy flame graphs of the target and the host at QD16 4k randread.

    python benchmarks/scaling.py [--runtime 6] [--progress thread] [--out benchmarks/results]
    python benchmarks/scaling.py --runtime 1 --max-n 1 --no-profile --out /tmp/s   # a smoke run

Queues: one ``blockfabric bench`` with ``-i N --numjobs N --thread`` (QD16 each, one shared
controller).
Hosts: N ``blockfabric bench`` processes at once, each its own host NQN, one queue, QD16.
N runs from 1 to --max-n (4).  CPU as in cost_per_io.py: sampled while the load runs, over
exactly the span it counted (with N hosts, the span in which all N counted: each runs
STAGGER s longer per further host, as they start up one after the other).
Profiles (py-spy): the target and ``blockfabric bench`` (the host library), then the target
and the FUSE mount daemon under fio, 5 s each; SVGs in --out, and the top self-time frames in
the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import cost_per_io  # noqa: E402
import cpu  # noqa: E402
import report  # noqa: E402
import systems  # noqa: E402

PROFILE_SECONDS = 5
#: py-spy passes, one after the other: (format, file suffix, only the GIL holder)
PASSES = (("flamegraph", "svg", False), ("raw", "txt", False), ("raw", "gil.txt", True))


#: the load: 4 KiB random reads at QD16 per queue and per host
LOAD = cost_per_io.WORKLOADS["randread-4k-qd16"]
#: how much later than the first each further host may start counting (seen: up to 1.9 s
#: for 3 hosts on a loaded 2-core machine, which left 0.1 s of a 2 s run in common)
STAGGER = 1.0


def host_nqn(i: int) -> str:
    return f"nqn.2014-08.org.nvmexpress:uuid:6b1f1c9e-0d3a-4c52-9a53-7363616c{i:04x}"


def loads(port: int, runtime: float, max_n: int = 4
          ) -> list[tuple[str, int, float, list[list[str]]]]:
    """(kind, N, seconds each load runs, the loads to start at once) for N I/O queues of one
    ``blockfabric bench`` and N bench processes (hosts), N from 1 to ``max_n``.  N hosts run
    STAGGER s longer per host after the first: they start up one after the other (Python
    imports, connecting), and are measured over the span in which all of them counted."""
    out = [("I/O queues", n, runtime, [cost_per_io.bench_argv(
        port, LOAD, runtime, "-i", str(n), "--numjobs", str(n), "--thread",
        "--group_reporting")]) for n in range(1, max_n + 1)]
    for n in range(1, max_n + 1):
        longer = runtime + (n - 1) * STAGGER
        out.append(("hosts", n, longer, [cost_per_io.bench_argv(
            port, LOAD, longer, "-i", "1", "-q", host_nqn(i)) for i in range(n)]))
    return out


def profile_loads(port: int, path: pathlib.Path, runtime: float) -> dict[str, list[str]]:
    """The loads profiled: ``blockfabric bench`` (one queue) on the target at ``port``, fio
    on the mounted file ``path``."""
    return {"bench": cost_per_io.bench_argv(port, LOAD, runtime, "-i", "1"),
            "mount": cost_per_io.fio_argv(path, LOAD, runtime)}


def scale(port: int, target_pid: int, runtime: float, env: dict[str, str],
          max_n: int = 4) -> list[dict]:
    rows = []
    for kind, n, seconds, argvs in loads(port, runtime, max_n):
        datas, span, ios = cpu.run_together(argvs, {"target": target_pid}, seconds, env,
                                            timeout=cost_per_io.RAMP + 300)
        iops = sum(cost_per_io.result_of(d)["iops"] for d in datas)
        rows.append(row(kind, n, iops, span, ios))
    return rows


def row(kind: str, n: int, iops: float, span: cpu.Span, ios: float) -> dict:
    """One line of the table: ``span`` is the CPU over the counted run, ``ios`` the I/Os
    counted in it."""
    share = span.share()
    hosts = sum(v for k, v in share.items() if k.startswith("host"))
    per = span.us_per_io(ios)
    r = {"kind": kind, "n": n, "iops": iops, "seconds": span.seconds,
         "target_cores": share.get("target", 0.0), "host_cores": hosts,
         "machine_busy": span.machine, "target_us": per.get("target", 0.0),
         "host_us": sum(v for k, v in per.items() if k.startswith("host"))}
    print(f"{kind:<11}{n}  {iops:>8.0f} IOPS  target {r['target_cores']:.2f} cores "
          f"({r['target_us']:.0f} us/IO)  hosts {hosts:.2f} cores ({r['host_us']:.0f} us/IO)"
          f"  machine {span.machine:.0%}  over {span.seconds:.1f} s", flush=True)
    return r


def profile(name: str, load: list[str], pids: dict[str, int | None], out: pathlib.Path,
            stamp: str, env: dict[str, str], ready: Callable[[], bool]
            ) -> dict[str, list[tuple[str, float]]]:
    """Flame graphs (SVG) and then collapsed stacks of ``pids`` and the load's own process
    (as "host", unless pids names the host) while ``load`` runs, from when ``ready`` (the
    load has connected) and its ramp is over."""
    proc = subprocess.Popen(load, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, **env))
    spots: dict[str, list[tuple[str, float]]] = {}
    try:
        deadline = time.monotonic() + systems.START_TIMEOUT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the load did not start: {err_of(proc)}")
            time.sleep(0.05)
        time.sleep(cost_per_io.RAMP + 0.5)
        who = {"host": proc.pid, **{k: v for k, v in pids.items() if v}}
        for fmt, ext, gil in PASSES:
            files = {k: out / f"flame-{name}-{k}-{stamp}.{ext}" for k in who}
            spies = [cpu.record(pid, files[k], PROFILE_SECONDS, fmt, gil)
                     for k, pid in who.items()]
            for spy in spies:
                _, err = spy.communicate(timeout=PROFILE_SECONDS + 30)
                if spy.returncode != 0:
                    raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')}")
        for k in who:
            for ext, label in (("txt", "all threads"), ("gil.txt", "holding the GIL")):
                raw = out / f"flame-{name}-{k}-{stamp}.{ext}"
                spots[f"{k}, {label}"] = cpu.hot_spots(raw, 8)
                raw.unlink()
        if proc.poll() is not None:
            raise RuntimeError(f"the load ended before profiling did: {err_of(proc)}")
    finally:
        proc.kill()
        proc.wait()
    return spots


def err_of(proc: subprocess.Popen) -> str:
    """What the load ``proc`` wrote to stderr (it is ended first if it still runs)."""
    if proc.poll() is None:
        proc.kill()
    return proc.communicate()[1].decode(errors="replace")


def markdown(rows: list[dict], spots: dict[str, dict], args: argparse.Namespace, when: str,
             stamp: str) -> str:
    m = report.machine()
    out = [f"# Scaling and profiles ({args.progress} progress), {when}", "",
           f"`python benchmarks/scaling.py --runtime {args.runtime} --progress {args.progress}"
           + (f" --max-n {args.max_n}" if args.max_n != 4 else "") + "`"
           f". 4 KiB random reads, QD16 per queue/host, ramdisk target, soft provider over "
           "loopback. CPU over the span each load counted (with N hosts: the span in which all "
           f"N counted, \"counted s\"). Machine: {m['cores']} cores, {m['cpu']}; shared with "
           "other sessions (one run each; noisy).", "",
           "| scaling | N | IOPS | target cores | target us/IO | host cores (all) | "
           "host us/IO | machine busy | counted s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kind']} | {r['n']} | {r['iops']:.0f} | {r['target_cores']:.2f} | "
                   f"{r['target_us']:.0f} | {r['host_cores']:.2f} | {r['host_us']:.0f} | "
                   f"{r['machine_busy']:.0%} | {r['seconds']:.1f} |")
    for name, per in spots.items():
        out += ["", f"## Profile: {name}, randread 4k QD16 ({PROFILE_SECONDS} s, py-spy "
                "--nonblocking, all threads)", ""]
        for who, top in per.items():
            svg = f"flame-{name}-{who.split(',')[0]}-{stamp}.svg"
            out += [f"{who} (flame graph of all threads: `{svg}`), top frames by "
                    f"self time of {top[0][1]:.0f} samples:", ""]
            out += [f"1. {share:.1%} `{frame}`" for frame, share in top[1:]] + [""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", type=float, default=6.0, help="seconds per run")
    p.add_argument("--progress", choices=("thread", "poll"), default="thread")
    p.add_argument("--max-n", type=int, default=4, choices=range(1, 5), metavar="{1..4}",
                   help="queues and hosts from 1 to this many (default: %(default)s)")
    p.add_argument("--out", type=pathlib.Path, default=systems.ROOT / "benchmarks" / "results")
    p.add_argument("--no-profile", action="store_true", help="no py-spy profiles")
    args = p.parse_args(argv)
    if not args.no_profile:
        try:
            cpu.py_spy()        # missing: say so now, not after the scaling runs
        except RuntimeError as exc:
            p.error(f"{exc} (the project's bench extra), or run with --no-profile")
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = f"{now:%Y-%m-%d}-{args.progress}"
    env = {"BLOCKFABRIC_SOFT_PROGRESS": args.progress}
    args.out.mkdir(parents=True, exist_ok=True)
    spots: dict[str, dict] = {}
    with systems.Workspace() as ws:
        port, target_pid, _cmd = ws.target(args.progress)
        rows = scale(port, target_pid, args.runtime, env, args.max_n)
        if not args.no_profile:
            bf = ws.blockfabric(args.progress)      # a target of its own, and the mount
            # longer than the profiling takes: the load is ended after it
            load = profile_loads(port, bf.path, 300)
            base = systems.controllers(port)
            spots["bench"] = profile("bench", load["bench"], {"target": target_pid}, args.out,
                                     stamp, env, lambda: systems.controllers(port) > base)
            spots["mount"] = profile("mount", load["mount"],
                                     {"target": bf.server_pid, "host": bf.client_pid},
                                     args.out, stamp, env, lambda: True)
    (args.out / f"scaling-{stamp}.md").write_text(
        markdown(rows, spots, args, f"{now:%Y-%m-%d %H:%M} UTC", stamp))
    (args.out / f"scaling-{stamp}.json").write_text(json.dumps(
        {"rows": rows, "hot_spots": spots}, indent=1))
    print(f"wrote {args.out}/scaling-{stamp}.md")
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so that the workspace stops its processes and unmounts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

#!/usr/bin/env python3
"""How IOPS scale from 1 to 4 I/O queues and from 1 to 4 hosts, with the CPU each side uses,
and where the time goes: py-spy flame graphs of the target and the host at QD16 4k randread.

    python benchmarks/scaling.py [--runtime 6] [--progress thread] [--out benchmarks/results]

Queues: one ``blockfabric bench`` with ``-i N --numjobs N --thread`` (QD16 each, one shared
controller).
Hosts: N ``blockfabric bench`` processes at once, each its own host NQN, one queue, QD16.
Profiles: the target and ``blockfabric bench`` (the host library), then the target and the
FUSE mount daemon under fio, 5 s each; SVGs in --out, and the top self-time frames in the
report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
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


def host_nqn(i: int) -> str:
    return f"nqn.2014-08.org.nvmexpress:uuid:6b1f1c9e-0d3a-4c52-9a53-7363616c{i:04x}"


def scale(bf: systems.System, runtime: float, env: dict[str, str]) -> list[dict]:
    rows = []
    base = systems.controllers(bf.port)   # the mount's

    def connected(n: int) -> Callable[[], bool]:
        return lambda: systems.controllers(bf.port) >= base + n

    for n in range(1, 5):
        argv = cost_per_io.bench_argv(bf.port, 16, runtime, "-i", str(n), "--numjobs",
                                      str(n), "--thread", "--group_reporting")
        iops, w = cost_per_io.measure(argv, {"target": bf.server_pid}, runtime, env,
                                      ready=connected(1))
        rows.append(row("I/O queues", n, iops, w))
    for n in range(1, 5):
        argvs = [cost_per_io.bench_argv(bf.port, 16, runtime, "-i", "1", "-q", host_nqn(i))
                 for i in range(n)]
        iops, w = cost_per_io.measure(argvs, {"target": bf.server_pid}, runtime, env,
                                      ready=connected(n))
        rows.append(row("hosts", n, iops, w))
    return rows


def row(kind: str, n: int, iops: float, w: cpu.Window) -> dict:
    share = w.share()
    hosts = sum(v for k, v in share.items() if k.startswith("host"))
    r = {"kind": kind, "n": n, "iops": iops, "target_cores": share.get("target", 0.0),
         "host_cores": hosts, "machine_busy": w.machine,
         "target_us": w.us_per_io(iops).get("target", 0.0),
         "host_us": 1e6 * sum(v for k, v in w.cpu.items() if k.startswith("host"))
         / (iops * w.seconds)}
    print(f"{kind:<11}{n}  {iops:>8.0f} IOPS  target {r['target_cores']:.2f} cores "
          f"({r['target_us']:.0f} us/IO)  hosts {hosts:.2f} cores ({r['host_us']:.0f} us/IO)"
          f"  machine {w.machine:.0%}", flush=True)
    return r


def profile(name: str, load: list[str], pids: dict[str, int | None], out: pathlib.Path,
            stamp: str, env: dict[str, str]) -> dict[str, list[tuple[str, float]]]:
    """Flame graphs (SVG) and then collapsed stacks of ``pids`` and the load's own process
    (as "host", unless pids names the host) while ``load`` runs."""
    proc = subprocess.Popen(load, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, **env))
    spots: dict[str, list[tuple[str, float]]] = {}
    try:
        time.sleep(cost_per_io.STARTUP + cost_per_io.RAMP + 0.5)
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
            raise RuntimeError(f"the load ended before profiling did: {proc.stderr.read()}")
    finally:
        proc.kill()
        proc.wait()
    return spots


def markdown(rows: list[dict], spots: dict[str, dict], args: argparse.Namespace, when: str,
             stamp: str) -> str:
    m = report.machine()
    out = [f"# Scaling and profiles ({args.progress} progress), {when}", "",
           f"`python benchmarks/scaling.py --runtime {args.runtime} --progress {args.progress}`"
           f". 4 KiB random reads, QD16 per queue/host, ramdisk target, soft provider over "
           f"loopback. Machine: {m['cores']} cores, {m['cpu']}; shared with other sessions "
           "(one run each; noisy).", "",
           "| scaling | N | IOPS | target cores | target us/IO | host cores (all) | "
           "host us/IO | machine busy |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kind']} | {r['n']} | {r['iops']:.0f} | {r['target_cores']:.2f} | "
                   f"{r['target_us']:.0f} | {r['host_cores']:.2f} | {r['host_us']:.0f} | "
                   f"{r['machine_busy']:.0%} |")
    for name, per in spots.items():
        out += ["", f"## Profile: {name}, randread 4k QD16 ({PROFILE_SECONDS} s, py-spy "
                "--nonblocking, all threads)", ""]
        for who, top in per.items():
            svg = f"flame-{name}-{who.split(',')[0]}-{stamp}.svg"
            out += [f"{who} (flame graph of all threads: `{svg}`), top frames by "
                    f"self time of {top[0][1]:.0f} samples:", ""]
            out += [f"1. {share:.1%} `{frame}`" for frame, share in top[1:]] + [""]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", type=float, default=6.0)
    p.add_argument("--progress", choices=("thread", "poll"), default="thread")
    p.add_argument("--out", type=pathlib.Path, default=systems.ROOT / "benchmarks" / "results")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = f"{now:%Y-%m-%d}-{args.progress}"
    env = {"BLOCKFABRIC_SOFT_PROGRESS": args.progress}
    args.out.mkdir(parents=True, exist_ok=True)
    spots: dict[str, dict] = {}
    with systems.Workspace() as ws:
        bf = ws.blockfabric(args.progress)
        rows = scale(bf, args.runtime, env)
        if not args.no_profile:
            run = 300   # longer than the profiling takes: the load is ended after it
            spots["bench"] = profile("bench", cost_per_io.bench_argv(bf.port, 16, run, "-i",
                                                                     "1"),
                                     {"target": bf.server_pid}, args.out, stamp, env)
            spots["mount"] = profile("mount", cost_per_io.fio_argv(bf.path, 16, run),
                                     {"target": bf.server_pid, "host": bf.client_pid},
                                     args.out, stamp, env)
    (args.out / f"scaling-{stamp}.md").write_text(
        markdown(rows, spots, args, f"{now:%Y-%m-%d %H:%M} UTC", stamp))
    (args.out / f"scaling-{stamp}.json").write_text(json.dumps(
        {"rows": rows, "hot_spots": spots}, indent=1))
    print(f"wrote {args.out}/scaling-{stamp}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

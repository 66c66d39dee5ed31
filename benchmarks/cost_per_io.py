#!/usr/bin/env python3
"""Cost per I/O: server and host CPU microseconds per 4 KiB random read, for blockfabric and
its peers, from /proc/<pid>/stat (utime + stime, all threads) over a window in the middle of a
fixed run.

    python benchmarks/cost_per_io.py [--runtime 8] [--out benchmarks/results]

Scenarios: ``blockfabric bench`` (host library, no FUSE) and fio through the blockfabric mount,
each with the soft engine on its own thread and driven by the reactors (poll); fio through
nbdkit memory + nbdfuse and nbdkit python + nbdfuse; and libnbd's Python bindings on nbdkit
memory.  "host" is the bench process, the FUSE daemon (blockfabric mount or nbdfuse) or the
libnbd script; "app" is fio, where there is one.
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

import cpu  # noqa: E402
import report  # noqa: E402
import systems  # noqa: E402

STARTUP = 1.0   # a load's start-up (imports, connect) is over this long after launch
RAMP = 1.0
WORKLOADS = (("randread 4k QD16", 16), ("randread 4k QD1", 1))


def fio_argv(path: pathlib.Path, iodepth: int, runtime: float) -> list[str]:
    """benchmarks/fio/randread-4k-qd16.fio (or -qd1.fio) as flags, with this runtime."""
    engine = "libaio" if iodepth > 1 else "psync"
    return ["fio", "--name=randread", f"--filename={path}", "--direct=1", "--rw=randread",
            "--bs=4k", f"--ioengine={engine}", f"--iodepth={iodepth}", "--randrepeat=1",
            "--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}",
            "--output-format=json"]


def bench_argv(port: int, iodepth: int, runtime: float, *extra: str) -> list[str]:
    return [str(systems.BIN / "blockfabric"), "bench", *systems.connect_flags(port),
            "--rw", "randread", "--bs", "4k", "--iodepth", str(iodepth), "--runtime",
            str(runtime), "--ramp_time", str(RAMP), "--eta", "never", "-o", "json", *extra]


def nbd_argv(port: int, iodepth: int, runtime: float) -> list[str]:
    return [sys.executable, str(systems.ROOT / "benchmarks" / "compare" / "nbd_qd.py"),
            "--port", str(port), "--iodepth", str(iodepth), "--runtime", str(runtime),
            "--ramp", str(RAMP)]


def iops_of(out: dict) -> float:
    """IOPS from fio's or blockfabric bench's JSON, or nbd_qd's."""
    if "jobs" in out:
        job = out["jobs"][0]
        return job["read"]["iops"] + job["write"]["iops"]
    return out["iops"]


def measure(argv: list[str] | list[list[str]], pids: dict[str, int | None], runtime: float,
            env: dict[str, str] | None = None, app: str = "host",
            ready: Callable[[], bool] | None = None) -> tuple[float, cpu.Window]:
    """Run the load ``argv`` (or several at once: ``app``0, ``app``1, ...) and measure CPU
    over the middle of its counted runtime; returns the summed IOPS and the window.
    ``ready`` says when every load has connected (start-up is slow on a busy machine);
    without it, start-up is taken to end after STARTUP seconds."""
    argvs = argv if isinstance(argv[0], list) else [argv]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
             for a in argvs]
    names = [app] if len(procs) == 1 else [f"{app}{i}" for i in range(len(procs))]
    try:
        if ready is None:
            time.sleep(STARTUP)
        else:
            deadline = time.monotonic() + 30
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(RAMP + 0.5)
        window = cpu.Window({**pids, **{n: p.pid for n, p in zip(names, procs)}})
        window.start()
        time.sleep(max(1.0, runtime - 1.5))
        window.stop()
        outs = [p.communicate(timeout=runtime + 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    iops = 0.0
    for a, p, (out, err) in zip(argvs, procs, outs):
        if p.returncode != 0:
            raise systems.SetupError(f"{' '.join(a)}: {err}")
        iops += iops_of(json.loads(out[out.index("{"):]))
    return iops, window


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    rt = args.runtime

    def add(name: str, workload: str, iops: float, w: cpu.Window) -> None:
        per = w.us_per_io(iops)
        rows.append({"scenario": name, "workload": workload, "iops": iops,
                     "us_per_io": per, "cores": w.share(), "machine_busy": w.machine})
        print(f"{name:<34}{workload:<18}{iops:>9.0f} IOPS  "
              + "  ".join(f"{k} {v:.0f} us" for k, v in per.items())
              + f"  machine {w.machine:.0%}", flush=True)

    with systems.Workspace() as ws:
        bfs = [ws.blockfabric(p) for p in ("thread", "poll")]
        mem, py = ws.nbd_memory(), ws.nbd_python()
        for workload, qd in WORKLOADS:
            for bf in bfs:
                env = {"BLOCKFABRIC_SOFT_PROGRESS": bf.key.split("-")[1]}
                base = systems.controllers(bf.port)
                iops, w = measure(bench_argv(bf.port, qd, rt, "-i", "1"),
                                  {"server": bf.server_pid}, rt, env,
                                  ready=lambda: systems.controllers(bf.port) > base)
                add(f"blockfabric bench ({bf.key[3:]})", workload, iops, w)
                iops, w = measure(fio_argv(bf.path, qd, rt),
                                  {"server": bf.server_pid, "host": bf.client_pid}, rt,
                                  app="app (fio)")
                add(f"fio on blockfabric mount ({bf.key[3:]})", workload, iops, w)
            for peer in (mem, py):
                iops, w = measure(fio_argv(peer.path, qd, rt),
                                  {"server": peer.server_pid, "host": peer.client_pid}, rt,
                                  app="app (fio)")
                add(f"fio on {peer.label}", workload, iops, w)
            iops, w = measure(nbd_argv(mem.port, qd, rt), {"server": mem.server_pid}, rt)
            add("libnbd Python on nbdkit memory", workload, iops, w)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, when: str) -> str:
    m = report.machine()
    out = [f"# Cost per I/O, {when}", "",
           f"`python benchmarks/cost_per_io.py --runtime {args.runtime}`. CPU from "
           "/proc/<pid>/stat (utime+stime, all threads) over a window in the middle of each "
           f"{args.runtime} s run, divided by the I/Os the load reported for that window "
           "(IOPS x window). 4 KiB random reads on a 256 MiB ramdisk/memory volume over "
           f"loopback. Machine: {m['cores']} cores, {m['cpu']}, Linux {m['kernel']}; shared "
           "with other sessions, so numbers are noisy (one run each).", "",
           "| scenario | workload | IOPS | server us/IO | host us/IO | app (fio) us/IO | "
           "server cores | host cores | machine busy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u, c = r["us_per_io"], r["cores"]
        out.append(f"| {r['scenario']} | {r['workload']} | {r['iops']:.0f} | "
                   f"{u.get('server', 0):.0f} | {u.get('host', 0):.0f} | "
                   + (f"{u['app (fio)']:.0f}" if "app (fio)" in u else "-")
                   + f" | {c.get('server', 0):.2f} | {c.get('host', 0):.2f} | "
                   f"{r['machine_busy']:.0%} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", type=float, default=8.0)
    p.add_argument("--out", type=pathlib.Path, default=systems.ROOT / "benchmarks" / "results")
    args = p.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cost_per_io-{now:%Y-%m-%d}.md").write_text(
        markdown(rows, args, f"{now:%Y-%m-%d %H:%M} UTC"))
    (args.out / f"cost_per_io-{now:%Y-%m-%d}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}/cost_per_io-{now:%Y-%m-%d}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

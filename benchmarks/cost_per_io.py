#!/usr/bin/env python3
"""Cost per I/O: target (server), host and fio CPU microseconds per I/O, next to IOPS
and completion latency, for blockfabric, its peers and the pure-Python performance floor;
CPU from /proc/<pid>/stat (utime + stime, all threads), sampled while the load runs, over
exactly the span the load counted (it reports its end time and duration), fio's own from
its JSON (usr_cpu + sys_cpu over its run / its I/Os).

    python benchmarks/cost_per_io.py [--runtime 8] [--rounds 1] [--out benchmarks/results]
    python benchmarks/cost_per_io.py --systems mount-poll,floor --rounds 3 --runtime 3
    python benchmarks/cost_per_io.py --workloads randwrite-4k-qd16 --systems mount-poll,floor
    python benchmarks/cost_per_io.py --workloads read-1m-qd8,write-1m-qd8 \
        --systems mount-poll,mount-poll-noshm,mount-poll-w2,nbd-memory --rounds 3

Systems (``--systems``, default all but the thread-progress ones): see SYSTEMS.  The floor is
found with ``--floor DIR``, $BLOCKFABRIC_PERF_FLOOR or a shared/perf-floor above the project;
without it: "floor: skipped (not found)".  Rounds are interleaved (each round runs every
workload on every system, the system order rotated) and the report gives medians, so a burst
of load from other users of the machine hits all systems alike.  "host" is the bench process,
the FUSE daemon (blockfabric mount, nbdfuse, floor_host.py) or the libnbd script; "fio" is fio,
where there is one.  The report ends with issue 14's CPU goal: target+host CPU per 4 KiB read
through the blockfabric mount <= 2.0x the floor's, at QD16 and QD1, PASS or FAIL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import signal
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import cpu  # noqa: E402
import report  # noqa: E402
import systems  # noqa: E402

RAMP = 1.0      # seconds of each load before it counts


@dataclass(frozen=True)
class Workload:
    key: str      # also the benchmarks/fio/<key>.fio it mirrors
    title: str
    rw: str
    qd: int
    bs: str = "4k"


WORKLOADS = {w.key: w for w in (
    Workload("randread-4k-qd16", "randread 4k QD16", "randread", 16),
    Workload("randread-4k-qd1", "randread 4k QD1", "randread", 1),
    Workload("randwrite-4k-qd16", "randwrite 4k QD16", "randwrite", 16),
    Workload("randread-4k-qd4", "randread 4k QD4", "randread", 4),
    Workload("randread-4k-qd8", "randread 4k QD8", "randread", 8),
    Workload("randread-4k-qd32", "randread 4k QD32", "randread", 32),
    Workload("read-1m-qd8", "seq read 1M QD8", "read", 8, "1m"),
    Workload("write-1m-qd8", "seq write 1M QD8", "write", 8, "1m"),
    Workload("randwrite-16k-qd16", "randwrite 16k QD16", "randwrite", 16, "16k"),
    Workload("randwrite-64k-qd16", "randwrite 64k QD16", "randwrite", 16, "64k"),
)}
DEFAULT_WORKLOADS = "randread-4k-qd16,randread-4k-qd1"

#: key -> (label, kind, progress): kind is "floor", "mount", "bench", "nbd-memory",
#: "nbd-python" or "libnbd" (libnbd's Python bindings on nbdkit memory, reads only).
SYSTEMS = {
    "floor": ("fio on the floor (pure Python)", "floor", None),
    "mount-poll": ("fio on blockfabric mount (poll)", "mount", "poll"),
    "mount-thread": ("fio on blockfabric mount (thread)", "mount", "thread"),
    "bench-poll": ("blockfabric bench (poll)", "bench", "poll"),
    "bench-thread": ("blockfabric bench (thread)", "bench", "thread"),
    "mount-tcp": ("fio on blockfabric mount (NVMe/TCP)", "mount", "tcp"),
    "bench-tcp": ("blockfabric bench (NVMe/TCP)", "bench", "tcp"),
    # the target with two poll groups (a worker process beside the coordinator): the
    # target's CPU is its process tree's
    "mount-tcp-2r": ("fio on blockfabric mount (NVMe/TCP, reactors 2)", "mount", "tcp-2r"),
    "bench-tcp-2r": ("blockfabric bench (NVMe/TCP, reactors 2)", "bench", "tcp-2r"),
    "nbd-memory": ("fio on nbdkit memory + nbdfuse", "nbd-memory", None),
    "nbd-python": ("fio on nbdkit python + nbdfuse", "nbd-python", None),
    "libnbd": ("libnbd Python on nbdkit memory", "libnbd", None),
}
DEFAULT_SYSTEMS = "floor,mount-poll,bench-poll,nbd-memory,nbd-python,libnbd"
#: a blockfabric system with variations: "mount-tcp-s100" is mount-tcp with target and
#: mount at $BLOCKFABRIC_REACTOR_SPIN_US=100 (against mount-tcp in the same run);
#: "-noshm": the soft provider over TCP loopback even on this host (BLOCKFABRIC_SOFT_SHM=0);
#: "-w2": the mount with --fuse-workers 2
SPUN = re.compile(r"^((?:mount|bench)-(?:poll|thread|tcp)(?:-2r)?)((?:-(?:s\d+|noshm|w\d+))+)$")
CPU_GOAL_VS_FLOOR = report.CPU_GOAL_VS_FLOOR   # issue 14: mount target+host <= 2x the floor


def fio_argv(path: pathlib.Path, w: Workload, runtime: float) -> list[str]:
    """benchmarks/fio/<w.key>.fio as flags, with this runtime."""
    engine = "libaio" if w.qd > 1 else "psync"
    return ["fio", f"--name={w.rw}", f"--filename={path}", "--direct=1", f"--rw={w.rw}",
            f"--bs={w.bs}", f"--ioengine={engine}", f"--iodepth={w.qd}", "--randrepeat=1",
            "--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}",
            "--output-format=json"]


def bench_argv(port: int, w: Workload, runtime: float, *extra: str,
               transport: str = "rdma") -> list[str]:
    return [str(systems.BIN / "blockfabric"), "bench", *systems.connect_flags(port, transport),
            "--rw", w.rw, "--bs", w.bs, "--iodepth", str(w.qd), "--runtime",
            str(runtime), "--ramp_time", str(RAMP), "--eta", "never", "-o", "json", *extra]


def nbd_argv(port: int, w: Workload, runtime: float) -> list[str]:
    return [sys.executable, str(systems.ROOT / "benchmarks" / "compare" / "nbd_qd.py"),
            "--port", str(port), "--rw", w.rw, "--iodepth", str(w.qd), "--runtime",
            str(runtime), "--ramp", str(RAMP)]


def result_of(out: dict) -> dict[str, float]:
    """IOPS, clat p50/p99 (us) and, for fio, fio's CPU us per I/O; from fio's or blockfabric
    bench's JSON, or nbd_qd's."""
    if "jobs" not in out:
        return {"iops": out["iops"], "p50_us": out["p50_us"], "p99_us": out["p99_us"]}
    job = out["jobs"][0]
    rd, wr = job["read"], job["write"]
    side = rd if rd["io_bytes"] else wr
    pct = side["clat_ns"].get("percentile", {})
    res = {"iops": rd["iops"] + wr["iops"], "p50_us": pct.get("50.000000", 0) / 1e3,
           "p99_us": pct.get("99.000000", 0) / 1e3}
    ios = rd["total_ios"] + wr["total_ios"]
    if out.get("fio version", "").startswith("fio") and ios:   # fio itself, not bench
        res["fio_us"] = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3 \
            / ios * 1e6
    return res


def measure(argv: list[str], pids: dict[str, int | None], runtime: float,
            env: dict[str, str] | None = None) -> tuple[dict[str, float], cpu.Span]:
    """Run the load ``argv`` while sampling the CPU of ``pids`` and of the load itself
    (:func:`cpu.run_counted`); returns the load's result (see :func:`result_of`, with the
    I/Os counted as "ios") and the CPU over exactly the counted run it reports."""
    data, span, ios = cpu.run_counted(argv, pids, runtime, env, timeout=RAMP + 300)
    res = result_of(data)
    res["ios"] = ios
    return res, span


class Fleet:
    """The systems selected, started once (each FUSE mount, target or nbdkit shared by the
    loads that need it), and one measurement of a system under a workload."""

    def __init__(self, ws: systems.Workspace, keys: list[str], floor: pathlib.Path | None,
                 runtime: float) -> None:
        self.ws, self.runtime = ws, runtime
        self.mounts: dict[str, systems.System] = {}
        self.ports: dict[str, tuple[int, int]] = {}     # progress -> (port, target pid)
        self.nbd: dict[str, systems.System] = {}
        self.floor: systems.System | None = None
        self.note = ""
        for key in keys:
            _label, kind, progress = SYSTEMS[key]
            if kind == "floor":
                try:
                    self.floor = ws.floor(floor)
                except systems.SetupError as exc:     # a yardstick, not the thing measured
                    self.note = ("floor: skipped (did not start: "
                                 f"{' '.join(str(exc).split())})")
                    print(self.note, flush=True)
            elif kind == "mount" and progress not in self.mounts:
                bf = ws.blockfabric(progress)
                self.mounts[progress] = bf
                self.ports[progress] = (bf.port, bf.server_pid)
        for key in keys:
            _label, kind, progress = SYSTEMS[key]
            if kind == "bench" and progress not in self.ports:
                port, pid, _cmd = ws.target(progress)
                self.ports[progress] = (port, pid)
            elif kind in ("nbd-memory", "libnbd") and "memory" not in self.nbd:
                self.nbd["memory"] = ws.nbd_memory()
            elif kind == "nbd-python" and "python" not in self.nbd:
                self.nbd["python"] = ws.nbd_python()

    def supports(self, key: str, w: Workload) -> bool:
        kind = SYSTEMS[key][1]
        return not ((kind == "libnbd" and w.rw != "randread")
                    or (kind == "floor" and self.floor is None))

    def measure(self, key: str, w: Workload) -> tuple[dict[str, float], cpu.Span]:
        _label, kind, progress = SYSTEMS[key]
        rt = self.runtime
        if kind == "bench":
            port, pid = self.ports[progress]
            transport, soft = systems.variant(progress)
            return measure(bench_argv(port, w, rt, "-i", "1", transport=transport),
                           {"server": pid}, rt,
                           {"BLOCKFABRIC_SOFT_PROGRESS": soft, **systems.env_of(progress)})
        if kind == "libnbd":
            mem = self.nbd["memory"]
            return measure(nbd_argv(mem.port, w, rt), {"server": mem.server_pid}, rt)
        s = {"floor": self.floor, "mount": self.mounts.get(progress),
             "nbd-memory": self.nbd.get("memory"), "nbd-python": self.nbd.get("python")}[kind]
        return measure(fio_argv(s.path, w, rt), {"server": s.server_pid, "host": s.client_pid},
                       rt)


def run(args: argparse.Namespace) -> list[dict]:
    """Every round: every workload on every system (order rotated per round); one row per
    measurement."""
    rows: list[dict] = []
    keys, workloads = args.systems, args.workloads
    with systems.Workspace() as ws:
        fleet = Fleet(ws, keys, args.floor_dir, args.runtime)
        if fleet.note:
            args.floor_note = fleet.note
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            turn = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
            for w in workloads:
                for key in turn:
                    if not fleet.supports(key, w):
                        continue
                    load1 = report.loadavg()
                    res, win = fleet.measure(key, w)
                    per = win.us_per_io(res.pop("ios"))
                    if "fio_us" in res:
                        per["fio"] = res.pop("fio_us")
                    row = {"system": key, "scenario": SYSTEMS[key][0], "workload": w.key,
                           "round": rnd + 1, **res, "us_per_io": per, "cores": win.share(),
                           "machine_busy": win.machine, "load1": load1}
                    rows.append(row)
                    print(f"  {key:<13}{w.key:<19}{res['iops']:>9.0f} IOPS  p99 "
                          f"{res['p99_us']:>6.0f} us  "
                          + "  ".join(f"{k} {v:.1f}" for k, v in per.items())
                          + f" us/IO  machine {win.machine:.0%}  load {load1:.1f}", flush=True)
    return rows


def medians(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(system, workload) -> the medians over the rounds (and the IOPS range)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["workload"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("iops", "p50_us", "p99_us")}
        parts = sorted({p for r in rs for p in r["us_per_io"]})
        med["us_per_io"] = {p: statistics.median(r["us_per_io"].get(p, 0.0) for r in rs)
                            for p in parts}
        med["server_host"] = statistics.median(
            r["us_per_io"].get("server", 0.0) + r["us_per_io"].get("host", 0.0) for r in rs)
        med["iops_range"] = (min(r["iops"] for r in rs), max(r["iops"] for r in rs))
        med["runs"] = len(rs)
        med["machine_busy"] = statistics.median(r["machine_busy"] for r in rs)
        out[key] = med
    return out


def acceptance(med: dict[tuple[str, str], dict]) -> list[str]:
    """Issue 14's CPU goal, one line per blockfabric mount and QD: target+host CPU per 4 KiB
    read <= CPU_GOAL_VS_FLOOR x the floor's, PASS or FAIL with the ratio.  Every mount
    system measured: the soft provider's and NVMe/TCP's (issue 18 sets it the same goals),
    with a spin or poll groups as well."""
    lines = []
    mounts = [key for key, (_label, kind, _progress) in SYSTEMS.items() if kind == "mount"]
    for wkey in ("randread-4k-qd16", "randread-4k-qd1"):
        title = WORKLOADS[wkey].title
        floor = med.get(("floor", wkey))
        for key in mounts:
            got = med.get((key, wkey))
            if got is None:
                continue
            if floor is None or floor["server_host"] <= 0:
                lines.append(f"- {title}, {SYSTEMS[key][0]}: {got['server_host']:.1f} us "
                             "target+host; floor not measured: no verdict")
                continue
            r = got["server_host"] / floor["server_host"]
            ok = r <= CPU_GOAL_VS_FLOOR
            lines.append(f"- {title}, {SYSTEMS[key][0]}: {got['server_host']:.1f} us "
                         f"target+host vs the floor's {floor['server_host']:.1f} us = "
                         f"{r:.2f}x (goal <= {CPU_GOAL_VS_FLOOR:g}x): "
                         f"**{'PASS' if ok else 'FAIL'}**")
    return lines


def markdown(rows: list[dict], args: argparse.Namespace, when: str) -> str:
    m = report.machine()
    med = medians(rows)
    load = [r["load1"] for r in rows] or [report.loadavg()]
    out = [f"# Cost per I/O, {when}", "",
           f"`python benchmarks/cost_per_io.py {' '.join(args.argv)}`. CPU from "
           "/proc/<pid>/stat (utime+stime, all threads), sampled every 25 ms, over the "
           f"counted part of each {args.runtime:g} s run (after {RAMP:g} s ramp; the load "
           "reports its end time and duration), divided by the I/Os the load counted; fio's "
           "own CPU from its JSON (usr_cpu+sys_cpu over its run / its "
           "I/Os). 4 KiB I/O on a 256 MiB ramdisk/memory volume over loopback. "
           f"{args.rounds} interleaved round(s), medians (IOPS: median (min-max)). "
           f"Machine: {m['cores']} cores, {m['cpu']}, Linux {m['kernel']}, Python "
           f"{m['python']}; shared with other sessions: 1-minute load average before each run "
           f"min {min(load):.1f}, median {statistics.median(load):.1f}, max {max(load):.1f}.",
           ""]
    if args.floor_note:
        out += [args.floor_note, ""]
    out += ["| system | workload | IOPS | clat p50 / p99 us | target us/IO | host us/IO | "
            "target+host us/IO | fio us/IO | machine busy |", "|---" * 9 + "|"]
    for w in args.workloads:
        for key in args.systems:
            g = med.get((key, w.key))
            if g is None:
                continue
            u = g["us_per_io"]
            lo, hi = g["iops_range"]
            iops = f"{g['iops']:.0f}" + (f" ({lo:.0f}-{hi:.0f})" if g["runs"] > 1 else "")
            out.append(f"| {SYSTEMS[key][0]} | {w.title} | {iops} | {g['p50_us']:.0f} / "
                       f"{g['p99_us']:.0f} | {u.get('server', 0):.1f} | "
                       f"{u.get('host', 0):.1f} | {g['server_host']:.1f} | "
                       + (f"{u['fio']:.1f}" if "fio" in u else "-")
                       + f" | {g['machine_busy']:.0%} |")
    out += ["", "## Issue 14's CPU goal (target+host per 4 KiB read, through the mount)", ""]
    out += acceptance(med) or ["- not measured (needs a mount system and randread workloads)"]
    return "\n".join(out) + "\n"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", type=float, default=8.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"comma list of {', '.join(SYSTEMS)}, or all; a mount-/bench- one "
                        "with -s<US> added runs with that reactor spin (mount-tcp-s100), with "
                        "-noshm the soft provider over TCP loopback instead of same-host "
                        "shared memory (mount-poll-noshm), with -w<N> the mount with "
                        "--fuse-workers N (mount-poll-w2); tails combine "
                        "(default: %(default)s)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help=f"comma list of {', '.join(WORKLOADS)} (default: %(default)s)")
    p.add_argument("--floor", help=f"the perf-floor directory (default: ${systems.FLOOR_ENV}"
                                   ", else a shared/perf-floor above the project)")
    p.add_argument("--tag", help="added to the results' file names, e.g. baseline")
    p.add_argument("--out", type=pathlib.Path, default=systems.ROOT / "benchmarks" / "results")
    a = p.parse_args(argv)
    a.argv = argv
    if a.rounds < 1 or a.runtime <= 0:
        p.error("--rounds and --runtime must be positive")
    keys = list(SYSTEMS) if a.systems == "all" else \
        [k.strip() for k in a.systems.split(",") if k.strip()]
    for key in keys:
        spun = SPUN.match(key)
        if spun and spun[1] in SYSTEMS:
            label, kind, progress = SYSTEMS[spun[1]]
            progress = f"{progress}{spun[2]}"
            text = ", ".join(systems.tails_text(progress))
            SYSTEMS[key] = (f"{label[:-1]}, {text})" if label.endswith(")")
                            else f"{label}, {text}", kind, progress)
    wkeys = [k.strip() for k in a.workloads.split(",") if k.strip()]
    for what, got, known in (("system", keys, SYSTEMS), ("workload", wkeys, WORKLOADS)):
        bad = [k for k in got if k not in known]
        if bad or not got:
            p.error(f"unknown {what}(s) {bad or got}: choose from {', '.join(known)}")
    a.workloads = [WORKLOADS[k] for k in dict.fromkeys(wkeys)]
    a.systems = list(dict.fromkeys(keys))
    a.floor_dir, a.floor_note = None, ""
    if "floor" in a.systems:
        a.floor_dir = systems.find_floor(a.floor)
        if a.floor_dir is None:
            a.systems.remove("floor")
            a.floor_note = "floor: skipped (not found)"
        else:
            a.floor_note = f"floor: {a.floor_dir} (the same interpreter as blockfabric)"
    if not a.systems:
        p.error("no system left to measure")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.floor_note:
        print(args.floor_note, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"cost_per_io-{now:%Y-%m-%d}" + (f"-{args.tag}" if args.tag else "")
    text = markdown(rows, args, f"{now:%Y-%m-%d %H:%M} UTC")
    (args.out / f"{stem}.md").write_text(text)
    med = medians(rows)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"command": ["benchmarks/cost_per_io.py", *args.argv], "floor": str(args.floor_dir),
         "rows": rows, "medians": [{"system": s, "workload": w, **v}
                                   for (s, w), v in med.items()],
         "acceptance": acceptance(med)}, indent=1))
    print(text[text.index("| system"):], flush=True)
    print(f"wrote {args.out}/{stem}.md")
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so that the workspace stops its processes and unmounts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

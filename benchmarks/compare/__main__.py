"""``make bench``: blockfabric side by side with its peers, the same fio jobs on each, in turns.

Systems: blockfabric (soft provider, ramdisk target, FUSE mount) with the soft engine on its own
thread and driven by the reactors (poll), the poll one again with ``--fuse-workers 2``
(poll-w2: two FUSE readers), over NVMe/TCP (tcp), nbdkit memory + nbdfuse, nbdkit's Python plugin (a
small memory plugin, memplugin.py) + nbdfuse, the pure-Python performance floor (floor_target.py
+ floor_host.py from --floor DIR, $BLOCKFABRIC_PERF_FLOOR or a shared/perf-floor above the
project; skipped when not found) and a file on tmpfs.  Each fio run also gives every system's
CPU us per I/O (target/server and host from /proc/PID/stat over the span fio counted, fio's
own from its JSON), and the report ends with issue 14's acceptance, each goal PASS or FAIL.
Rounds are interleaved (each round runs every job on every system, rotating the system order),
so a burst of load from other users of the machine hits all systems alike; the report gives
medians and min-max.
Then the library level: ``blockfabric bench`` against libnbd's Python bindings (no FUSE).

    python benchmarks/compare [--rounds 3] [--runtime 5] [--out benchmarks/results]
    python benchmarks/compare --quick --out DIR     # a smoke run of seconds
    python benchmarks/compare --systems tcp,nbd-memory,nbd-python,floor   # some systems only
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cpu  # noqa: E402
import report  # noqa: E402
import systems  # noqa: E402
from report import JOBS, Job  # noqa: E402

FIO_JOBS = systems.ROOT / "benchmarks" / "fio"
#: --systems: the keys, in the order the systems start
#: "poll-w2": the soft mount with --fuse-workers 2 (two FUSE readers: the streaming jobs)
SYSTEM_KEYS = ("thread", "poll", "poll-w2", "nbd-memory", "nbd-python", "tcp", "floor",
               "tmpfs")
#: Library-level workloads: (key, title, blockfabric bench flags, nbd_qd flags, metric).
LIBRARY = (
    ("randread-4k-qd1", "randread 4k QD1", ["--rw", "randread", "--bs", "4k", "--iodepth", "1"],
     ["--rw", "randread", "--bs", "4096", "--iodepth", "1"], "iops"),
    ("randread-4k-qd16", "randread 4k QD16",
     ["--rw", "randread", "--bs", "4k", "--iodepth", "16"],
     ["--rw", "randread", "--bs", "4096", "--iodepth", "16"], "iops"),
    ("seqread-1m-qd8", "seq read 1M QD8", ["--rw", "read", "--bs", "1m", "--iodepth", "8"],
     ["--rw", "read", "--bs", str(1 << 20), "--iodepth", "8"], "bw"),
)


class Runner:
    """Runs the rounds and keeps every number and command for the report."""

    def __init__(self, args: argparse.Namespace, ws: systems.Workspace) -> None:
        self.args = args
        self.ws = ws
        self.fio: dict[str, dict[str, list[float]]] = {}    # job -> system -> values
        self.p99: dict[str, dict[str, list[float]]] = {}    # job -> system -> clat p99 (us)
        self.p50: dict[str, dict[str, list[float]]] = {}    # job -> system -> clat p50 (us)
        #: job -> system -> per round {"server", "host", "fio"} CPU us per I/O
        self.cpu: dict[str, dict[str, list[dict[str, float]]]] = {}
        self.lib: dict[str, dict[str, list[float]]] = {}    # workload -> side -> values
        #: workload -> side -> per round {"server", "host"} CPU us per I/O
        self.lib_cpu: dict[str, dict[str, list[dict[str, float]]]] = {}
        self.load: list[float] = [report.loadavg()]
        #: CPU steal per fio job and library run, percent of the machine's time; and the
        #: /proc/stat reading the whole run's is counted from
        self.steal: list[float] = []
        self.stat0 = cpu.cpu_times()
        self.fio_cmd = ""
        self.lib_cmds: dict[str, str] = {}

    def job_file(self, job: Job) -> pathlib.Path:
        """The job file of benchmarks/fio/ with this run's runtime and ramp time."""
        text = (FIO_JOBS / f"{job.key}.fio").read_text()
        text = re.sub(r"(?m)^runtime=\S+", f"runtime={self.args.runtime_text}", text)
        text = re.sub(r"(?m)^ramp_time=\S+", f"ramp_time={self.args.ramp_text}", text)
        path = self.ws.tmp / f"{job.key}.fio"
        path.write_text(text)
        return path

    def run_fio(self, job: Job, system: systems.System) -> None:
        argv = ["fio", f"--filename={system.path}", "--output-format=json",
                str(self.job_file(job))]
        self.fio_cmd = "fio --filename=FILE --output-format=json JOBFILE"
        stat = cpu.cpu_times()
        with cpu.Sampler({"server": system.server_pid, "host": system.client_pid}) as smp:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                  stdin=subprocess.DEVNULL, cwd=self.ws.tmp)
        self.steal.append(cpu.steal_pct(stat, cpu.cpu_times()))
        if done.returncode != 0:
            raise systems.SetupError(f"fio {job.key} on {system.label}: {done.stderr}")
        out = json.loads(done.stdout[done.stdout.index("{"):])
        res = out["jobs"][0]
        rd, wr = res["read"], res["write"]
        value = (rd["bw_bytes"] + wr["bw_bytes"]) if job.metric == "bw" \
            else rd["iops"] + wr["iops"]
        side = rd if rd["io_bytes"] else wr
        pct = side["clat_ns"]["percentile"]
        p99 = pct["99.000000"] / 1000
        # CPU of the server and host over the span fio counted; fio's own from its JSON
        # (usr/sys % of its job runtime, summed over its jobs with group_reporting)
        t0, t1, ios = cpu.counted_span(out, self.args.runtime)
        per = smp.span(t0, t1).us_per_io(ios)
        per["fio"] = ((res["usr_cpu"] + res["sys_cpu"]) / 100 * res["job_runtime"] / 1e3
                      / max(1, ios) * 1e6)
        for store, v in ((self.fio, value), (self.p99, p99), (self.p50, pct["50.000000"] / 1e3),
                         (self.cpu, per)):
            store.setdefault(job.key, {}).setdefault(system.key, []).append(v)
        self.load.append(report.loadavg())
        say(f"  {job.key:<26}{system.label:<26}{report.fmt(job.metric, value):>12}"
            f"  p99 {p99:.0f} us  CPU us/IO "
            + " ".join(f"{k} {v:.1f}" for k, v in per.items()))

    def fio_rounds(self, order: list[systems.System]) -> None:
        for rnd in range(self.args.rounds):
            say(f"round {rnd + 1}/{self.args.rounds}")
            turn = order[rnd % len(order):] + order[:rnd % len(order)]
            for job in JOBS:
                for system in turn:
                    self.run_fio(job, system)

    def library_rounds(self, bfs: list[systems.System], nbd: systems.System) -> None:
        """blockfabric bench (host library, no FUSE) vs libnbd's Python bindings."""
        runtime, ramp = str(self.args.runtime), str(self.args.ramp)
        for rnd in range(self.args.rounds):
            say(f"library round {rnd + 1}/{self.args.rounds}")
            for key, _title, bf_flags, nbd_flags, metric in LIBRARY:
                for bf in bfs:
                    progress = bf.key.split("-")[1]
                    env = {"BLOCKFABRIC_SOFT_PROGRESS": progress}
                    argv = [str(systems.BIN / "blockfabric"), "bench",
                            *systems.connect_flags(bf.port), "--runtime", runtime,
                            "--ramp_time", ramp, "--eta", "never", "-o", "json", *bf_flags]
                    self.lib_cmds[f"{bf.key} {key}"] = systems.shell(argv, env)
                    out, per = self.run_json(argv, bf.server_pid, env)
                    read = out["jobs"][0]["read"]
                    self._lib(key, bf.key, read["bw_bytes"] if metric == "bw"
                              else read["iops"], metric, per)
                argv = [sys.executable, str(pathlib.Path(__file__).parent / "nbd_qd.py"),
                        "--port", str(nbd.port), "--runtime", runtime, "--ramp", ramp,
                        *nbd_flags]
                self.lib_cmds[f"libnbd {key}"] = systems.shell(argv)
                out, per = self.run_json(argv, nbd.server_pid)
                self._lib(key, "libnbd", out["bw_bytes"] if metric == "bw" else out["iops"],
                          metric, per)

    def _lib(self, key: str, side: str, value: float, metric: str,
             per: dict[str, float]) -> None:
        self.lib.setdefault(key, {}).setdefault(side, []).append(value)
        self.lib_cpu.setdefault(key, {}).setdefault(side, []).append(per)
        self.load.append(report.loadavg())
        say(f"  {key:<26}{side:<26}{report.fmt(metric, value):>12}  CPU us/IO "
            + " ".join(f"{k} {v:.1f}" for k, v in per.items()))

    def run_json(self, argv: list[str], server_pid: int | None,
                 env: dict[str, str] | None = None) -> tuple[dict, dict[str, float]]:
        """Run a library-level load (blockfabric bench or nbd_qd.py, the host); its JSON and
        the server's and its own CPU us per I/O over the span it counted."""
        out, span, ios = cpu.run_counted(argv, {"server": server_pid}, self.args.runtime,
                                         env)
        return out, span.us_per_io(ios)


def say(text: str) -> None:
    print(text, flush=True)


def markdown(r: Runner, order: list[systems.System], started: str, elapsed: float,
             png: str) -> str:
    a = r.args
    labels = {s.key: s.label for s in order}
    m = report.machine()
    load = r.load
    out = [f"# blockfabric vs its peers, {started}",
           "",
           f"`python benchmarks/compare {' '.join(a.argv)}` ({elapsed / 60:.1f} min). fio "
           f"--direct=1 on a {systems.VOLUME >> 20} MiB volume over loopback, {a.rounds} "
           f"interleaved rounds, {a.runtime_text} per job after {a.ramp_text} ramp. Values are "
           "medians with (min-max) over the rounds.",
           "",
           busy_note(load, int(m["cores"])),
           "",
           a.floor_note,
           "",
           f"- machine: {m['cores']} cores, {m['cpu']}, {m['memory']} RAM, Linux {m['kernel']}",
           f"- load average (1 min) during the run: min {min(load):.2f}, median "
           f"{statistics.median(load):.2f}, max {max(load):.2f} (sampled after every job)",
           steal_line(r),
           f"- {m['fio']}, {m['nbdkit']}, {m['nbdfuse']}, Python {m['python']}",
           "",
           "## fio through the mounts",
           "",
           "| fio job | " + " | ".join(labels.values()) + " |",
           "|---|" + "---|" * len(labels)]
    for job in JOBS:
        cells = [report.spread(r.fio.get(job.key, {}).get(k, []), job.metric) for k in labels]
        out.append(f"| {job.title} | " + " | ".join(cells) + " |")
    out += ["", "randread 4k psync QD1, completion latency p99 (us), median over rounds:", "",
            "| " + " | ".join(labels.values()) + " |", "|" + "---|" * len(labels),
            "| " + " | ".join(f"{statistics.median(r.p99['randread-4k-qd1'][k]):.0f}"
                              if r.p99.get("randread-4k-qd1", {}).get(k) else "-"
                              for k in labels) + " |", ""]
    out += cpu_table(r, labels)
    out += ratios(r, [s for s in order if s.key.startswith("bf-")], labels)
    out += acceptance(r, [s for s in order if s.key.startswith("bf-")])
    out += library(r)
    out += ["", f"![bars per job and system]({png})", "", "## Exact commands", "",
            "Servers and mounts:", "", "```"]
    out += [c for s in order for c in s.commands]
    out += ["```", "", f"Each fio job: `{r.fio_cmd}`, JOBFILE being benchmarks/fio/<job>.fio "
            f"with runtime={a.runtime_text} and ramp_time={a.ramp_text}; FILE is n1 in the "
            "blockfabric and floor mounts, nbd in the nbdfuse mounts, and a 256 MiB file on "
            "the tmpfs.",
            "", "Library level (one round):", "", "```"]
    out += list(r.lib_cmds.values()) + ["```", ""]
    return "\n".join(out)


def steal_line(r: Runner) -> str:
    """How much CPU the hypervisor gave to other guests: what a load average inside this
    machine cannot show, and why a peer's rate can halve from one run to the next."""
    whole = cpu.steal_pct(r.stat0, cpu.cpu_times())
    per = r.steal or [whole]
    return (f"- CPU steal (time the hypervisor gave this machine's CPUs to other guests): "
            f"{whole:.1f} % over the run; per fio job median {statistics.median(per):.1f} %, "
            f"max {max(per):.1f} %")


def busy_note(load: list[float], cores: int) -> str:
    """Say how busy the machine was, since other sessions share it."""
    if statistics.median(load) < 0.5 * cores:
        return ("The machine is shared with other sessions but was fairly quiet during this "
                "run (load average below half the cores).")
    return (f"**The machine is shared and was busy** (median load average "
            f"{statistics.median(load):.1f} on {cores} cores, much of it from this run's own "
            "servers and fio, the rest from other sessions): single numbers move by tens of "
            "percent; compare systems within this file, by ratios of medians.")


def ratios(r: Runner, bfs: list[systems.System], labels: dict[str, str]) -> list[str]:
    peers = [k for k in labels if not k.startswith("bf-")]
    out = ["## Ratios blockfabric / peer (medians), against issue 14's goals", "",
           "| fio job | blockfabric | " + " | ".join(f"/ {labels[p]}" for p in peers) + " |",
           "|---|---|" + "---|" * len(peers)]
    for job in JOBS:
        for bf in bfs:
            cells = []
            for p in peers:
                goal = {"nbd-memory": report.GOALS_VS_MEMORY.get(job.key),
                        "nbd-python": report.GOAL_VS_PYTHON}.get(p)
                got = report.ratio(r.fio.get(job.key, {}).get(bf.key, []),
                                   r.fio.get(job.key, {}).get(p, []))
                cells.append(report.verdict(got, goal))
            out.append(f"| {job.title} | {bf.label} | " + " | ".join(cells) + " |")
    qd1 = r.p99.get("randread-4k-qd1", {})
    if "nbd-memory" in qd1:
        for bf in bfs:
            if bf.key in qd1:
                a, b = statistics.median(qd1[bf.key]), statistics.median(qd1["nbd-memory"])
                out.append(f"\nQD1 p99 latency, {bf.label}: {a:.0f} us vs nbdfuse's {b:.0f} us:"
                           f" goal (no worse) {'met' if a <= b else 'NOT met'}.")
    return out + [""]


def cpu_table(r: Runner, labels: dict[str, str]) -> list[str]:
    """Per job and system: the rate, clat p50/p99 and CPU us per I/O (target / host / fio,
    and target+host), medians over the rounds."""
    out = ["## CPU per I/O, next to rate and latency (medians)", "",
           "CPU us per I/O: target (server: blockfabric-target, nbdkit, floor_target.py) / host "
           "(the FUSE daemon: blockfabric mount, nbdfuse, floor_host.py) / fio, and t+h = "
           "target+host; from /proc/PID/stat (utime+stime, all threads) sampled every 25 ms "
           "over the span fio counted, divided by fio's I/O count; fio's from its JSON. An I/O "
           "of the 1M jobs is one 1 MiB request.", "",
           "| fio job | system | rate | clat p50 / p99 us | CPU us/IO target / host / fio |",
           "|---|---|---|---|---|"]
    for job in JOBS:
        for k, label in labels.items():
            vals = r.fio.get(job.key, {}).get(k, [])
            if not vals:
                continue
            p50 = statistics.median(r.p50[job.key][k])
            p99 = statistics.median(r.p99[job.key][k])
            out.append(f"| {job.title} | {label} | {report.spread(vals, job.metric)} | "
                       f"{p50:.0f} / {p99:.0f} | {report.cpu_cell(r.cpu[job.key][k])} |")
    return out + [""]


def acceptance(r: Runner, bfs: list[systems.System]) -> list[str]:
    out = ["## Issue 14's acceptance (ratios of medians)", ""]
    for bf in bfs:
        out += [f"{bf.label}:", ""]
        out += [report.verdict_line(text, ok)
                for text, ok in report.acceptance(r.fio, r.p99, r.cpu, bf.key, bf.label)]
        out.append("")
    return out


def library(r: Runner) -> list[str]:
    out = ["## Library level, no FUSE: blockfabric bench vs libnbd Python bindings "
           "(nbdkit memory)", "",
           "| workload | blockfabric bench (thread) | blockfabric bench (poll) | "
           "libnbd (Python) | ratio thread | ratio poll |", "|---|---|---|---|---|---|"]
    for key, title, _bf, _nbd, metric in LIBRARY:
        d = r.lib.get(key, {})
        cells = [report.spread(d.get(s, []), metric) for s in ("bf-thread", "bf-poll", "libnbd")]
        cells += [report.verdict(report.ratio(d.get(s, []), d.get("libnbd", [])), None)
                  for s in ("bf-thread", "bf-poll")]
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    out += ["", "CPU us per I/O there, target / host (the bench process or the libnbd script) "
            "(t+h), medians:", "", "| workload | blockfabric bench (thread) | "
            "blockfabric bench (poll) | libnbd (Python) |", "|---|---|---|---|"]
    for key, title, _bf, _nbd, _metric in LIBRARY:
        d = r.lib_cpu.get(key, {})
        out.append(f"| {title} | " + " | ".join(
            report.cpu_cell(d.get(s, [])).replace(" / -", "", 1)
            for s in ("bf-thread", "bf-poll", "libnbd")) + " |")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtime", type=float, default=5.0, help="seconds per fio job")
    p.add_argument("--ramp", type=float, default=1.0, help="fio ramp_time, seconds")
    p.add_argument("--out", type=pathlib.Path, default=systems.ROOT / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one round, 0.3 s jobs, a 32 MiB volume")
    p.add_argument("--no-install", action="store_true", help="do not apt-get missing peers")
    p.add_argument("--tag", help="added to the results' file names, e.g. baseline")
    p.add_argument("--systems", default=",".join(SYSTEM_KEYS),
                   help=f"comma list of {', '.join(SYSTEM_KEYS)} (default: all); the library "
                        "level runs when thread, poll and nbd-memory are all in")
    p.add_argument("--floor", help="the perf-floor directory (default: "
                                   f"${systems.FLOOR_ENV}, else a shared/perf-floor above the "
                                   "project)")
    a = p.parse_args(argv)
    a.argv = argv
    a.systems = a.systems.split(",")
    for key in a.systems:
        if key not in SYSTEM_KEYS:
            p.error(f"--systems: unknown system {key!r}")
    a.floor_dir = systems.find_floor(a.floor)
    a.floor_note = (f"floor: {a.floor_dir} (the same interpreter as blockfabric)"
                    if a.floor_dir else "floor: skipped (not found)")
    if a.quick:
        a.rounds, a.runtime, a.ramp = 1, 0.3, 0.0
        systems.VOLUME = 32 << 20
    a.runtime_text = f"{int(a.runtime * 1000)}ms"
    a.ramp_text = f"{int(a.ramp * 1000)}ms"
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if not args.no_install:
        systems.install_peers()
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = ("compare-quick" if args.quick else f"{started:%Y-%m-%d}") \
        + (f"-{args.tag}" if args.tag else "")
    with systems.Workspace() as ws:
        say(f"workspace {ws.tmp}: starting the systems")
        say(args.floor_note)
        start = {"thread": lambda: ws.blockfabric("thread"),
                 "poll": lambda: ws.blockfabric("poll"), "nbd-memory": ws.nbd_memory,
                 "nbd-python": ws.nbd_python, "tcp": lambda: ws.blockfabric("tcp"),
                 "poll-w2": lambda: ws.blockfabric("poll-w2")}
        order = [start[key]() for key in SYSTEM_KEYS if key in start and key in args.systems]
        if args.floor_dir and "floor" in args.systems:
            try:
                order.append(ws.floor(args.floor_dir))
            except systems.SetupError as exc:     # a yardstick, not the thing measured
                args.floor_note = ("floor: skipped (did not start: "
                                   f"{' '.join(str(exc).split())})")
                say(args.floor_note)
        if "tmpfs" in args.systems:
            order.append(ws.tmpfs())
        runner = Runner(args, ws)
        runner.fio_rounds(order)
        if {"thread", "poll", "nbd-memory"} <= set(args.systems):
            by_key = {s.key: s for s in order}
            runner.library_rounds([by_key["bf-thread"], by_key["bf-poll"]],
                                  by_key["nbd-memory"])
        elapsed = time.monotonic() - t0
        png = f"{stem}.png"
        labels = {s.key: s.label for s in order}
        report.chart(args.out / png, runner.fio, labels,
                     f"fio --direct=1, {systems.VOLUME >> 20} MiB, loopback, "
                     f"{started:%Y-%m-%d}: median, min-max whiskers (log scale); below, CPU "
                     "us per I/O (medians)", runner.cpu)
        text = markdown(runner, order, f"{started:%Y-%m-%d %H:%M} UTC", elapsed, png)
        (args.out / f"{stem}.md").write_text(text)
        (args.out / f"{stem}.json").write_text(json.dumps(
            {"fio": runner.fio, "p99_us": runner.p99, "p50_us": runner.p50,
             "cpu_us_per_io": runner.cpu, "library": runner.lib,
             "library_cpu_us_per_io": runner.lib_cpu, "load": runner.load,
             "floor": str(args.floor_dir) if args.floor_dir else None,
             "acceptance": {bf.key: [{"goal": t, "pass": ok} for t, ok in report.acceptance(
                 runner.fio, runner.p99, runner.cpu, bf.key, bf.label)]
                 for bf in order if bf.key.startswith("bf-")}}, indent=1))
    say(f"wrote {args.out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so that the workspace stops its processes and unmounts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())

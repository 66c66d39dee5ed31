"""Medians, ratios against the issue's goals, the machine's description, the Markdown results
file and the PNG chart.  Pure functions of the collected numbers, apart from the two writers.
"""

from __future__ import annotations

import os
import pathlib
import platform
import statistics
import subprocess
from dataclasses import dataclass

#: Issue 14's acceptance (issue 7's goals, seq write lowered from 1.5x to 1.2x): fio job ->
#: the least blockfabric / (nbdkit memory + nbdfuse) ratio; at QD1 the p99 latency must also
#: be no worse than nbdfuse's.
GOALS_VS_MEMORY = {"randread-4k-qd16": 1.2, "randwrite-4k-qd16": 1.2, "randread-4k-qd1": 1.0,
                   "seqread-1m": 1.5, "seqwrite-1m": 1.2}
P99_NO_WORSE = "randread-4k-qd1"
#: ... and blockfabric / (nbdkit python plugin + nbdfuse) on every job.
GOAL_VS_PYTHON = 2.0
#: ... and target+host CPU per 4 KiB read <= this times the pure-Python floor's, at QD16 and QD1.
CPU_GOAL_VS_FLOOR = 2.0
CPU_JOBS = ("randread-4k-qd16", "randread-4k-qd1")
#: The parts of a system's CPU per I/O: its server/target, its host (FUSE daemon), fio.
CPU_PARTS = ("server", "host", "fio")


@dataclass(frozen=True)
class Job:
    """A fio job of benchmarks/fio/ and how its result is read."""

    key: str
    title: str
    metric: str   # "bw" (bytes/s) or "iops"


JOBS = (
    Job("seqread-1m", "seq read 1M QD8", "bw"),
    Job("seqwrite-1m", "seq write 1M QD8", "bw"),
    Job("randread-4k-qd16", "randread 4k libaio QD16", "iops"),
    Job("randwrite-4k-qd16", "randwrite 4k libaio QD16", "iops"),
    Job("randread-4k-qd1", "randread 4k psync QD1", "iops"),
    Job("randrw-70-30-4k-qd16", "randrw 70/30 4k QD16", "iops"),
    Job("randread-4k-psync-16jobs", "randread 4k psync 16 jobs", "iops"),
)


def fmt(job_metric: str, value: float) -> str:
    if job_metric == "bw":
        return f"{value / 1e9:.2f} GB/s" if value >= 1e8 else f"{value / 1e6:.0f} MB/s"
    return f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def spread(values: list[float], metric: str) -> str:
    """'median (min-max)' in the metric's unit."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt(metric, med)
    return f"{fmt(metric, med)} ({fmt(metric, min(values))}-{fmt(metric, max(values))})"


def ratio(a: list[float], b: list[float]) -> float | None:
    if not a or not b or statistics.median(b) == 0:
        return None
    return statistics.median(a) / statistics.median(b)


def verdict(r: float | None, goal: float | None) -> str:
    if r is None:
        return "-"
    text = f"{r:.2f}x"
    if goal is not None:
        text += f" ({'met' if r >= goal else 'NOT met'}, goal {goal:g}x)"
    return text


def cpu_median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Medians over rounds of each part's CPU us per I/O, and of target+host
    ("server+host", summed within each round)."""
    out = {k: statistics.median(r[k] for r in runs) for k in CPU_PARTS
           if runs and all(k in r for r in runs)}
    if runs:
        out["server+host"] = statistics.median(r.get("server", 0.0) + r.get("host", 0.0)
                                               for r in runs)
    return out


def cpu_cell(runs: list[dict[str, float]]) -> str:
    """'target / host / fio = target+host' us per I/O (medians), '-' for a missing part."""
    if not runs:
        return "-"
    m = cpu_median(runs)
    parts = " / ".join(f"{m[k]:.1f}" if k in m else "-" for k in CPU_PARTS)
    if "server" not in m and "host" not in m:     # tmpfs: no server, no FUSE daemon
        return parts
    return f"{parts} (t+h {m['server+host']:.1f})"


def acceptance(fio: dict[str, dict[str, list[float]]], p99: dict[str, dict[str, list[float]]],
               cpu: dict[str, dict[str, list[dict[str, float]]]], bf: str, bf_label: str
               ) -> list[tuple[str, bool | None]]:
    """Issue 14's acceptance for the blockfabric system ``bf``: (line, passed) per goal,
    passed None where a number is missing.  Ratios are of medians over the rounds."""
    out: list[tuple[str, bool | None]] = []
    titles = {j.key: j.title for j in JOBS}

    def line(what: str, got: float | None, goal: float, extra: str = "",
             ok: bool | None = None, least: bool = True) -> None:
        if got is None:
            out.append((f"{what}: not measured", None))
            return
        if ok is None:
            ok = got >= goal if least else got <= goal
        out.append((f"{what} = {got:.2f}x (goal {'>=' if least else '<='} {goal:g}x){extra}",
                    ok))

    for key, goal in GOALS_VS_MEMORY.items():
        got = ratio(fio.get(key, {}).get(bf, []), fio.get(key, {}).get("nbd-memory", []))
        extra, ok = "", None
        if key == P99_NO_WORSE and got is not None:
            a, b = p99.get(key, {}).get(bf), p99.get(key, {}).get("nbd-memory")
            if a and b:
                pa, pb = statistics.median(a), statistics.median(b)
                extra = f", p99 {pa:.0f} us vs {pb:.0f} us (goal: no worse)"
                ok = got >= goal and pa <= pb
        line(f"{titles[key]}: {bf_label} / nbdkit memory + nbdfuse", got, goal, extra, ok)
    for job in JOBS:
        got = ratio(fio.get(job.key, {}).get(bf, []), fio.get(job.key, {}).get("nbd-python", []))
        line(f"{job.title}: {bf_label} / nbdkit python + nbdfuse", got, GOAL_VS_PYTHON)
    for key in CPU_JOBS:
        mine, floor = cpu.get(key, {}).get(bf), cpu.get(key, {}).get("floor")
        if not floor:
            out.append((f"{titles[key]}: CPU target+host, {bf_label} / floor: floor not "
                        "measured", None))
            continue
        a, b = cpu_median(mine or [])["server+host"] if mine else None, \
            cpu_median(floor)["server+host"]
        line(f"{titles[key]}: CPU target+host per I/O, {bf_label} "
             + (f"{a:.1f} us / floor {b:.1f} us" if a is not None else "/ floor"),
             a / b if a is not None and b > 0 else None, CPU_GOAL_VS_FLOOR, least=False)
    return out


def verdict_line(text: str, ok: bool | None) -> str:
    return f"- {text}: **{'PASS' if ok else 'FAIL'}**" if ok is not None else f"- {text}"


def machine() -> dict[str, str]:
    model = "unknown"
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo", encoding="ascii") as f:
        mem_kib = int(f.readline().split()[1])
    return {"cores": str(os.cpu_count()), "cpu": model, "kernel": platform.release(),
            "memory": f"{mem_kib / (1 << 20):.1f} GiB", "python": platform.python_version(),
            "fio": _version(["fio", "--version"]), "nbdkit": _version(["nbdkit", "--version"]),
            "nbdfuse": _version(["nbdfuse", "--version"]).splitlines()[0]}


def _version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10,
                              stdin=subprocess.DEVNULL).stdout.strip() or "?"
    except OSError:
        return "not installed"


def loadavg() -> float:
    with open("/proc/loadavg", encoding="ascii") as f:
        return float(f.read().split()[0])


def chart(path: pathlib.Path, results: dict[str, dict[str, list[float]]],
          labels: dict[str, str], title: str,
          cpu: dict[str, dict[str, list[dict[str, float]]]] | None = None) -> None:
    """One panel per job, one bar per system (median), whiskers from min to max; with
    ``cpu``, below them one panel per job of CPU us per I/O per system, stacked target /
    host / fio (medians)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(labels)
    cols = 4
    rows = -(-len(JOBS) // cols)
    total = rows * (2 if cpu else 1)
    fig, axes = plt.subplots(total, cols, figsize=(4.2 * cols, 3.6 * total))
    colours = plt.get_cmap("tab10").colors
    if cpu:
        for ax, job in zip(list(axes.flat)[rows * cols:], JOBS):
            meds = [cpu_median(cpu.get(job.key, {}).get(k, [])) for k in systems]
            bottom = [0.0] * len(systems)
            for i, part in enumerate(CPU_PARTS):
                vals = [m.get(part, 0.0) for m in meds]
                ax.bar(range(len(systems)), vals, bottom=bottom, color=colours[i],
                       label={"server": "target/server", "host": "host (FUSE daemon)",
                              "fio": "fio"}[part])
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"{job.title}: CPU per I/O", fontsize=9)
            ax.set_ylabel("us per I/O", fontsize=8)
            ax.set_xticks(range(len(systems)))
            ax.set_xticklabels([labels[k] for k in systems], rotation=35, ha="right",
                               fontsize=7)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[rows * cols + len(JOBS):]:
            ax.axis("off")
    for ax, job in zip(axes.flat, JOBS):
        meds, lo, hi = [], [], []
        for key in systems:
            vals = results.get(job.key, {}).get(key, []) or [0.0]
            scale = 1e9 if job.metric == "bw" else 1e3
            med = statistics.median(vals) / scale
            meds.append(med)
            lo.append(med - min(vals) / scale)
            hi.append(max(vals) / scale - med)
        ax.bar(range(len(systems)), meds, yerr=[lo, hi], capsize=3,
               color=[colours[i % 10] for i in range(len(systems))])
        ax.set_title(job.title, fontsize=9)
        ax.set_ylabel("GB/s" if job.metric == "bw" else "kIOPS", fontsize=8)
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels([labels[k] for k in systems], rotation=35, ha="right", fontsize=7)
        ax.set_yscale("log")
    for ax in list(axes.flat)[len(JOBS):rows * cols]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

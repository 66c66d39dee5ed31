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

#: Issue 7's goals: (job key, peer key) -> the least blockfabric/peer ratio.
GOALS_VS_MEMORY = {"seqread-1m": 1.5, "seqwrite-1m": 1.5, "randread-4k-qd16": 1.2,
                   "randwrite-4k-qd16": 1.2, "randread-4k-qd1": 1.0}
GOAL_VS_PYTHON = 2.0


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
          labels: dict[str, str], title: str) -> None:
    """One panel per job, one bar per system (median), whiskers from min to max."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(labels)
    cols = 4
    rows = -(-len(JOBS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows))
    colours = plt.get_cmap("tab10").colors
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
    for ax in list(axes.flat)[len(JOBS):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

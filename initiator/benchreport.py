"""``blockfabric bench``'s results: per-direction statistics, fio's JSON and fio's text.

A job keeps every latency (two array appends per I/O); the summaries, exact percentiles,
the fio-compatible JSON document (one report per job, or one for all with
--group_reporting), the once-a-second eta line and the fio-like text are all made here,
after the run or off the completion path.
"""

from __future__ import annotations

import array
import math
import operator
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from blockfabric import __version__

if TYPE_CHECKING:
    from blockfabric.initiator.benchopts import BenchOptions

#: fio's default clat percentile list.
PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0,
               99.5, 99.9, 99.95, 99.99)


class LatStat:
    """min/max/mean/stddev of latencies in ns (fio's slat/clat/lat), from the values kept."""

    __slots__ = ("n", "min", "max", "sum", "sumsq")

    def __init__(self, values: Iterable[int] = ()) -> None:
        self.n = self.min = self.max = self.sum = self.sumsq = 0
        for ns in values:
            if self.n == 0 or ns < self.min:
                self.min = ns
            if ns > self.max:
                self.max = ns
            self.n += 1
            self.sum += ns
            self.sumsq += ns * ns

    def as_fio(self) -> dict[str, Any]:
        mean = self.sum / self.n if self.n else 0.0
        var = self.sumsq / self.n - mean * mean if self.n > 1 else 0.0
        return {"min": self.min, "max": self.max, "mean": mean,
                "stddev": math.sqrt(max(0.0, var)), "N": self.n}


class DirStats:
    """One direction (read or write) of one job.  Every slat and clat is kept (two array
    appends per I/O, nothing else on the completion path); the summaries and exact
    percentiles are worked out when the report is made."""

    __slots__ = ("ios", "bytes", "slats", "clats")

    def __init__(self) -> None:
        self.ios = self.bytes = 0
        self.slats = array.array("Q")
        self.clats = array.array("Q")

    def record(self, nbytes: int, slat: int, clat: int) -> None:
        self.ios += 1
        self.bytes += nbytes
        self.slats.append(slat)
        self.clats.append(clat)

    @classmethod
    def merge(cls, parts: list[DirStats]) -> DirStats:
        out = cls()
        for p in parts:
            out.ios += p.ios
            out.bytes += p.bytes
            out.slats.extend(p.slats)
            out.clats.extend(p.clats)
        return out

    def percentiles(self) -> dict[str, int]:
        """fio's keys ("99.900000"), nearest-rank values over every completion."""
        ordered = sorted(self.clats)
        if not ordered:
            return {f"{p:.6f}": 0 for p in PERCENTILES}
        n = len(ordered)
        rank = {p: math.ceil(round(p * n / 100, 9)) for p in PERCENTILES}  # 1-based
        return {f"{p:.6f}": ordered[min(n, max(1, r)) - 1] for p, r in rank.items()}

    def as_fio(self, runtime_ns: int) -> dict[str, Any]:
        secs = runtime_ns / 1e9 if runtime_ns > 0 else 0.0
        bw_bytes = int(self.bytes / secs) if secs else 0
        clat = LatStat(self.clats).as_fio()
        clat["percentile"] = self.percentiles()
        return {"io_bytes": self.bytes, "io_kbytes": self.bytes >> 10, "bw_bytes": bw_bytes,
                "bw": bw_bytes >> 10, "iops": self.ios / secs if secs else 0.0,
                "runtime": int(runtime_ns / 1e6) if self.ios else 0,
                "total_ios": self.ios, "short_ios": 0, "drop_ios": 0,
                "slat_ns": LatStat(self.slats).as_fio(), "clat_ns": clat,
                "lat_ns": LatStat(map(operator.add, self.slats, self.clats)).as_fio()}


@dataclass
class JobResult:
    """What the report needs of a finished job: plain data, so that a job run in another
    process (benchjobs.py) sends it back whole, latencies included."""

    index: int
    pid: int
    stats: dict[str, DirStats]
    runtime_ns: int
    error_kind: int
    errors: list[str]
    max_inflight: int
    verified: int
    held: int
    queues: set[int]
    #: qid -> the most commands that queue carried at once (the controller's count)
    queue_max_inflight: dict[int, int]
    cpu: tuple[float, float]            # user, system seconds of the job's process
    #: wall-clock (time.time()) start and end of the counted run, to line CPU samples
    #: up with it (benchmarks/numjobs.py)
    window: tuple[float, float] = (0.0, 0.0)


def job_report(opts: BenchOptions, jobs: list[JobResult], name: str) -> dict[str, Any]:
    """fio's per-job JSON for ``jobs`` merged (one job, or all with group_reporting)."""
    runtime = max((j.runtime_ns for j in jobs), default=0)
    report: dict[str, Any] = {
        "jobname": name, "groupid": 0,
        "error": next((j.error_kind for j in jobs if j.error_kind), 0),
        "eta": 0, "elapsed": round(runtime / 1e9),
        "job options": job_options(opts),
        "job_runtime": int(runtime / 1e6),
    }
    for direction in ("read", "write"):
        report[direction] = DirStats.merge([j.stats[direction] for j in jobs]
                                           ).as_fio(runtime)
    report["trim"] = DirStats().as_fio(0)
    # the controllers' own counts (none left once a controller failed)
    used = [m for j in jobs for m in j.queue_max_inflight.values()]
    cpu = {j.pid: j.cpu for j in jobs}          # each process once
    wall = runtime / 1e9 or 1.0
    report["usr_cpu"] = 100.0 * sum(c[0] for c in cpu.values()) / wall
    report["sys_cpu"] = 100.0 * sum(c[1] for c in cpu.values()) / wall
    report["blockfabric"] = {
        "max_inflight": max(j.max_inflight for j in jobs),
        "queue_max_inflight": max(used, default=0),
        "queues": sorted({q for j in jobs for q in j.queues}),
        "verified_blocks": sum(j.verified for j in jobs),
        "held": sum(j.held for j in jobs),
        "errors": [e for j in jobs for e in j.errors][:10],
        "pids": sorted(cpu),
        "jobs": len(jobs),
        "window": [min(j.window[0] for j in jobs), max(j.window[1] for j in jobs)],
    }
    return report


def job_options(o: BenchOptions) -> dict[str, str]:
    out = {"rw": o.rw, "bs": str(o.bs), "iodepth": str(o.iodepth),
           "numjobs": str(o.numjobs), "offset": str(o.offset),
           "runtime": str(o.runtime), "rwmixread": str(o.rwmixread),
           "randseed": str(o.seed)}
    if o.size is not None:
        out["size"] = str(o.size)
    if o.time_based:
        out["time_based"] = "1"
    if o.ramp_time:
        out["ramp_time"] = str(o.ramp_time)
    if o.verify:
        out["verify"] = o.verify
    if o.thread:
        out["thread"] = "1"
    return out


def make_result(opts: BenchOptions, connect_opts: Any, results: list[JobResult],
                extra: dict[str, Any]) -> dict[str, Any]:
    """fio's JSON document: one report per job, or one for all with group_reporting;
    ``extra`` is the "blockfabric" section (controllers, paths, recovery)."""
    now = time.time()
    if opts.group_reporting:
        jobs = [job_report(opts, results, opts.jobname)]
    else:
        jobs = [job_report(opts, [r], opts.jobname) for r in results]
    return {
        "fio version": f"blockfabric-bench-{__version__}",
        "timestamp": int(now), "timestamp_ms": int(now * 1000),
        "time": time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)),
        "global options": {"traddr": connect_opts.traddr,
                           "trsvcid": str(connect_opts.trsvcid),
                           "subnqn": connect_opts.subnqn},
        "jobs": jobs,
        "disk_util": [],
        "blockfabric": extra,
    }


class Progress:
    """fio's eta line: once a second, elapsed time, IOPS and MB/s since the last line."""

    def __init__(self, totals: Callable[[], tuple[int, int, int, int]], opts: BenchOptions,
                 out, mode: str) -> None:
        self.totals = totals
        self.opts = opts
        self.out = out
        tty = hasattr(out, "isatty") and out.isatty()
        self.enabled = mode == "always" or (mode == "auto" and tty)
        self.tty = tty
        self.last_t = 0.0
        self.last = (0, 0, 0, 0)
        self.printed = False

    def tick(self, elapsed: float) -> None:
        if not self.enabled or elapsed - self.last_t < 1.0:
            return
        totals = self.totals()
        dt = elapsed - self.last_t
        d = [max(0, a - b) for a, b in zip(totals, self.last)]
        self.last, self.last_t = totals, elapsed
        opts = self.opts
        limit = opts.ramp_time + opts.runtime
        parts = [f"[{elapsed:4.0f}s/{limit:.0f}s]"]
        for label, ios, nbytes in (("r", d[0], d[1]), ("w", d[2], d[3])):
            if ios or (label == "r") != (opts.rw in ("write", "randwrite")):
                parts.append(f"{label}: {fio_num(ios / dt)} IOPS "
                             f"{nbytes / dt / 1e6:.1f} MB/s")
        line = " ".join(parts)
        self.out.write(("\r" + line + "  ") if self.tty else line + "\n")
        self.out.flush()
        self.printed = True

    def close(self) -> None:
        if self.enabled and self.tty and self.printed:
            self.out.write("\n")
            self.out.flush()


# --------------------------------------------------------------------------- fio-like text

def fio_num(value: float) -> str:
    """fio's short numbers: 950, 12.3k, 1234k -> 1.23M."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            v = value / factor
            return f"{v:.3g}{suffix}" if v < 1000 else f"{v:.0f}{suffix}"
    return f"{value:.0f}"


def _bw_text(bw_bytes: float) -> str:
    """fio's "BW=48.0MiB/s (50.3MB/s)"."""
    for factor, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if bw_bytes >= factor:
            binary = f"{bw_bytes / factor:.3g}{unit}/s"
            break
    else:
        binary = f"{bw_bytes:.0f}B/s"
    for decimal, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if bw_bytes >= decimal:
            return f"{binary} ({bw_bytes / decimal:.3g}{unit}/s)"
    return f"{binary} ({bw_bytes:.0f}B/s)"


def _lat_unit(ns: float) -> tuple[str, float]:
    if ns >= 10_000_000:
        return "msec", 1e6
    if ns >= 10_000:
        return "usec", 1e3
    return "nsec", 1.0


def format_text(result: dict[str, Any]) -> str:
    """A summary laid out like fio's normal output."""
    lines = []
    for job in result["jobs"]:
        pids = job["blockfabric"]["pids"]
        lines.append(f"{job['jobname']}: (groupid=0, jobs={job['blockfabric']['jobs']}): "
                     f"err={job['error']:2d}: pid={','.join(map(str, pids))}: {result['time']}")
        for direction in ("read", "write"):
            d = job[direction]
            if not d["total_ios"]:
                continue
            clat = d["clat_ns"]
            unit, div = _lat_unit(clat["mean"])
            size = d["io_bytes"]
            lines.append(f"  {direction}: IOPS={fio_num(d['iops'])}, "
                         f"BW={_bw_text(d['bw_bytes'])}({_io_text(size)}/{d['runtime']}msec)")
            lines.append(f"    clat ({unit}): min={clat['min'] / div:.0f}, "
                         f"max={clat['max'] / div:.0f}, avg={clat['mean'] / div:.2f}, "
                         f"stdev={clat['stddev'] / div:.2f}")
            lines.append(f"     clat percentiles ({unit}):")
            cells = [f"{float(k):6.2f}th=[{v / div:.0f}]"
                     for k, v in clat["percentile"].items()]
            for i in range(0, len(cells), 4):
                lines.append("     | " + ", ".join(cells[i:i + 4]) + ",")
            lines[-1] = lines[-1].rstrip(",")
        bf = job["blockfabric"]
        verified = f", verified {bf['verified_blocks']} block(s)" if bf["verified_blocks"] \
            else ""
        lines.append(f"  blockfabric: I/O queue(s) {bf['queues']}, max in flight "
                     f"{bf['max_inflight']} (job) / {bf['queue_max_inflight']} (one queue)"
                     f"{verified}")
    for i, rec in enumerate(result["blockfabric"]["recovery"]):
        if rec["losses"]:
            lines.append(f"  blockfabric: controller {i}: {rec['losses']} connection loss(es), "
                         f"{rec['reconnects']} reconnect(s) ({rec['failovers']} to another "
                         f"path), {rec['retried']} command(s) re-issued, {rec['failed']} "
                         f"failed; on {rec['path']}")
    lines.append("")
    lines.append("Run status group 0 (all jobs):")
    for direction in ("read", "write"):
        total = sum(j[direction]["io_bytes"] for j in result["jobs"])
        if not total:
            continue
        run_ms = max(j[direction]["runtime"] for j in result["jobs"]) or 1
        lines.append(f"  {direction.upper():>5}: bw={_bw_text(total / run_ms * 1000)}, "
                     f"io={_io_text(total)}, run={run_ms}msec")
    return "\n".join(lines)


def _io_text(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g}{unit}"
    return f"{n}B"

"""CPU time of processes from /proc/<pid>/stat (utime + stime, all threads), and py-spy.

Costs are measured over the counted run a load reports (fio's and bench's end time and
job_runtime, so that start-up, ramp and teardown do not count): a :class:`Sampler` follows the
pids meanwhile, and µs per I/O = CPU seconds in that span / the I/Os counted in it.  (The older
:class:`Window` takes a fixed window in the middle of a run instead.)
"""

from __future__ import annotations

import collections
import json
import os
import re
import pathlib
import shutil
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")


def _threads_ns(pid: int) -> int:
    """CPU time of ``pid``'s live threads in nanoseconds (/proc/PID/task/*/schedstat)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def _precise(ticks_seconds: float, pid: int) -> float:
    """utime + stime counts whole clock ticks (10 ms), too coarse for a short run of a
    quiet process; schedstat has nanoseconds but only for the threads still alive.  The
    larger of the two (each falls short in its own way)."""
    return max(ticks_seconds, _threads_ns(pid) / 1e9)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far, in seconds (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields 14 and 15 of proc(5)
    return _precise((int(fields[11]) + int(fields[12])) / TICK, pid)


def _all_cpus() -> list[int]:
    """The jiffies of /proc/stat's first line (all CPUs): user nice system idle iowait irq
    softirq steal, then guest and guest_nice (counted inside user and nice)."""
    with open("/proc/stat", encoding="ascii") as f:
        return [int(v) for v in f.readline().split()[1:]]


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    vals = _all_cpus()
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def cpu_times() -> tuple[int, int]:
    """(all, steal): the machine's CPU time in jiffies, and the part of it the hypervisor
    gave to other guests (a virtual machine's hidden neighbours)."""
    vals = _all_cpus()
    return sum(vals[:8]), (vals[7] if len(vals) > 7 else 0)


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Percent of the CPU time between two cpu_times() readings that was stolen."""
    total = after[0] - before[0]
    return 100.0 * (after[1] - before[1]) / total if total > 0 else 0.0


class Window:
    """CPU seconds of some pids, and of the whole machine, between :meth:`start` and
    :meth:`stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {k: v for k, v in pids.items() if v}
        self.cpu: dict[str, float] = {}
        self.seconds = 0.0
        self.machine = 0.0   # fraction of all CPUs busy

    def start(self) -> None:
        self._t = time.monotonic()
        self._cpu = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self._busy = machine_busy()

    def stop(self) -> None:
        self.seconds = time.monotonic() - self._t
        self.cpu = {k: cpu_seconds(p) - self._cpu[k] for k, p in self.pids.items()}
        busy, total = machine_busy()
        self.machine = (busy - self._busy[0]) / max(1, total - self._busy[1])

    def us_per_io(self, iops: float) -> dict[str, float]:
        return {k: 1e6 * c / (iops * self.seconds) for k, c in self.cpu.items()}

    def share(self) -> dict[str, float]:
        """Each pid's CPU as a fraction of one core."""
        return {k: c / self.seconds for k, c in self.cpu.items()}


class Sampler:
    """CPU seconds of some pids and the machine's busy share, sampled on a thread every
    ``interval`` s with wall-clock (time.time()) stamps, so that the CPU spent between two
    instants a load reports afterwards (fio's and bench's ``timestamp_ms`` minus
    ``job_runtime``: exactly the counted run, ramp and start-up excluded) can be read off by
    linear interpolation.  ``with Sampler(pids):`` samples for the block's duration."""

    def __init__(self, pids: dict[str, int | None], interval: float = 0.025) -> None:
        self.pids = {k: v for k, v in pids.items() if v}
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float | None], tuple[float, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        self.samples.append((time.time(), {k: _cpu_or_none(p) for k, p in self.pids.items()},
                             machine_busy()))

    def span(self, t0: float, t1: float) -> Span:
        """CPU seconds of each pid between wall-clock instants t0 and t1 (clamped to the
        samples taken; a pid's samples after it ended are ignored)."""
        cpu = {}
        for k in self.pids:
            pts = [(t, v[k]) for t, v, _ in self.samples if v[k] is not None]
            cpu[k] = _interp(pts, t1) - _interp(pts, t0) if pts else 0.0
        busy = [(t, m[0]) for t, _, m in self.samples]
        total = [(t, m[1]) for t, _, m in self.samples]
        whole = _interp(total, t1) - _interp(total, t0)
        machine = (_interp(busy, t1) - _interp(busy, t0)) / whole if whole > 0 else 0.0
        return Span(cpu, max(1e-9, t1 - t0), machine)


class Span:
    """What :meth:`Sampler.span` found: CPU seconds per pid over ``seconds``, and the share
    of all CPUs that were busy."""

    def __init__(self, cpu: dict[str, float], seconds: float, machine: float) -> None:
        self.cpu, self.seconds, self.machine = cpu, seconds, machine

    def us_per_io(self, ios: float) -> dict[str, float]:
        return {k: 1e6 * c / max(1.0, ios) for k, c in self.cpu.items()}

    def share(self) -> dict[str, float]:
        """Each pid's CPU as a fraction of one core."""
        return {k: c / self.seconds for k, c in self.cpu.items()}


def counted_span(out: dict, runtime: float | None = None) -> tuple[float, float, float]:
    """(start, end, I/Os) of the counted run that fio's (or blockfabric bench's) JSON
    ``out`` reports: it ends at ``timestamp_ms`` and lasted ``job_runtime`` ms, or at most
    ``runtime`` s (with group_reporting, fio adds up its jobs' runtimes)."""
    job = out["jobs"][0]
    end = out["timestamp_ms"] / 1e3
    seconds = job["job_runtime"] / 1e3
    if runtime is not None:
        seconds = min(seconds, runtime)
    return end - seconds, end, job["read"]["total_ios"] + job["write"]["total_ios"]


def run_counted(argv: list[str], pids: dict[str, int | None], runtime: float | None = None,
                env: dict[str, str] | None = None, timeout: float = 300.0
                ) -> tuple[dict, Span, float]:
    """Run the load ``argv`` (fio, blockfabric bench or nbd_qd.py: JSON on stdout) while a
    :class:`Sampler` follows ``pids`` and the load itself (as "host"; not fio, which forks its
    job: its CPU comes from its JSON); returns its JSON, the CPU over exactly the counted run
    it reports (start-up, ramp and teardown excluded) and the I/Os counted in that run."""
    [data], span, ios = run_together([argv], pids, runtime, env, timeout)
    return data, span, ios


def run_together(argvs: list[list[str]], pids: dict[str, int | None],
                 runtime: float | None = None, env: dict[str, str] | None = None,
                 timeout: float = 300.0) -> tuple[list[dict], Span, float]:
    """:func:`run_counted` for several loads started at once (each followed as "host0",
    "host1", ...; one alone as "host"): their JSONs, the CPU over the span in which all of
    them counted (the latest start to the earliest end) and the I/Os counted in that span
    (each load's share of its own counted run, pro rata)."""
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
             for a in argvs]
    names = ["host"] if len(procs) == 1 else [f"host{i}" for i in range(len(procs))]
    own = {n: p.pid for n, p, a in zip(names, procs, argvs) if a[0] != "fio"}
    deadline = time.monotonic() + timeout
    try:
        with Sampler({**pids, **own}) as sampler:
            outs = [p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                    for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    datas, runs = [], []
    for a, p, (out, err) in zip(argvs, procs, outs):
        if p.returncode != 0:
            from systems import SetupError  # noqa: PLC0415  (systems starts what is measured)
            raise SetupError(f"{' '.join(a)} failed: {err}")
        data = json.loads(out[out.index("{"):])
        if "jobs" in data:
            runs.append(counted_span(data, runtime))
        else:                               # nbd_qd.py
            t1 = data["timestamp_ms"] / 1e3
            runs.append((t1 - data["seconds"], t1, data["ios"]))
        datas.append(data)
    t0, t1 = max(r[0] for r in runs), min(r[1] for r in runs)
    if t1 <= t0:
        from systems import SetupError  # noqa: PLC0415
        raise SetupError(f"{len(argvs)} loads did not count at the same time: {runs}")
    ios = sum(n * ((t1 - t0) / (b - a)) for a, b, n in runs)
    return datas, sampler.span(t0, t1), ios


def _cpu_or_none(pid: int) -> float | None:
    """utime + stime of ``pid`` and of its living children (a target's poll-group workers:
    the server is the process tree), None once ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":       # exited, not yet reaped: its times are final but unreliable
        return None
    return _precise((int(fields[11]) + int(fields[12])) / TICK, pid) + sum(
        cpu_seconds(child) for child in children(pid))


def children(pid: int) -> list[int]:
    """The living children of ``pid`` (from every thread's ``children`` list)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _interp(pts: list[tuple[float, float]], t: float) -> float:
    """The value at ``t`` on the piecewise-linear curve through ``pts`` (sorted by time),
    held flat beyond its ends."""
    if t <= pts[0][0]:
        return pts[0][1]
    for (ta, va), (tb, vb) in zip(pts, pts[1:]):
        if t <= tb:
            return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else vb
    return pts[-1][1]


def py_spy() -> str:
    found = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    if not os.path.exists(found):
        raise RuntimeError("py-spy is missing: pip install py-spy")
    return found


def record(pid: int, out: pathlib.Path, seconds: float, fmt: str, gil: bool = False
           ) -> subprocess.Popen:
    """Start py-spy sampling ``pid`` (all threads, or with ``gil`` only the thread holding
    the GIL; not pausing it) into ``out``."""
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration",
                             str(int(seconds)), "--rate", "250", "--nonblocking",
                             "--format", fmt, "--output", str(out), *(["--gil"] if gil else [])],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def hot_spots(raw: pathlib.Path, top: int = 5) -> list[tuple[str, float]]:
    """The functions (all their lines together) where most samples ended (self time), from
    py-spy's collapsed stacks,
    as (frame, share of samples); first ("samples", total)."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():   # a frame name broken over lines
            continue
        n = int(count)
        leaves[re.sub(r":\d+\)$", ")", stack.split(";")[-1])] += n   # by function
        total += n
    return [("samples", float(total))] + [(frame, n / total)
                                          for frame, n in leaves.most_common(top)]

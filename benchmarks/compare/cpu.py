"""CPU time of processes from /proc/<pid>/stat (utime + stime, all threads), and py-spy.

Costs are measured over a window in the middle of a fixed run, so that start-up (imports,
connect) and teardown do not count: µs per I/O = CPU seconds in the window / (IOPS * window).
"""

from __future__ import annotations

import collections
import os
import re
import pathlib
import shutil
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far, in seconds (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK   # fields 14 and 15 of proc(5)


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


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

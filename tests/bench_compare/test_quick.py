"""``python benchmarks/compare --quick``: every system, job and ratio is reported, a PNG is
drawn, and nothing (mount, process, temp dir) is left behind.  No assertions on speed."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))

import report  # noqa: E402
import systems  # noqa: E402
from demo import processes_naming  # noqa: E402  (systems puts scripts/ on the path)

FLOOR = systems.find_floor()
FLOOR_LABEL = "floor (pure Python)"
SYSTEM_LABELS = ("blockfabric (thread)", "blockfabric (poll)", "nbdkit memory + nbdfuse",
                 "blockfabric (NVMe/TCP)", "blockfabric (poll), 2 FUSE workers",
                 "nbdkit python + nbdfuse", "tmpfs file") + ((FLOOR_LABEL,) if FLOOR else ())


def _why_not() -> str | None:
    if os.getuid() != 0:
        return "needs root (tmpfs mount, FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    missing = systems.missing_packages()
    if missing:
        return f"missing Debian packages: {' '.join(missing)}"
    return None


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("quick")
    work, out = tmp / "work", tmp / "out"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "compare"), "--quick",
                             "--no-install", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL,
                            env=dict(os.environ, TMPDIR=str(work), PYTHONUNBUFFERED="1"))
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # SIGTERM first: compare then unmounts and stops what it started (a SIGKILL, as
        # subprocess.run's timeout sends, left its mounts and targets behind)
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), work, out


def test_quick_run_reports_every_system_and_job(quick):
    done, _work, out = quick
    assert done.returncode == 0, done.stdout + done.stderr
    text = (out / "compare-quick.md").read_text()
    for label in SYSTEM_LABELS:
        assert label in text
    for job in report.JOBS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {job.title} |"))
        # a cell per system, none empty
        assert "-" not in [c.strip() for c in row.split("|")[2:-1]], row
    assert re.search(r"load average \(1 min\) during the run: min \d", text)
    assert re.search(r"CPU steal .*: \d+\.\d % over the run; per fio job median \d+\.\d %, "
                     r"max \d+\.\d %", text)
    assert "nbdfuse -P" in text and "blockfabric mount -a 127.0.0.1" in text
    numbers = json.loads((out / "compare-quick.json").read_text())
    for job in report.JOBS:
        assert len(numbers["fio"][job.key]) == len(SYSTEM_LABELS)
        assert all(v[0] > 0 for v in numbers["fio"][job.key].values()), job.key
    for side in numbers["library"].values():
        assert all(v[0] > 0 for v in side.values())
    assert (out / "compare-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_reports_cpu_per_io_for_every_system(quick):
    done, _work, out = quick
    assert done.returncode == 0, done.stdout + done.stderr
    numbers = json.loads((out / "compare-quick.json").read_text())
    for job in report.JOBS:
        per_system = numbers["cpu_us_per_io"][job.key]
        assert len(per_system) == len(SYSTEM_LABELS), job.key
        for key, rounds in per_system.items():
            parts = set(rounds[0])
            assert parts == ({"fio"} if key == "tmpfs" else {"server", "host", "fio"}), key
            assert all(v >= 0 for v in rounds[0].values()), (key, rounds)
    text = (out / "compare-quick.md").read_text()
    assert "## CPU per I/O, next to rate and latency" in text
    assert "## Issue 14's acceptance" in text
    # every goal vs the peers has a verdict (the quick numbers mean nothing)
    verdicts = re.findall(r"blockfabric \(poll\) / nbdkit memory \+ nbdfuse = "
                          r".*\*\*(PASS|FAIL)\*\*", text)
    assert len(verdicts) == len(report.GOALS_VS_MEMORY)


def test_quick_run_measures_the_floor(quick):
    done, _work, out = quick
    if FLOOR is None:
        assert "floor: skipped (not found)" in done.stdout
        pytest.skip("the perf floor is not present (no ../shared/perf-floor above the project "
                    f"and no ${systems.FLOOR_ENV}): compare ran without it, as it should")
    assert done.returncode == 0, done.stdout + done.stderr
    numbers = json.loads((out / "compare-quick.json").read_text())
    assert numbers["floor"] == str(FLOOR)
    for job in report.JOBS:
        assert numbers["fio"][job.key]["floor"][0] > 0, job.key
        cpu = numbers["cpu_us_per_io"][job.key]["floor"][0]
        assert cpu["server"] + cpu["host"] > 0, job.key
    text = (out / "compare-quick.md").read_text()
    for key in report.CPU_JOBS:
        title = next(j.title for j in report.JOBS if j.key == key)
        assert re.search(rf"- {re.escape(title)}: CPU target\+host per I/O, blockfabric "
                         r"\(poll\) [\d.]+ us / floor [\d.]+ us = [\d.]+x \(goal <= 2x\): "
                         r"\*\*(PASS|FAIL)\*\*", text), title


def test_quick_run_leaves_nothing_behind(quick):
    done, work, _out = quick
    match = re.search(r"^workspace (\S+):", done.stdout, re.M)
    assert match, done.stdout
    workspace = match[1]
    with open("/proc/mounts", encoding="utf-8") as f:
        assert workspace not in f.read()
    assert processes_naming(workspace) == []
    assert list(work.iterdir()) == []

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

SYSTEM_LABELS = ("blockfabric (thread)", "blockfabric (poll)", "nbdkit memory + nbdfuse",
                 "nbdkit python + nbdfuse", "tmpfs file")


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
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare"), "--quick",
                           "--no-install", "--out", str(out)],
                          capture_output=True, text=True, timeout=150,
                          stdin=subprocess.DEVNULL,
                          env=dict(os.environ, TMPDIR=str(work), PYTHONUNBUFFERED="1"))
    return done, work, out


def test_quick_run_reports_every_system_and_job(quick):
    done, _work, out = quick
    assert done.returncode == 0, done.stdout + done.stderr
    text = (out / "compare-quick.md").read_text()
    for label in SYSTEM_LABELS:
        assert label in text
    for job in report.JOBS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {job.title} |"))
        assert "-" not in [c.strip() for c in row.split("|")[2:-1]], row   # a cell per system, none empty
    assert re.search(r"load average \(1 min\) during the run: min \d", text)
    assert "nbdfuse -P" in text and "blockfabric mount -a 127.0.0.1" in text
    numbers = json.loads((out / "compare-quick.json").read_text())
    for job in report.JOBS:
        assert len(numbers["fio"][job.key]) == len(SYSTEM_LABELS)
        assert all(v[0] > 0 for v in numbers["fio"][job.key].values()), job.key
    for side in numbers["library"].values():
        assert all(v[0] > 0 for v in side.values())
    assert (out / "compare-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_leaves_nothing_behind(quick):
    done, work, _out = quick
    match = re.search(r"^workspace (\S+):", done.stdout, re.M)
    assert match, done.stdout
    workspace = match[1]
    with open("/proc/mounts", encoding="utf-8") as f:
        assert workspace not in f.read()
    assert processes_naming(workspace) == []
    assert list(work.iterdir()) == []

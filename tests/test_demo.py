"""``make demo`` (scripts/demo.py): prints its table and leaves no mount, process or file."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = [sys.executable, str(ROOT / "scripts" / "demo.py")]


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
    return dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")


def _workspace(out: str) -> pathlib.Path:
    match = re.search(r"^workspace (\S+)$", out, re.M)
    assert match, out
    return pathlib.Path(match[1])


def _assert_nothing_left(workspace: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with open("/proc/mounts", encoding="utf-8") as f:
        assert str(workspace) not in f.read()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().decode()
            except OSError:
                continue
            assert str(workspace) not in cmdline, f"pid {entry} left: {cmdline!r}"
    assert not workspace.exists()
    assert list(tmp_path.iterdir()) == []


def _check_table(out: str, through: str) -> None:
    assert f"results ({through}" in out, out
    for title in ("randread 4k QD16", "randwrite 4k QD16", "seq write 1M + verify"):
        row = next(line for line in out.splitlines() if line.strip().startswith(title))
        iops = float(row[len("  ") + 22:].split()[0])
        assert iops > 0, row
    assert "passed" in out and "cleaned up" in out


@pytest.mark.timeout(90)
def test_demo_runs_prints_its_table_and_cleans_up(tmp_path):
    done = subprocess.run(DEMO, capture_output=True, text=True, timeout=80,
                          env=_env(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    through = "fio through the FUSE mount" if "mounted at" in done.stdout \
        else "blockfabric bench"
    if through == "blockfabric bench":
        assert "falling back to blockfabric bench" in done.stdout   # and it says why
    _check_table(done.stdout, through)
    _assert_nothing_left(_workspace(done.stdout), tmp_path)


@pytest.mark.timeout(90)
def test_demo_without_fuse_says_so_and_uses_bench(tmp_path):
    done = subprocess.run(DEMO + ["--no-fuse"], capture_output=True, text=True, timeout=80,
                          env=_env(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FUSE path unavailable (--no-fuse given)" in done.stdout
    _check_table(done.stdout, "blockfabric bench")
    _assert_nothing_left(_workspace(done.stdout), tmp_path)


@pytest.mark.timeout(90)
def test_ctrl_c_in_the_middle_still_cleans_up(tmp_path):
    proc = subprocess.Popen(DEMO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(tmp_path), stdin=subprocess.DEVNULL)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "randread 4k QD16" in line and line.rstrip().endswith("..."):  # running
                time.sleep(1)
                proc.send_signal(signal.SIGINT)
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + out
    assert proc.returncode == 130, text
    assert "interrupted" in text and "cleaned up" in text and "results (" not in text
    _assert_nothing_left(_workspace(text), tmp_path)

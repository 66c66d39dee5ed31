"""benchmarks/rdma_bw.py keeps working: a --quick run between two real processes.

Speed is not asserted (that is the benchmark's job, on a quiet machine); what is checked is
that every test ran, moved the bytes it claims and wrote a report that says how it was made.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "rdma_bw.py"
TESTS = ("write", "read", "tcp", "send_lat", "tcp_lat")


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "r.md"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    report["md"] = out.read_text()
    return report


@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_quick_run_measures_every_test_and_reports(tmp_path, progress):
    report = _run(tmp_path, "--progress", progress)
    assert report["config"]["progress"] == progress
    # --wait auto: what the reactor does (spin, then sleep), but not beside a progress
    # thread, which a spin would keep from the GIL
    wait = "event" if progress == "thread" else "adaptive"
    assert report["config"]["wait"] == wait and f"completion wait: {wait}" in report["md"]
    assert f"--progress {progress}" in report["command"]
    assert report["machine_before"]["nproc"] >= 1
    assert set(report["results"]) == {str(4096), str(1 << 20)}
    for size, row in report["results"].items():
        assert set(TESTS) <= set(row), row.keys()
        for name in ("write", "read", "tcp"):
            m = row[name]["median"]
            assert m["iters"] >= 16 and m["seconds"] > 0
            assert math.isclose(m["MiB_s"] * m["seconds"] * (1 << 20), int(size) * m["iters"],
                                rel_tol=1e-6)
        for name in ("send_lat", "tcp_lat"):
            m = row[name]["median"]
            assert 0 < m["min_us"] <= m["p50_us"] <= m["p99_us"]
        assert row["write_vs_tcp"] > 0 and row["read_vs_tcp"] > 0
    md = report["md"]
    assert "| 4 KiB |" in md and "| 1 MiB |" in md and "WRITE/TCP" in md
    assert "## Goal" in md and "nproc" in md and "load average" in md


def test_sizes_parse_like_perftest():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import rdma_bw
    finally:
        sys.path.remove(str(BENCH.parent))
    assert [rdma_bw.parse_size(s) for s in ("4K", "4KiB", "1M", "4096", "2g")] == \
        [4096, 4096, 1 << 20, 4096, 2 << 30]
    assert rdma_bw.human(4096) == "4 KiB" and rdma_bw.human(1000) == "1000 B"


def test_each_wait_mode_spins_for_its_own_time(monkeypatch):
    sys.path.insert(0, str(BENCH.parent))
    try:
        import rdma_bw_peer
    finally:
        sys.path.remove(str(BENCH.parent))
    monkeypatch.setenv("BLOCKFABRIC_REACTOR_SPIN_US", "250")
    assert rdma_bw_peer.spin_for("adaptive") == pytest.approx(250e-6)
    assert rdma_bw_peer.spin_for("spin") == math.inf
    assert rdma_bw_peer.spin_for("event") == 0.0

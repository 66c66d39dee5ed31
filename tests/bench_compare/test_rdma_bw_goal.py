"""benchmarks/rdma_bw.py's Goal section (rdma_bw_report.py): issue 14's two ratios, each PASS or
FAIL."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import rdma_bw
    import rdma_bw_report
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

KiB, MiB = 1 << 10, 1 << 20


def _row(**medians):
    return {name: {"median": m} for name, m in medians.items()}


def test_the_4k_rate_is_against_the_tcp_request_response_loop_and_1m_against_the_stream():
    small = _row(write={"msg_s": 30000.0}, read={"msg_s": 21000.0},
                 tcp_lat={"msg_s": 20000.0, "p50_us": 1.0, "p99_us": 2.0},
                 send_lat={"p50_us": 30.0, "p99_us": 90.0})
    big = _row(tcp={"MiB_s": 1000.0})
    big.update(write_vs_tcp=0.95, read_vs_tcp=0.89)
    text = "\n".join(rdma_bw_report.acceptance({4 * KiB: small, MiB: big}))
    assert "## Goal" in text
    assert ("4 KiB message rate >= 1x a Python TCP request/response loop of 4 KiB (20000 "
            "exchanges/s): WRITE 30000 msg/s = 1.50x, READ 21000 msg/s = 1.05x -> **PASS**"
            in text)
    assert ("1 MiB bandwidth >= 0.9x a Python socket stream (1000 MiB/s): WRITE 0.95x, "
            "READ 0.89x -> **FAIL**" in text)


def test_a_ratio_not_measured_says_what_is_missing():
    text = "\n".join(rdma_bw_report.acceptance({}))
    assert "4 KiB message rate vs a Python TCP request/response loop: not measured" in text
    assert "1 MiB bandwidth vs a Python socket stream: not measured" in text
    assert "PASS" not in text and "FAIL" not in text


def test_the_tcp_loop_reports_its_exchange_rate():
    got = rdma_bw._lat([100_000, 300_000])          # two round trips: 0.1 ms and 0.3 ms
    assert got["msg_s"] == 2 / 0.0004 and got["p50_us"] == 150.0

"""benchmarks/cost_per_io.py's options and arithmetic (no systems started)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cost_per_io",
                                               ROOT / "benchmarks" / "cost_per_io.py")
cost = importlib.util.module_from_spec(_spec)
sys.modules["cost_per_io"] = cost          # dataclasses look their module up
_spec.loader.exec_module(cost)


def test_systems_and_workloads_filter(monkeypatch, tmp_path):
    monkeypatch.setenv(cost.systems.FLOOR_ENV, str(tmp_path))     # no floor there
    a = cost.parse(["--systems", "mount-poll,floor", "--workloads", "randwrite-4k-qd16",
                    "--rounds", "3"])
    assert a.systems == ["mount-poll"] and a.floor_note == "floor: skipped (not found)"
    assert [w.key for w in a.workloads] == ["randwrite-4k-qd16"] and a.rounds == 3
    assert cost.parse(["--systems", "all"]).systems == [k for k in cost.SYSTEMS if k != "floor"]


def test_unknown_names_and_nothing_left_are_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(cost.systems.FLOOR_ENV, str(tmp_path))
    for argv in (["--systems", "mount-pol"], ["--workloads", "seqread"], ["--systems", "floor"],
                 ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            cost.parse(argv)
    assert "choose from" in capsys.readouterr().err


def test_libnbd_only_reads():
    fleet = cost.Fleet.__new__(cost.Fleet)
    fleet.floor = object()
    assert fleet.supports("libnbd", cost.WORKLOADS["randread-4k-qd1"])
    assert not fleet.supports("libnbd", cost.WORKLOADS["randwrite-4k-qd16"])
    assert fleet.supports("floor", cost.WORKLOADS["randwrite-4k-qd16"])
    fleet.floor = None                      # it did not start: measured without it
    assert not fleet.supports("floor", cost.WORKLOADS["randread-4k-qd1"])


def _row(system, workload, iops, server, host):
    return {"system": system, "workload": workload, "iops": iops, "p50_us": 1.0,
            "p99_us": 2.0, "us_per_io": {"server": server, "host": host, "fio": 1.0},
            "machine_busy": 0.5, "load1": 3.0}


def test_medians_over_rounds_and_the_cpu_goal_against_the_floor():
    rows = [_row("mount-poll", "randread-4k-qd16", i, s, h)
            for i, s, h in ((1000, 50, 60), (3000, 10, 90), (2000, 40, 50))]
    rows += [_row("floor", "randread-4k-qd16", 9000, 20, 30)]
    rows += [_row("mount-poll", "randread-4k-qd1", 500, 40, 40)]
    med = cost.medians(rows)
    got = med[("mount-poll", "randread-4k-qd16")]
    assert got["iops"] == 2000 and got["iops_range"] == (1000, 3000)
    assert got["us_per_io"]["server"] == 40 and got["server_host"] == 100   # median of sums
    lines = cost.acceptance(med)
    assert lines[0].endswith("100.0 us target+host vs the floor's 50.0 us = 2.00x "
                             "(goal <= 2x): **PASS**")
    assert lines[1].endswith("floor not measured: no verdict")


def test_the_cpu_goal_judges_the_nvme_tcp_mount_and_spun_variants_too(monkeypatch, tmp_path):
    monkeypatch.setenv(cost.systems.FLOOR_ENV, str(tmp_path))     # no floor there
    cost.parse(["--systems", "mount-tcp,mount-tcp-s0"])      # adds the spun variant
    rows = [_row("floor", "randread-4k-qd16", 9000, 5, 7),
            _row("mount-tcp", "randread-4k-qd16", 5000, 9, 15),
            _row("mount-tcp-s0", "randread-4k-qd16", 5000, 9, 16),
            _row("bench-tcp", "randread-4k-qd16", 9000, 1, 1)]     # not a mount: no line
    lines = cost.acceptance(cost.medians(rows))
    assert len(lines) == 2, lines
    assert "(NVMe/TCP)" in lines[0] and lines[0].endswith("= 2.00x (goal <= 2x): **PASS**")
    assert "spin 0 us" in lines[1] and lines[1].endswith("= 2.08x (goal <= 2x): **FAIL**")


def test_a_load_is_measured_over_the_run_it_counts_and_a_failed_one_raises():
    # an nbd_qd.py-like load: its JSON (after a line of chatter) names the counted span
    load = ("import json, time; t = time.time(); print('warming up'); "
            "print(json.dumps({'timestamp_ms': t * 1e3, 'seconds': 0.5, 'ios': 1000, "
            "'iops': 2000, 'p50_us': 1.0, 'p99_us': 2.0}))")
    res, span = cost.measure([sys.executable, "-c", load], {}, 0.5)
    assert res["iops"] == 2000 and res["ios"] == 1000
    assert set(span.cpu) == {"host"}
    with pytest.raises(cost.systems.SetupError, match="failed: boom"):
        cost.measure([sys.executable, "-c", "import sys; sys.exit('boom')"], {}, 0.5)

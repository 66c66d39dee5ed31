"""The arithmetic of the comparison: medians, ratios and goal verdicts."""

from __future__ import annotations

import pathlib
import sys

from hypothesis import given, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "compare"))

import report  # noqa: E402


def test_ratio_is_of_medians_not_means():
    assert report.ratio([1.0, 2.0, 100.0], [1.0, 1.0, 1.0]) == 2.0


def test_ratio_without_numbers_is_none():
    assert report.ratio([], [1.0]) is None
    assert report.ratio([1.0], [0.0]) is None


def test_verdict_names_the_goal_and_whether_it_is_met():
    assert report.verdict(1.5, 1.5) == "1.50x (met, goal 1.5x)"
    assert report.verdict(1.49, 1.5) == "1.49x (NOT met, goal 1.5x)"
    assert report.verdict(0.5, None) == "0.50x"


def test_spread_gives_median_and_range_in_the_jobs_unit():
    assert report.spread([2e9, 1e9, 3e9], "bw") == "2.00 GB/s (1.00 GB/s-3.00 GB/s)"
    assert report.spread([1500.0], "iops") == "1.5k"
    assert report.spread([], "iops") == "-"


@given(st.lists(st.floats(1, 1e6), min_size=1, max_size=9),
       st.lists(st.floats(1, 1e6), min_size=1, max_size=9))
def test_ratio_inverts(a, b):
    assert abs(report.ratio(a, b) * report.ratio(b, a) - 1) < 1e-9


def test_every_goal_names_a_job():
    keys = {job.key for job in report.JOBS}
    assert set(report.GOALS_VS_MEMORY) <= keys


def test_hot_spots_count_self_time_by_function(tmp_path):
    import cpu
    raw = tmp_path / "raw.txt"
    raw.write_text("main (a.py:1);f (a.py:10) 6\n"
                   "main (a.py:1);f (a.py:12) 2\n"
                   "main (a.py:1);g (a.py:20) 2\n")
    assert cpu.hot_spots(raw, 2) == [("samples", 10.0), ("f (a.py)", 0.8), ("g (a.py)", 0.2)]


def test_hot_spots_skip_a_frame_name_broken_over_lines(tmp_path):
    import cpu
    raw = tmp_path / "raw.txt"
    raw.write_text("main (a.py:1);f (a.py:10) 3\nmain (a.py:1);odd\nname (__doc__:4);\n")
    assert cpu.hot_spots(raw) == [("samples", 3.0), ("f (a.py)", 1.0)]


def _acceptance(fio, p99=None, cpu=None):
    return report.acceptance(fio, p99 or {}, cpu or {}, "bf-poll", "bf")


def test_acceptance_gives_each_goal_vs_memory_a_verdict_with_the_ratio():
    fio = {job.key: {"bf-poll": [130.0], "nbd-memory": [100.0]} for job in report.JOBS}
    lines = dict(_acceptance(fio))
    # 1.3x: enough for the 1.2x and 1.0x goals, not for seq read's 1.5x
    assert lines["randread 4k libaio QD16: bf / nbdkit memory + nbdfuse = 1.30x (goal >= 1.2x)"]
    assert lines["seq write 1M QD8: bf / nbdkit memory + nbdfuse = 1.30x (goal >= 1.2x)"]
    assert lines["seq read 1M QD8: bf / nbdkit memory + nbdfuse = 1.30x (goal >= 1.5x)"] is False


def test_acceptance_at_qd1_needs_the_p99_no_worse_too():
    fio = {"randread-4k-qd1": {"bf-poll": [110.0], "nbd-memory": [100.0]}}
    worse = {"randread-4k-qd1": {"bf-poll": [300.0], "nbd-memory": [200.0]}}
    better = {"randread-4k-qd1": {"bf-poll": [150.0], "nbd-memory": [200.0]}}
    (text, ok), = [(t, ok) for t, ok in _acceptance(fio, worse) if "QD1: bf / nbdkit memory" in t]
    assert "p99 300 us vs 200 us (goal: no worse)" in text and ok is False
    assert [ok for t, ok in _acceptance(fio, better) if "QD1: bf / nbdkit memory" in t] == [True]


def test_acceptance_wants_twice_the_python_plugin_on_every_job():
    fio = {job.key: {"bf-poll": [199.0], "nbd-python": [100.0]} for job in report.JOBS}
    got = [(t, ok) for t, ok in _acceptance(fio) if "nbdkit python" in t]
    assert len(got) == len(report.JOBS) and not any(ok for _t, ok in got)
    assert "1.99x (goal >= 2x)" in got[0][0]


def test_acceptance_cpu_against_the_floor_is_target_plus_host_of_medians():
    cpu = {"randread-4k-qd16": {"bf-poll": [{"server": 10.0, "host": 20.0, "fio": 9.0}] * 3,
                                "floor": [{"server": 5.0, "host": 10.0, "fio": 1.0}]},
           "randread-4k-qd1": {"bf-poll": [{"server": 50.0, "host": 51.0, "fio": 1.0}],
                               "floor": [{"server": 20.0, "host": 30.0, "fio": 1.0}]}}
    lines = _acceptance({}, {}, cpu)
    assert ("randread 4k libaio QD16: CPU target+host per I/O, bf 30.0 us / floor 15.0 us "
            "= 2.00x (goal <= 2x)", True) in lines
    assert ("randread 4k psync QD1: CPU target+host per I/O, bf 101.0 us / floor 50.0 us "
            "= 2.02x (goal <= 2x)", False) in lines
    assert report.verdict_line(*lines[-1]).endswith(": **FAIL**")


def test_acceptance_without_numbers_says_so_and_has_no_verdict():
    lines = _acceptance({})
    assert all(ok is None for _t, ok in lines)
    assert any(t.endswith("floor not measured") for t, _ok in lines)
    assert report.verdict_line("x: not measured", None) == "- x: not measured"


def test_cpu_cell_and_median_per_part():
    runs = [{"server": 1.0, "host": 2.0, "fio": 3.0}, {"server": 3.0, "host": 4.0, "fio": 5.0},
            {"server": 2.0, "host": 9.0, "fio": 4.0}]
    assert report.cpu_median(runs) == {"server": 2.0, "host": 4.0, "fio": 4.0,
                                       "server+host": 7.0}
    assert report.cpu_cell([{"fio": 2.0}]) == "- / - / 2.0"
    assert report.cpu_cell(runs) == "2.0 / 4.0 / 4.0 (t+h 7.0)"
    assert report.cpu_cell([]) == "-"


def test_cpu_span_interpolates_between_samples():
    import cpu
    s = cpu.Sampler({"a": 1})
    s.samples = [(10.0, {"a": 1.0}, (100.0, 200.0)), (11.0, {"a": 2.0}, (150.0, 300.0)),
                 (12.0, {"a": None}, (160.0, 400.0))]     # "a" ended before the last sample
    span = s.span(10.5, 11.5)
    assert span.cpu == {"a": 0.5} and span.seconds == 1.0
    assert abs(span.machine - (155.0 - 125.0) / (350.0 - 250.0)) < 1e-9
    assert span.us_per_io(1000) == {"a": 500.0}


def test_counted_span_is_the_runtime_before_the_end_stamp():
    import cpu
    out = {"timestamp_ms": 20_000, "jobs": [{"job_runtime": 32_000, "read": {"total_ios": 7},
                                             "write": {"total_ios": 3}}]}
    assert cpu.counted_span(out) == (-12.0, 20.0, 10)
    assert cpu.counted_span(out, 2.0) == (18.0, 20.0, 10)   # group_reporting sums runtimes


def test_find_floor_takes_the_flag_then_the_variable(tmp_path, monkeypatch):
    import systems
    monkeypatch.setenv(systems.FLOOR_ENV, str(tmp_path))
    assert systems.find_floor() is None          # the variable wins, and names no floor
    for name in systems.FLOOR_FILES:
        (tmp_path / name).write_text("")
    assert systems.find_floor() == tmp_path
    assert systems.find_floor(tmp_path / "nowhere") is None

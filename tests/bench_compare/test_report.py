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

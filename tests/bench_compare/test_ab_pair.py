"""benchmarks/ab_pair.py's pairing arithmetic (no systems started)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_pair", ROOT / "benchmarks" / "ab_pair.py")
ab = importlib.util.module_from_spec(_spec)
sys.modules["ab_pair"] = ab
_spec.loader.exec_module(ab)


def row(i, side, target, host, kind="mount", workload="randread-4k-qd16"):
    return {"iteration": i, "side": side, "kind": kind, "workload": workload,
            "target": target, "host": host, "iops": 1.0}


def test_ratios_are_taken_per_pair_not_from_the_medians():
    # the load doubles between iterations: the medians of each side hide that B costs 0.8x A
    # in every pair, the per-pair ratios do not
    rows = [row(0, "A", 10, 10), row(0, "B", 8, 8),
            row(1, "A", 20, 20), row(1, "B", 16, 16),
            row(2, "A", 40, 40), row(2, "B", 32, 32),
            row(3, "B", 1, 1)]                   # no A beside it: not a pair
    [item] = ab.summary(rows)
    assert item["pairs"] == 3 and (item["workload"], item["kind"]) == ("randread-4k-qd16",
                                                                       "mount")
    assert item["t+h"]["ratio"] == 0.8 and item["t+h"]["range"] == (0.8, 0.8)
    assert item["host"]["A"] == 20 and item["host"]["B"] == 16
    text = ab.markdown([item])
    assert "| randread 4k QD16 | mount | 3 | 40.0 | 32.0 | 0.80 (0.80-0.80) |" in text

"""benchmarks/scaling.py against today's cost_per_io, cpu and systems: it drifted from them
once (cost_per_io.measure lost ``ready=`` and bench_argv came to take a Workload) and nothing
noticed, because nothing ran it.  Its loads are checked against ``blockfabric bench``'s own
parser, several loads at once are measured over the span they all counted, and a short real
run (1 queue, 1 host, 1 s) makes its report."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from blockfabric.initiator.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scaling.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("scaling", SCRIPT)
scaling = importlib.util.module_from_spec(_spec)
sys.modules["scaling"] = scaling
_spec.loader.exec_module(scaling)
cpu = scaling.cpu


def bench_args(argv):
    assert pathlib.Path(argv[0]).name == "blockfabric" and argv[1] == "bench"
    return build_parser().parse_args(argv[1:])


def test_every_load_is_a_blockfabric_bench_command_line():
    loads = scaling.loads(4420, 1.5)
    assert [(kind, n) for kind, n, _, _ in loads] == \
        [("I/O queues", n) for n in range(1, 5)] + [("hosts", n) for n in range(1, 5)]
    for kind, n, seconds, argvs in loads:
        parsed = [bench_args(a) for a in argvs]
        assert all((p.rw, p.iodepth, p.trsvcid, p.runtime) == ("randread", 16, "4420", seconds)
                   for p in parsed)
        if kind == "I/O queues":
            [p] = parsed
            assert (p.nr_io_queues, p.numjobs, p.thread, p.group_reporting) == (n, n, True, True)
        else:
            assert len(parsed) == n and len({p.hostnqn for p in parsed}) == n
            assert seconds == 1.5 + (n - 1) * scaling.STAGGER
            assert all(p.nr_io_queues == 1 for p in parsed)
    assert [(kind, seconds) for kind, _, seconds, _ in scaling.loads(4420, 1.5, max_n=1)] == \
        [("I/O queues", 1.5), ("hosts", 1.5)]
    load = scaling.profile_loads(4420, pathlib.Path("/mnt/n1"), 300)
    assert bench_args(load["bench"]).nr_io_queues == 1
    assert load["mount"][0] == "fio" and "--filename=/mnt/n1" in load["mount"]


def stand_in(start_in, seconds, ios):
    """A load (an nbd_qd.py stand-in) that reports a counted run of ``seconds`` s starting
    ``start_in`` s from now, with ``ios`` I/Os."""
    code = ("import json, time; t = time.time(); time.sleep(0.3); "
            f"print(json.dumps({{'timestamp_ms': (t + {start_in} + {seconds}) * 1e3, "
            f"'seconds': {seconds}, 'ios': {ios}, 'iops': {ios / seconds}, 'p50_us': 1.0, "
            "'p99_us': 2.0}))")
    return [sys.executable, "-c", code]


def test_several_loads_are_measured_over_the_span_they_all_counted():
    # 0-1 s with 1000 I/Os and 0.5-1.5 s with 2000: both counted in 0.5-1 s (+- start-up)
    datas, span, ios = cpu.run_together([stand_in(0, 1.0, 1000), stand_in(0.5, 1.0, 2000)],
                                        {}, 1.0)
    assert [d["ios"] for d in datas] == [1000, 2000] and set(span.cpu) == {"host0", "host1"}
    assert 0.3 < span.seconds < 0.7
    assert ios == pytest.approx(3000 * span.seconds)
    with pytest.raises(scaling.systems.SetupError, match="did not count at the same time"):
        cpu.run_together([stand_in(0, 0.2, 10), stand_in(5, 0.2, 10)], {}, 0.2)


def test_a_short_real_run_reports_one_queue_and_one_host(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--runtime", "1", "--max-n", "1",
                             "--no-profile", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()            # the workspace stops its target on SIGTERM
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    [md] = tmp_path.glob("scaling-*.md")
    [js] = tmp_path.glob("scaling-*.json")
    rows = json.loads(js.read_text())["rows"]
    assert [(r["kind"], r["n"]) for r in rows] == [("I/O queues", 1), ("hosts", 1)]
    for r in rows:
        assert r["iops"] > 0 and r["target_us"] > 0 and r["host_us"] > 0
        assert 0.5 <= r["seconds"] <= 1.0
    assert "| hosts | 1 |" in md.read_text()

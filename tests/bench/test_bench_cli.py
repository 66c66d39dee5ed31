"""``blockfabric bench`` end to end: the real CLI against a real target subprocess."""

from __future__ import annotations

import signal
import subprocess
import time

from blockfabric.initiator.host import connect

from .conftest import HOSTNQN, NQN, bench, bench_cmd, bench_json, free_port, ram_config

FIO_PERCENTILES = ("50.000000", "90.000000", "99.000000", "99.900000")
MIB = 1 << 20


def test_json_output_has_fios_fields_and_consistent_numbers(target):
    result = bench_json(target, "--rw", "randrw", "--rwmixread", "70", "--bs", "8k",
                        "--iodepth", "4", "--runtime", "1", "--size", "16m", "--seed", "3")
    assert isinstance(result["fio version"], str) and result["jobs"]
    job = result["jobs"][0]
    assert job["error"] == 0 and job["job options"]["rw"] == "randrw"
    for direction in ("read", "write"):
        d = job[direction]
        assert d["total_ios"] > 0
        assert d["io_bytes"] == d["total_ios"] * 8192
        assert d["io_kbytes"] == d["io_bytes"] >> 10
        assert d["bw"] == d["bw_bytes"] >> 10
        assert 900 <= d["runtime"] <= 5000            # ms, for a 1 s run
        assert abs(d["iops"] - d["total_ios"] / (d["runtime"] / 1000)) < 0.05 * d["iops"]
        clat = d["clat_ns"]
        assert clat["N"] == d["total_ios"]
        p = clat["percentile"]
        assert all(k in p for k in FIO_PERCENTILES)
        assert clat["min"] <= p["50.000000"] <= p["90.000000"] <= p["99.000000"] \
            <= p["99.900000"] <= clat["max"]
        assert clat["min"] <= clat["mean"] <= clat["max"]
        assert d["lat_ns"]["mean"] >= clat["mean"]
    share = job["read"]["total_ios"] / (job["read"]["total_ios"] + job["write"]["total_ios"])
    assert 0.6 < share < 0.8, share
    assert job["trim"]["total_ios"] == 0


def test_iodepth_really_keeps_that_many_commands_in_flight(target):
    deep = bench_json(target, "--iodepth", "8", "-i", "1", "--runtime", "0.5",
                      "--size", "16m")["jobs"][0]["blockfabric"]
    shallow = bench_json(target, "--iodepth", "1", "-i", "1", "--runtime", "0.5",
                         "--size", "16m")["jobs"][0]["blockfabric"]
    # the queue's own counters, not the benchmark's: the wire really carried 8 at once
    assert deep["queues"] == [1] and deep["queue_max_inflight"] == 8, deep
    assert deep["max_inflight"] == 8
    assert shallow["queue_max_inflight"] == 1, shallow


def test_thread_jobs_share_one_controller_and_report_per_job_or_grouped(target):
    result = bench_json(target, "--thread", "--numjobs", "2", "--iodepth", "4", "--runtime",
                        "0.5", "--size", "16m")
    assert len(result["jobs"]) == 2
    assert all(j["read"]["total_ios"] > 0 for j in result["jobs"])
    assert len(result["blockfabric"]["queue_stats"]) == 1     # one controller
    assert len({pid for j in result["jobs"] for pid in j["blockfabric"]["pids"]}) == 1
    grouped = bench_json(target, "--thread", "--numjobs", "2", "--iodepth", "4", "--runtime",
                         "0.5", "--size", "16m", "--group_reporting")
    assert len(grouped["jobs"]) == 1 and grouped["jobs"][0]["blockfabric"]["max_inflight"] == 4


def test_verify_passes_then_fails_once_a_block_is_corrupted(target):
    region = ("--offset", "32m", "--size", "512k", "--bs", "16k", "--no-time_based")
    wrote = bench(target, "--rw", "randwrite", "--verify", "crc32c", *region)
    assert wrote.returncode == 0, wrote.stderr
    assert "verified 32 block(s)" in wrote.stdout           # the write job's read-back
    good = bench_json(target, "--rw", "read", "--verify", "crc32c", *region)
    assert good["jobs"][0]["blockfabric"]["verified_blocks"] == 32

    victim = (32 * MIB) + 5 * 16384
    with connect("127.0.0.1", NQN, target.port, provider="soft", hostnqn=HOSTNQN) as ctrl:
        ns = ctrl.namespaces[1]
        block = bytearray(ns.read(victim, 16384))
        block[10000] ^= 0x01                                 # one bit, deep in the data
        ns.write(victim, bytes(block))

    bad = bench(target, "--rw", "randread", "--verify", "crc32c", *region)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"offset {victim:#x}" in bad.stderr and "bad crc32c" in bad.stderr, bad.stderr


def test_verify_of_blocks_never_written_with_a_header_fails(target):
    done = bench(target, "--rw", "read", "--verify", "crc32c", "--offset", "60m",
                 "--size", "64k", "--no-time_based")
    assert done.returncode == 1
    assert "bad magic" in done.stderr


def test_progress_once_a_second_with_eta_always_and_none_on_a_pipe(target):
    loud = bench(target, "--runtime", "2.3", "--eta", "always", "--size", "16m")
    quiet = bench(target, "--runtime", "1.2", "--size", "16m")
    assert loud.returncode == 0 and quiet.returncode == 0
    ticks = [line for line in loud.stderr.splitlines() if "IOPS" in line]
    assert len(ticks) == 2, loud.stderr
    assert "MB/s" in ticks[0] and "1s/2s" in ticks[0]
    assert quiet.stderr == ""
    assert "IOPS=" in quiet.stdout and "clat percentiles" in quiet.stdout


def test_lost_target_is_an_io_error_with_exit_status_1(start_target):
    port = free_port()
    tgt = start_target(ram_config(port))
    proc = subprocess.Popen(bench_cmd(port, "--runtime", "20", "--size", "16m", "-l", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed once the bench's I/O queues are connected (not at a fixed time: on a loaded
        # machine the bench may still be connecting, and fail for that instead)
        assert tgt.wait_log("qid=2: connected", 30), tgt.log
        time.sleep(0.5)
        tgt.proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    assert "job 0: read of 4096 bytes at offset" in err, err


def test_bad_requests_are_refused_before_any_io(target):
    done = bench(target, "--bs", "3k")
    assert done.returncode == 1 and "multiple of" in done.stderr
    done = bench(target, "--bs", "4m")
    assert done.returncode == 1 and "maximum transfer size" in done.stderr
    done = bench(target, "--iodepth", "300", "-i", "1", "-Q", "128")
    assert done.returncode == 1 and "raise --nr-io-queues" in done.stderr

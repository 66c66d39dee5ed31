"""``blockfabric bench --numjobs N``: one process per job (as fio), each with its own
controller; the report adds up, and the target counted what the report says."""

from __future__ import annotations

import json
import os
import subprocess

from e2e.conftest import BIN, NQN, free_port, ram_config, start_target  # noqa: F401

from .conftest import bench_cmd


def run_bench(port: int, *flags: str) -> tuple[int, dict]:
    """(the bench's own pid, its JSON result)."""
    proc = subprocess.Popen(bench_cmd(port, "-o", "json", *flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return proc.pid, json.loads(out)


def target_reads(sock: str) -> int:
    done = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", sock,
                           "--output-format", "json"], capture_output=True, text=True,
                          timeout=20, check=True)
    ns = json.loads(done.stdout)["subsystems"][0]["namespaces"][0]
    return ns["io"]["reads"]


def test_jobs_run_in_their_own_processes_and_the_sums_add_up(start_target, tmp_path):
    port = free_port()
    config = ram_config(port)
    config["listeners"][0]["provider"] = "soft"
    config["control_socket"] = sock = str(tmp_path / "t.sock")
    start_target(config)
    flags = ("--numjobs", "3", "--iodepth", "4", "--runtime", "1", "--size", "16m")
    before = target_reads(sock)
    me, per_job = run_bench(port, *flags)
    served = target_reads(sock) - before
    procs = per_job["blockfabric"]["processes"]
    pids = [p["pid"] for p in procs]
    assert len(set(pids)) == 3 and me not in pids, pids
    assert [p["job"] for p in procs] == [0, 1, 2]
    assert len(per_job["blockfabric"]["queue_stats"]) == 3          # a controller each
    assert [j["blockfabric"]["pids"] for j in per_job["jobs"]] == [[p] for p in pids]
    for job, proc in zip(per_job["jobs"], procs):
        assert job["read"]["total_ios"] == proc["read_ios"] > 0
    total = sum(p["read_ios"] for p in procs)
    # every read the jobs counted is one the target served, and no other
    assert served == total, (served, total)

    before = target_reads(sock)
    _, grouped = run_bench(port, *flags, "--group_reporting")
    served = target_reads(sock) - before
    (job,) = grouped["jobs"]
    procs = grouped["blockfabric"]["processes"]
    assert len(job["blockfabric"]["pids"]) == 3 and job["blockfabric"]["jobs"] == 3
    assert job["read"]["total_ios"] == sum(p["read_ios"] for p in procs) == served
    assert job["read"]["io_bytes"] == sum(p["read_bytes"] for p in procs)
    assert job["read"]["clat_ns"]["N"] == job["read"]["total_ios"]   # every latency merged
    assert job["job options"]["numjobs"] == "3" and "thread" not in job["job options"]


def test_verify_across_processes_gives_each_job_its_own_slice(start_target):
    port = free_port()
    start_target(dict(ram_config(port), listeners=[{"provider": "soft",
                                                    "address": "127.0.0.1", "port": port}]))
    _, result = run_bench(port, "--numjobs", "2", "--rw", "randwrite", "--verify", "crc32c",
                          "--size", "1m", "--bs", "16k", "--no-time_based")
    assert [j["blockfabric"]["verified_blocks"] for j in result["jobs"]] == [32, 32]


def test_cpus_gives_each_job_process_its_share(start_target):
    ncpu = len(os.sched_getaffinity(0))
    port = free_port()
    start_target(dict(ram_config(port), listeners=[{"provider": "soft",
                                                    "address": "127.0.0.1", "port": port}]))
    cpus = sorted(os.sched_getaffinity(0))[:2]
    _, result = run_bench(port, "--numjobs", "2", "--runtime", "0.3", "--cpus",
                          ",".join(map(str, cpus)))
    shares = [p["cpus"] for p in result["blockfabric"]["processes"]]
    if ncpu >= 2:
        assert shares == [str(cpus[0]), str(cpus[1])], shares
    else:
        assert shares == [str(cpus[0])] * 2


def test_cpus_not_online_is_a_usage_error():
    done = subprocess.run(bench_cmd(1, "--cpus", "4000-4001"), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "not online" in done.stderr, done.stderr
    done = subprocess.run(bench_cmd(1, "--cpus", "1-0"), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "--cpus" in done.stderr, done.stderr

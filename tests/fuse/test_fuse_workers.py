"""``blockfabric mount --fuse-workers N``: the session served by N processes on cloned
/dev/fuse descriptors, each with its own I/O queues of the one controller.

Real target, real mounts, real fio: data written through some processes reads back through
others (fio's verify with numjobs 4, and the per-worker counters show who served what); a
killed worker is started again (and left dead when it keeps dying) while the mount serves
on; unmount, SIGTERM and a killed mount process leave no worker, mount or record behind;
the option is checked before anything is mounted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from blockfabric.errors import ConfigError
from blockfabric.initiator.connection import share_qids
from blockfabric.initiator.initiator_config import loads

from .conftest import Mount, mounted_at, run_cli, wait_gone

pytestmark = pytest.mark.timeout(120)
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is missing")


def workers(m: Mount) -> list[dict]:
    """The mount record's serving processes (``blockfabric list -o json``)."""
    out = json.loads(run_cli("list", "--output-format", "json", env=m.env).stdout)
    rec = next(r for r in out["mounts"] if r["mountpoint"] == m.path)
    return rec["fuse_workers"]


def served(status: str) -> dict[int, tuple[int, int]]:
    """worker index -> (reads, writes), from .status."""
    return {int(i): (int(r), int(w)) for i, r, w in re.findall(
        r"worker (\d+): .*reads (\d+), writes (\d+)", status)}


def alive(pid: int) -> bool:
    return not wait_gone(pid, timeout=0.05)


def fio(m: Mount, *extra: str, size: str = "4m") -> subprocess.CompletedProcess:
    return subprocess.run(
        ["fio", "--name=w", f"--filename={m.file('n1')}", "--direct=1", "--ioengine=libaio",
         "--bs=4k", f"--size={size}", "--offset_increment=" + size, "--verify=crc32c",
         "--verify_fatal=1", "--verify_state_save=0", "--group_reporting",
         "--output-format=terse", *extra],
        capture_output=True, text=True, timeout=90)


@needs_fio
@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_fio_verify_numjobs4_through_four_workers(make_mount, transport):
    m = make_mount(name=f"w4-{transport}", transport=transport, flags=("--fuse-workers", "4"))
    procs = workers(m)
    assert [p["index"] for p in procs] == [0, 1, 2, 3]
    assert procs[0]["pid"] == m.pid
    assert len({p["pid"] for p in procs}) == 4 and all(alive(p["pid"]) for p in procs)
    # -i 2 (the default) is raised to one queue per process
    assert [p["queues"] for p in procs] == [[1], [2], [3], [4]]
    done = fio(m, "--rw=randwrite", "--iodepth=16", "--numjobs=4")
    assert done.returncode == 0, done.stdout + done.stderr
    status = m.status()
    counts = served(status)
    assert sorted(counts) == [0, 1, 2, 3], status
    # 4 x 1024 writes and as many verifying reads, spread over the processes
    assert sum(r for r, _ in counts.values()) == 4096, status
    assert sum(w for _, w in counts.values()) == 4096, status
    assert sum(1 for _, w in counts.values() if w) >= 2, status
    assert sum(1 for r, _ in counts.values() if r) >= 2, status
    assert m.counter("writes") == 4096 and m.counter("errors") == 0
    for qid in (1, 2, 3, 4):     # every process's queue carried commands
        line = next(x for x in status.splitlines() if f"queue {qid} (io)" in x)
        assert int(re.search(r"completed (\d+)", line).group(1)) > 0, status


@pytest.mark.parametrize("count,shares,runs", [
    (2, 1, [[1, 2]]), (2, 2, [[1], [2]]), (7, 3, [[1, 2, 3], [4, 5], [6, 7]]),
    (8, 4, [[1, 2], [3, 4], [5, 6], [7, 8]]), (5, 4, [[1, 2], [3], [4], [5]])])
def test_share_qids_splits_in_contiguous_runs(count, shares, runs):
    assert [share_qids(count, i, shares) for i in range(shares)] == runs


def test_share_qids_wants_one_queue_per_process():
    with pytest.raises(ValueError, match="granted 3 I/O queue"):
        share_qids(3, 0, 4)


def test_nr_io_queues_is_the_total_split_between_the_processes(make_mount):
    m = make_mount(name="split", flags=("--fuse-workers", "3", "-i", "7"))
    assert [p["queues"] for p in workers(m)] == [[1, 2, 3], [4, 5], [6, 7]]
    assert "(+2 FUSE workers)" in run_cli("list", env=m.env).stdout
    status = m.status()
    assert "worker 1: pid" in status and "I/O queues 4-5" in status, status
    assert all(f"queue {q} (io)" in status for q in range(1, 8)), status


def test_a_killed_worker_is_started_again_then_left_dead(make_mount):
    m = make_mount(name="kill", flags=("--fuse-workers", "2"))
    fd = os.open(m.file("n1"), os.O_RDWR | os.O_DIRECT)
    try:
        for round_ in (1, 2, 3):
            victim = workers(m)[1]["pid"]
            os.kill(victim, signal.SIGKILL)
            assert wait_gone(victim), f"worker {victim} not reaped"
            deadline = time.monotonic() + 20
            want = "failed" if round_ == 3 else "running"
            while time.monotonic() < deadline:
                w1 = workers(m)[1]
                if w1["state"] == want and (want == "failed" or w1["pid"] != victim):
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"round {round_}: {workers(m)}\n{m.status()}")
            status = m.status()
            if round_ < 3:
                assert f"restarted {round_} time(s) (last was killed by SIGKILL)" in status, \
                    status
                assert alive(w1["pid"])
            else:
                assert re.search(r"worker 1: pid \d+, failed", status), status
            # the mount serves on, whoever reads the requests
            buf = bytearray(os.urandom(4096) * 16)
            mm = memoryview(buf)
            assert os.pwritev(fd, [mm], round_ << 20) == len(buf)
            back = bytearray(len(buf))
            assert os.preadv(fd, [memoryview(back)], round_ << 20) == len(buf)
            assert back == buf
    finally:
        os.close(fd)
    assert m.counter("errors") == 0


@pytest.mark.parametrize("how", ["umount", "sigterm", "sigkill"])
def test_unmount_stops_every_worker(make_mount, how):
    m = make_mount(name=f"stop-{how}", flags=("--fuse-workers", "3"))
    pids = [p["pid"] for p in workers(m)]
    assert all(alive(p) for p in pids)
    if how == "umount":
        run_cli("umount", m.path, env=m.env)
    elif how == "sigterm":
        os.kill(pids[0], signal.SIGTERM)
    else:
        # the mount process dies without a word: its workers see their control socket
        # close and stop (the mount is then dead, as any killed FUSE server's)
        os.kill(pids[0], signal.SIGKILL)
    for pid in pids:
        assert wait_gone(pid), f"process {pid} still alive after {how}"
    if how == "sigkill":
        subprocess.run(["fusermount3", "-u", "-z", m.path], check=False)
    assert not mounted_at(m.path)
    out = subprocess.run(["pgrep", "-f", "fuse_workers"], capture_output=True, text=True)
    assert not set(out.stdout.split()) & {str(p) for p in pids}


@pytest.mark.parametrize("value", ["0", "65", "x"])
def test_bad_worker_count_is_a_usage_error(target, tmp_path, value):
    m = Mount(target, tmp_path, name="bad", flags=("--fuse-workers", value))
    done = run_cli(*m.argv(), env=m.env, check=False)
    assert done.returncode == 2, done.stderr
    assert "--fuse-workers: expected 1 to 64" in done.stderr, done.stderr
    assert not mounted_at(m.path)


@pytest.mark.parametrize("options,flags,message", [
    ("binding=libfuse", ("--fuse-workers", "2"), "needs the kernel binding"),
    ("", ("--fuse-workers", "9"), "granted 8 I/O queue(s) and 9 processes"),
    ("fuse_workers=2", ("--path", "127.0.0.1:1"), "not supported"),
])
def test_a_mount_its_workers_cannot_serve_fails_whole(target, tmp_path, options, flags,
                                                      message):
    """Refused before anything is left behind: no mount, no record, no worker process (the
    target grants at most 8 I/O queues: 9 processes cannot have one each)."""
    m = Mount(target, tmp_path, options, name="refused", flags=flags)
    done = run_cli(*m.argv(), env=m.env, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in done.stderr, done.stderr
    assert not mounted_at(m.path)
    out = subprocess.run(["pgrep", "-f", m.path], capture_output=True, text=True).stdout
    assert out.split() == []
    assert not os.path.exists(m.env["BLOCKFABRIC_RUNTIME_DIR"]) or \
        os.listdir(m.env["BLOCKFABRIC_RUNTIME_DIR"]) == []


@pytest.mark.parametrize("entry,expected", [
    ("fuse_workers: 0", "integer from 1 to 64"),
    ("fuse_workers: 2, options: [binding=libfuse]", "needs the kernel binding"),
    ("fuse_workers: 2, paths: ['10.0.0.2']", "not supported"),
])
def test_bad_fuse_workers_in_the_initiator_yaml(entry, expected):
    with pytest.raises(ConfigError) as exc:
        loads(f"mounts: [{{traddr: 10.0.0.1, nqn: b, mountpoint: /m, {entry}}}]",
              "/etc/x.yaml")
    assert exc.value.key == "mounts[0].fuse_workers", exc.value
    assert expected in str(exc.value)


def test_fuse_workers_from_the_initiator_yaml(target, tmp_path):
    import yaml
    m = Mount(target, tmp_path, name="yamlw")
    cfg = tmp_path / "initiator.yaml"
    cfg.write_text(yaml.safe_dump({"mounts": [{
        "traddr": "127.0.0.1", "trsvcid": target.port, "nqn": m.argv()[6],
        "mountpoint": m.path, "provider": "soft", "fuse_workers": 2}]}))
    try:
        run_cli("mount", "--config", str(cfg), m.path, env=m.env)
        assert len(workers(m)) == 2
        assert "fuse_workers=2" in m.status()
    finally:
        m.cleanup()


def test_status_reads_the_same_from_every_process(make_mount):
    """.status and its size, asked many times: the kernel hands the requests to any of the
    four processes, and a worker answers with the text the mount process makes."""
    m = make_mount(name="status", flags=("--fuse-workers", "4"))
    for _ in range(30):
        assert os.stat(m.file(".status")).st_size > 0
        text = m.status()
        assert "workers     4 processes serve FUSE requests" in text, text
        assert text.count(", running, I/O queues") == 4, text


def test_a_worker_that_cannot_connect_fails_the_mount_whole(tmp_path):
    """The listener takes 2 connections (max_connections): the mount process's admin and
    I/O queue.  The worker's queue is refused (Controller Busy) until it gives up; the mount
    then fails with the worker's reason, and leaves no mount, record or process behind."""
    from e2e.conftest import TargetProc, free_port

    from .conftest import NQN
    port = free_port()
    target = TargetProc({"listeners": [{"provider": "soft", "address": "127.0.0.1",
                                        "port": port, "max_connections": 2}],
                         "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                             {"nsid": 1, "backend": "ramdisk", "size": "4MiB"}]}]},
                        tmp_path).start()
    target.port = port
    try:
        m = Mount(target, tmp_path, name="busy", flags=("--fuse-workers", "2"))
        done = run_cli(*m.argv(), env=m.env, check=False, timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "could not start the FUSE workers: FUSE worker 1:" in done.stderr, done.stderr
        assert "busy" in done.stderr.lower(), done.stderr      # the target's reason
        assert not mounted_at(m.path)
        out = subprocess.run(["pgrep", "-f", m.path], capture_output=True, text=True).stdout
        assert out.split() == []
        assert not os.path.exists(m.env["BLOCKFABRIC_RUNTIME_DIR"]) or \
            os.listdir(m.env["BLOCKFABRIC_RUNTIME_DIR"]) == []
    finally:
        target.stop()


def test_a_worker_told_to_stop_is_not_started_again(make_mount):
    m = make_mount(name="term", flags=("--fuse-workers", "3"))
    victim = workers(m)[2]["pid"]
    os.kill(victim, signal.SIGTERM)
    assert wait_gone(victim)
    deadline = time.monotonic() + 10
    while workers(m)[2]["state"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)                 # past the restart delay: still nobody in its place
    assert [w["state"] for w in workers(m)] == ["running", "running", "stopped"]
    assert workers(m)[2]["pid"] == victim
    with open(m.file("n1"), "r+b", buffering=0) as f:
        for i in range(20):
            f.seek(i * 4096)
            f.write(b"%04d" % i * 1024)
        for i in range(20):
            f.seek(i * 4096)
            assert f.read(4096) == b"%04d" % i * 1024

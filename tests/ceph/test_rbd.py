"""``backend: rbd`` against a real (throwaway) Ceph cluster: the real target daemon as a
subprocess, the host library and the real FUSE mount over real sockets.

Timeouts are short and documented here: rbd.op_timeout 2 s (a stopped OSD fails an I/O
after 2 s, and the target then ends the controllers and answers Connect with Controller
Busy while it probes the image every second); the hosts reconnect every 0.5 s (the library) or
1 s (the bench command).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

import pytest

from e2e.conftest import HOSTNQN, TargetProc, free_port
from initiator.host import ControllerLost, connect

NQN = "nqn.2026-12.io.blockfabric:fuse"     # the FUSE tests' Mount helper mounts this one
MiB = 1 << 20
OP_TIMEOUT = 2


def rbd_config(ceph, image: str, port: int) -> dict:
    return {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
            "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                {"nsid": 1, "backend": "rbd", "rbd": {
                    "pool": ceph.pool, "image": image, "ceph_conf": ceph.conf,
                    "connect_timeout": 3, "op_timeout": OP_TIMEOUT,
                    "size_poll_interval": 1}}]}]}


@pytest.fixture
def rbd_target(ceph, tmp_path, request):
    """A target on a fresh image; parametrised (indirect) with ``reactors``: with 2 the
    image has no exclusive-lock (rbd create --image-feature layering), so that the I/O
    queues go to the worker, which opens the image as a client of its own."""
    reactors = getattr(request, "param", 1)
    if reactors > 1:
        image = f"t-{uuid.uuid4().hex[:8]}"
        ceph.rbd("create", "--size", "64M", "--image-feature", "layering",
                 f"{ceph.pool}/{image}")
    else:
        image = ceph.create_image(64 * MiB)
    port = free_port()
    config = rbd_config(ceph, image, port)
    if reactors > 1:
        config["reactors"] = reactors
    proc = TargetProc(config, tmp_path).start()
    proc.port, proc.image, proc.reactors = port, image, reactors
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log, proc.log
    if reactors > 1:
        # the I/O queues were the worker's, not the coordinator's
        assert "to poll group 1" in proc.log, proc.log
    ceph.rbd("rm", f"{ceph.pool}/{image}")


#: A test run with one reactor and with two (the worker opens the image as its own client).
GROUPS = pytest.mark.parametrize("rbd_target", [1, 2], indirect=True, ids=["1r", "2r"])


def bench(port: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    from e2e.conftest import BIN
    return subprocess.run([str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s",
                           str(port), "-n", NQN, "--provider", "soft", "--size", "32M",
                           "--verify", "crc32c", *args], capture_output=True, text=True,
                          timeout=timeout)


@GROUPS
def test_rbd_io_verified_through_the_host_library(rbd_target):
    for args in (["--rw", "randrw", "--bs", "4k", "--iodepth", "16"],
                 ["--rw", "write", "--bs", "1M", "--iodepth", "4"]):
        out = bench(rbd_target.port, *args, "--runtime", "2")
        assert out.returncode == 0, out.stdout + out.stderr + rbd_target.log
        assert "err= 0" in out.stdout and "verified" in out.stdout, out.stdout


@GROUPS
def test_flush_discard_and_write_zeroes_reach_the_image(ceph, rbd_target):
    # RBD objects are 4 MiB: discarding a whole one removes it (rbd du drops)
    data = os.urandom(8 * MiB)
    with connect("127.0.0.1", NQN, rbd_target.port, provider="soft", hostnqn=HOSTNQN) as ctrl:
        ns = ctrl.namespaces[1]
        assert ns.size == 64 * MiB                          # the image's size
        ns.write(8 * MiB, data)
        ns.flush()
        cluster, io, img = ceph.open(rbd_target.image)
        try:
            assert img.read(8 * MiB, len(data)) == data     # in the image, read by librbd
            used = _du(ceph, rbd_target.image)
            assert used >= 8 * MiB, used
            ns.discard(8 * MiB, 4 * MiB)                    # DSM deallocate -> aio_discard
            ns.write_zeroes(12 * MiB, 1 * MiB)              # -> aio_write_zeroes
            ns.flush()
            expect = bytes(5 * MiB) + data[5 * MiB:]
            assert img.read(8 * MiB, 8 * MiB) == expect
            assert ns.read(8 * MiB, 8 * MiB) == expect
            assert _du(ceph, rbd_target.image) <= used - 4 * MiB   # the object is gone
            # a discard inside an object reads back as zeros too (Identify's DLFEAT says so)
            ns.discard(14 * MiB + 8192, 64 * 1024)
            hole = 14 * MiB + 8192 - 8 * MiB
            expect = expect[:hole] + bytes(64 * 1024) + expect[hole + 64 * 1024:]
            assert ns.read(8 * MiB, 8 * MiB) == expect
            assert img.read(8 * MiB, 8 * MiB) == expect
        finally:
            img.close()
            io.close()
            cluster.shutdown()


def _du(ceph, image: str) -> int:
    import json
    out = json.loads(ceph.rbd("du", "--format", "json", f"{ceph.pool}/{image}"))
    return sum(i["used_size"] for i in out["images"])


@GROUPS
def test_resize_reaches_the_host_as_an_aen(ceph, rbd_target):
    changed = threading.Event()
    with connect("127.0.0.1", NQN, rbd_target.port, provider="soft", hostnqn=HOSTNQN) as ctrl:
        ctrl.namespace_listeners.append(lambda _c, nsids: 1 in nsids and changed.set())
        ns = ctrl.namespaces[1]
        ns.write(0, b"kept" * 1024)
        ceph.rbd("resize", "--size", "96M", f"{ceph.pool}/{rbd_target.image}")
        # noticed by the target's size check (size_poll_interval 1 s), no reload needed
        assert changed.wait(10), rbd_target.log
        assert ctrl.namespaces[1].size == 96 * MiB
        ctrl.namespaces[1].write(90 * MiB, b"x" * 4096)       # beyond the old end
        assert ctrl.namespaces[1].read(0, 4096) == b"kept" * 1024
        # and with a reload (SIGHUP), as an operator would after rbd resize
        changed.clear()
        ceph.rbd("resize", "--size", "128M", f"{ceph.pool}/{rbd_target.image}")
        rbd_target.proc.send_signal(signal.SIGHUP)
        assert changed.wait(10), rbd_target.log
        assert ctrl.namespaces[1].size == 128 * MiB


def test_fio_verify_through_the_fuse_mount(ceph, rbd_target, tmp_path):
    import shutil
    from fuse.conftest import Mount
    if shutil.which("fio") is None:
        pytest.skip("fio is missing (Debian package fio)")
    mount = Mount(rbd_target, tmp_path).start()
    try:
        n1 = mount.file("n1")
        assert os.stat(n1).st_size == 64 * MiB
        for bs, depth in (("4k", 16), ("1M", 4)):
            out = subprocess.run(
                ["fio", "--name=v", f"--filename={n1}", "--rw=randwrite", f"--bs={bs}",
                 "--ioengine=libaio", f"--iodepth={depth}", "--direct=1", "--size=16M",
                 "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
                 "--verify_state_save=0"],
                capture_output=True, text=True, timeout=120)
            assert out.returncode == 0 and "err= 0" in out.stdout, out.stdout + out.stderr
        # dd through the mount, read back through librbd
        payload = os.urandom(MiB)
        with open(n1, "r+b") as f:
            f.seek(40 * MiB)
            f.write(payload)
            os.fsync(f.fileno())
        cluster, io, img = ceph.open(rbd_target.image)
        try:
            assert img.read(40 * MiB, MiB) == payload
        finally:
            img.close()
            io.close()
            cluster.shutdown()
    finally:
        mount.cleanup()


def all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is in state T (stopped) or t (traced)."""
    task = f"/proc/{pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/stat") as f:
                state = f.read().rpartition(") ")[2][:1]
        except FileNotFoundError:
            continue                    # a thread that exited meanwhile
        if state not in ("T", "t"):
            return False
    return True


@pytest.fixture
def stopped_osd(ceph):
    """stop() / cont() the OSD with SIGSTOP / SIGCONT; always continued at teardown."""
    pid = ceph.pid("osd.0")

    class Osd:
        def stop(self) -> None:
            """SIGSTOP, then wait until every thread is stopped: the signal is delivered
            asynchronously, and under load a running OSD thread has answered a write
            0.8 ms after kill() returned."""
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not all_threads_stopped(pid):
                assert time.monotonic() < deadline, f"osd.0 ({pid}) did not stop"
                time.sleep(0.005)

        def cont(self) -> None:
            os.kill(pid, signal.SIGCONT)
    osd = Osd()
    try:
        yield osd
    finally:
        osd.cont()


@GROUPS
def test_cluster_stopped_mid_io_then_back_inside_ctrl_loss_tmo(rbd_target, stopped_osd):
    """I/O is held (not failed) while the cluster is away and resumes when it returns."""
    run = subprocess.Popen(
        [*_bench_argv(rbd_target.port), "--rw", "randwrite", "--bs", "4k", "--iodepth", "8",
         "--runtime", "9", "--ctrl-loss-tmo", "20", "--reconnect-delay", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)
        stopped_osd.stop()
        assert rbd_target.wait_log("namespace unavailable", OP_TIMEOUT + 10), rbd_target.log
        time.sleep(2)                   # hosts refused (Controller Busy) meanwhile
        stopped_osd.cont()
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out + rbd_target.log
    assert "err= 0" in out and "0 failed" in out and "re-issued" in out, out
    assert rbd_target.wait_log("namespace available again", 5), rbd_target.log


def _bench_argv(port: int) -> list[str]:
    from e2e.conftest import BIN
    return [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(port), "-n", NQN,
            "--provider", "soft", "--size", "32M", "--verify", "crc32c"]


def test_cluster_stopped_gives_eio_only_after_ctrl_loss_tmo(rbd_target, stopped_osd):
    ctrl_loss_tmo = 4.0
    with connect("127.0.0.1", NQN, rbd_target.port, provider="soft", hostnqn=HOSTNQN,
                 ctrl_loss_tmo=ctrl_loss_tmo, reconnect_delay=0.5) as ctrl:
        ns = ctrl.namespaces[1]
        ns.write(0, b"a" * 4096)
        stopped_osd.stop()
        t0 = time.monotonic()
        with pytest.raises(ControllerLost):
            ns.write(4096, b"b" * 4096)
        took = time.monotonic() - t0
        # the op timeout, then ctrl_loss_tmo of reconnects refused with Controller Busy
        assert took >= OP_TIMEOUT + ctrl_loss_tmo - 0.5, took
        assert took < OP_TIMEOUT + ctrl_loss_tmo + 5, took
    assert "connect refused" in rbd_target.log and "unavailable" in rbd_target.log


def test_start_with_the_cluster_unreachable_fails_clearly(ceph, tmp_path):
    """A monitor nobody answers on: the target refuses to start within connect_timeout,
    naming the image and the timeout (systemd's Restart= then retries)."""
    conf = tmp_path / "dead.conf"
    conf.write_text(f"[global]\nmon host = [v2:127.0.0.1:{free_port()}]\n"
                    "auth client required = none\nkeyring = /dev/null\n")
    config = rbd_config(ceph, "img", free_port())
    config["subsystems"][0]["namespaces"][0]["rbd"]["ceph_conf"] = str(conf)
    from ceph.test_gateway import start_refused
    out, took = start_refused(tmp_path, config)
    # connect_timeout 3 s, not librados' 300 s (the rest is the daemon's start, which takes
    # 10 s and more on a loaded 2-core machine)
    assert took < 30, took
    assert "rbd image rbd/img" in out.stderr and "rbd.connect_timeout" in out.stderr, \
        out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def _watchers(ceph, image: str) -> int:
    import json
    return len(json.loads(ceph.rbd("status", "--format", "json",
                                   f"{ceph.pool}/{image}"))["watchers"])


@pytest.mark.parametrize("exclusive_lock", [False, True], ids=["layering", "exclusive-lock"])
def test_two_reactors_open_an_image_per_client_unless_it_has_exclusive_lock(
        ceph, tmp_path, exclusive_lock):
    """With reactors 2 a worker is a librbd client of its own (its own cluster connection
    and image handle: a second watcher).  An image with exclusive-lock would have its lock
    pass between the two clients on every write, so its subsystem's I/O queues stay in
    the coordinator (one client, one watcher), which says so at start."""
    image = f"t-{uuid.uuid4().hex[:8]}"
    features = ["--image-feature", "layering"] + (
        ["--image-feature", "exclusive-lock"] if exclusive_lock else [])
    ceph.rbd("create", "--size", "64M", *features, f"{ceph.pool}/{image}")
    port = free_port()
    proc = TargetProc({**rbd_config(ceph, image, port), "reactors": 2}, tmp_path).start()
    try:
        assert _watchers(ceph, image) == (1 if exclusive_lock else 2)
        kept = "keeps its I/O queues in the coordinator"
        assert (kept in proc.log) == exclusive_lock, proc.log
        if exclusive_lock:
            assert f"rbd feature disable {ceph.pool}/{image} fast-diff object-map " \
                   "exclusive-lock" in proc.log
        out = bench(port, "--rw", "randrw", "--bs", "4k", "--iodepth", "8", "--runtime", "2",
                    "-i", "2")
        assert out.returncode == 0, out.stdout + out.stderr + proc.log
        assert "err= 0" in out.stdout and "verified" in out.stdout, out.stdout
        assert ("to poll group 1" in proc.log) != exclusive_lock, proc.log
    finally:
        proc.stop()
    assert "Traceback" not in proc.log, proc.log
    ceph.rbd("rm", f"{ceph.pool}/{image}")

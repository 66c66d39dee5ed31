"""The host's ANA multipath against two real gateways on one RBD image: the host connects to
both at once, sends I/O to the optimized one, moves it to the surviving path when the
optimized gateway is SIGKILLed, and back when it returns (failback).

Three hosts run the load at the same time, each on its own region of the image:
``blockfabric bench --verify crc32c`` and fio's crc32c verify through a FUSE mount (both
with ``--path``), and the host library in this process, whose completion times give the
two numbers issue 16 asks for (kill -> I/O flowing again, restart -> failback).

The gateways listen on 127.0.0.1 on two ports: the throwaway cluster listens on loopback
only, which a second network namespace would not reach.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

from e2e.conftest import BIN, HOSTNQN, TargetProc, free_port
from fuse.conftest import Mount, mounted_at
from blockfabric.initiator.host import ConnectOptions, Controller
from blockfabric.protocol.logpages import AnaState

from .test_gateway import NQN, _image, _remove, gateway_config, wait_for

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)


class PathsMount(Mount):
    """``blockfabric mount -f`` (as systemd runs it) with both paths; its log (stderr) is
    kept, so that a failing check can show what the host saw."""

    def __init__(self, ports, base) -> None:
        super().__init__(None, base)
        self.ports = ports
        self.log_path = base / "mount.log"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        return ["mount", "-a", "127.0.0.1", "-s", str(self.ports[0]), "--path",
                f"127.0.0.1:{self.ports[1]}", "-n", NQN, "--provider", "soft", "-q",
                HOSTNQN, "-k", "3", "-c", "1", "-l", "30", "-f", self.path]

    def program(self) -> list[str]:
        return [str(BIN / "blockfabric")]

    def start(self) -> PathsMount:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*self.program(), *self.argv()],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=self.env)
        wait_for(lambda: mounted_at(self.path) or self.proc.poll() is not None, 30,
                 "mounted")
        assert mounted_at(self.path), self.log()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def cleanup(self) -> None:
        if self.proc is None:
            return
        if mounted_at(self.path):
            # ``blockfabric umount`` waits for the mount process to be gone: this process,
            # its parent, reaps it meanwhile (a zombie would look alive to it)
            umount = subprocess.Popen([str(BIN / "blockfabric"), "umount", self.path],
                                      env=self.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            out, _ = umount.communicate(timeout=30)
            assert umount.returncode == 0, out
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class Load(threading.Thread):
    """Write then read back 4 KiB blocks at 48 MiB.. through the library, recording when
    each completed; any error or mismatch is kept."""

    def __init__(self, ctrl) -> None:
        super().__init__(daemon=True)
        self.ns = ctrl.namespaces[1]
        self.done: list[float] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            off = 48 * MiB + (i % 2048) * 4096
            data = (b"%08d" % i) * 512
            try:
                self.ns.write(off, data)
                if self.ns.read(off, 4096) != data:
                    self.errors.append(f"mismatch at {off}")
            except Exception as exc:  # noqa: BLE001 - the test asserts there is none
                self.errors.append(repr(exc))
            self.done.append(time.monotonic())
            i += 1

    def first_after(self, t: float) -> float:
        return next(x for x in list(self.done) if x > t) - t


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is missing")
def test_host_multipath_kill_optimized_gateway_then_failback(ceph, tmp_path):
    image, group = _image(ceph), f"g{uuid.uuid4().hex[:6]}"
    ports = free_port(), free_port()
    confs = [gateway_config(ceph, [image], ports[0], "gw-a", group, (1, 99), [1]),
             gateway_config(ceph, [image], ports[1], "gw-b", group, (100, 199), [])]
    procs = [TargetProc(c, tmp_path).start() for c in confs]
    mount = bench = ctrl = None
    try:
        ctrl = Controller(ConnectOptions("127.0.0.1", NQN, ports[0], provider="soft",
                                         hostnqn=HOSTNQN, paths=[("127.0.0.1", ports[1])],
                                         keep_alive_tmo=3, reconnect_delay=0.5,
                                         ctrl_loss_tmo=30)).connect()
        wait_for(lambda: ctrl._serving.get(1) == {0}, 15, "I/O on A only (A optimized)")
        view = {p["path"]: p for p in ctrl.paths_view()}
        a, b = (f"127.0.0.1:{p}" for p in ports)
        assert view[a]["ana"] == {1: "optimized"} and view[a]["serving"] == [1]
        assert view[b]["ana"] == {1: "non-optimized"} and view[b]["serving"] == []
        mount = PathsMount(ports, tmp_path).start()
        assert f"{a} live" in mount.status() and "n1 optimized*" in mount.status()
        load = Load(ctrl)
        load.start()
        bench = subprocess.Popen(
            [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(ports[0]),
             "--path", f"127.0.0.1:{ports[1]}", "-n", NQN, "-q", HOSTNQN, "--provider",
             "soft", "-k", "3", "-c", "1", "-l", "30", "--size", "16M", "--verify", "crc32c",
             "--rw", "randrw", "--bs", "4k", "--iodepth", "8", "--runtime", "18", "-o",
             "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fio = subprocess.Popen(
            ["fio", "--name=verify", f"--filename={mount.file('n1')}", "--rw=write",
             "--bs=64k", "--offset=16m", "--size=16m", "--rate=1m", "--ioengine=psync",
             "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
             "--verify_state_save=0", "--output-format=terse"], cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)
        # -- SIGKILL the optimized gateway: I/O moves to B --------------------------------
        killed = time.monotonic()
        procs[0].proc.send_signal(signal.SIGKILL)
        procs[0].proc.wait(5)
        wait_for(lambda: ctrl._serving.get(1) == {1}, 10, "I/O moved to B")
        wait_for(lambda: load.done and load.done[-1] > killed, 15, "I/O flowing on B")
        flowing = load.first_after(killed)
        took = wait_for(lambda: ctrl.path_state(1, 1) == AnaState.OPTIMIZED, 15,
                        "B optimized") + (time.monotonic() - killed)
        # -- restart A: it takes group 1 back, I/O follows -------------------------------
        time.sleep(1.0)
        restarted = time.monotonic()
        procs[0] = TargetProc(confs[0], tmp_path).start()
        wait_for(lambda: ctrl._serving.get(1) == {0}, 30, "failback to A")
        failback = time.monotonic() - restarted
        after = len(load.done)
        time.sleep(0.5)
        assert len(load.done) > after, "I/O flows after failback"
        load.stop.set()
        load.join(10)
        rec = ctrl.recovery_stats()
        out, err = bench.communicate(timeout=60)
        fout, ferr = fio.communicate(timeout=90)
        status = mount.status()
        print(f"\nmultipath: SIGKILL of the optimized gateway -> I/O flowing on the other "
              f"path {flowing:.3f} s (B reports optimized after {took:.2f} s); restart -> "
              f"failback (I/O on A again) {failback:.2f} s; library {len(load.done)} I/Os; "
              f"recovery {rec}")
        print(status)
        assert not load.errors, load.errors[:5]
        assert rec["failovers"] >= 1 and rec["failbacks"] >= 1 and rec["failed"] == 0, rec
        assert bench.returncode == 0, err
        import json
        result = json.loads(out)
        job = result["jobs"][0]
        assert job["error"] == 0 and not job["blockfabric"]["errors"], job["blockfabric"]
        assert job["blockfabric"]["verified_blocks"] > 0
        assert result["blockfabric"]["recovery"][0]["failovers"] >= 1
        assert fio.returncode == 0, fout + ferr + "\nmount log:\n" + mount.log()
        assert "failover    " in status and "failed 0" in status, status
        assert mount.counter("errors") == 0, mount.log()
    finally:
        if mount is not None:
            mount.cleanup()
        if bench is not None and bench.poll() is None:
            bench.kill()
        if ctrl is not None:
            ctrl.close()
        for p in procs:
            p.stop()
            assert "Traceback" not in p.log, p.log
        _remove(ceph, image)


def test_host_multipath_steers_by_ana_state_and_reroutes_ana_statuses(ceph, tmp_path):
    """Gateways that report the groups they do not own **inaccessible**: the host sends
    nothing down that path.  With a stale ANA log (a change it has not read yet) it does,
    gets ANA Inaccessible (0x302) back, re-issues those commands on the optimized path and
    re-reads the log.  With the optimized gateway SIGKILLed no path may serve the group:
    I/O is held, not failed, until the survivor takes the group and says so by an ANA
    change event."""
    image, group = _image(ceph), f"g{uuid.uuid4().hex[:6]}"
    ports = free_port(), free_port()
    confs = [gateway_config(ceph, [image], ports[0], "gw-a", group, (1, 99), [1],
                            others="inaccessible"),
             gateway_config(ceph, [image], ports[1], "gw-b", group, (100, 199), [],
                            others="inaccessible")]
    procs = [TargetProc(c, tmp_path).start() for c in confs]
    try:
        with Controller(ConnectOptions("127.0.0.1", NQN, ports[0], provider="soft",
                                       hostnqn=HOSTNQN, paths=[("127.0.0.1", ports[1])],
                                       keep_alive_tmo=3, reconnect_delay=0.5,
                                       ctrl_loss_tmo=30)).connect() as ctrl:
            wait_for(lambda: ctrl._serving.get(1) == {0}, 15, "I/O on A only")
            a, b = ctrl.path_ctrls
            assert [p["ana"] for p in ctrl.paths_view()] == [{1: "optimized"},
                                                             {1: "inaccessible"}]
            ns = ctrl.namespaces[1]
            data = bytes(range(256)) * 16
            ns.write(0, data)

            def b_io() -> int:
                return sum(st["submitted"] for qid, st in b.queue_stats().items() if qid)
            before = b_io()
            for _ in range(16):
                assert ns.read(0, 4096) == data
            assert b_io() == before, "I/O went down the inaccessible path"
            # -- a stale log: B believed optimized, answers 0x302, the host re-routes --------
            chgcnt, groups = b.ana_log
            b.ana_log = (chgcnt, [dataclasses.replace(g, state=AnaState.OPTIMIZED)
                                  for g in groups])
            ctrl._rerank("test: an ANA change not read yet")
            assert ctrl._serving[1] == {0, 1}
            for _ in range(16):
                assert ns.read(0, 4096) == data
            rec = ctrl.recovery_stats()
            assert b_io() > before and rec["path_errors"] >= 1 and rec["failed"] == 0, rec
            wait_for(lambda: ctrl._serving.get(1) == {0}, 10, "B out of the route again")
            assert ctrl.path_state(1, 1) == AnaState.INACCESSIBLE
            # -- A killed: nothing may serve group 1 until B takes it ------------------------
            box: dict = {}
            procs[0].proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            reader = threading.Thread(target=lambda: box.update(data=ns.read(0, 4096)))
            reader.start()
            reader.join(30)
            took = time.monotonic() - killed
            assert box.get("data") == data, box
            assert ctrl.path_state(1, 1) == AnaState.OPTIMIZED and ctrl._serving[1] == {1}
            rec = ctrl.recovery_stats()
            print(f"\ninaccessible survivor: read held {took:.2f} s until B took the group; "
                  f"recovery {rec}")
            assert rec["failed"] == 0 and rec["held"] >= 1, rec
    finally:
        for p in procs:
            p.stop()
            assert "Traceback" not in p.log, p.log
        _remove(ceph, image)

"""The reactor's spin as the real daemon reports it: ``blockfabric-target status`` (text and
JSON) shows spin_us, the CPU-pressure limit and the counters, and they move the way the
depth-aware spin says: a QD16 load over NVMe/TCP brings several commands per receive, so
the target skips spins for depth; a QD1 load has it spin (hits or misses)."""

from __future__ import annotations

import subprocess
import time

from helpers.targetstatus import settled, status

from blockfabric.initiator.host import connect

from .conftest import BIN, HOSTNQN, NQN, TargetProc, free_port, ram_config


def _bench(port: int, qd: int) -> None:
    out = subprocess.run([str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(port),
                          "-n", NQN, "-t", "tcp", "--rw", "randread", "--bs", "4k",
                          "--iodepth", str(qd), "--runtime", "1", "--size", "16MiB",
                          "--eta", "never"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_status_shows_the_spin_and_its_depth_skips(tmp_path):
    port = free_port()
    config = ram_config(port, transport="tcp")
    # one reactor: the coordinator's loop serves the I/O queue (status shows its spin)
    config.update(reactors=1, spin_us=200, control_socket=str(tmp_path / "control.sock"))
    # the pressure guard off (it has unit tests): a loaded machine must not hide the spins
    proc = TargetProc(config, tmp_path, env={"BLOCKFABRIC_REACTOR_SPIN_LOAD": "100"}).start()
    sock = config["control_socket"]
    try:
        spin = status(sock)["spin"]
        assert spin["spin_us"] == 200 and spin["load_limit"] == 100
        assert spin["skips_pressure"] == 0

        _bench(port, 16)
        spin = settled(sock, lambda st: st["spin"]["skips_depth"] > 0)["spin"]
        assert spin["skips_depth"] > 0, spin         # QD16: commands came several at once
        spun = spin["hits"] + spin["misses"]

        _bench(port, 1)
        spin = settled(sock, lambda st: st["spin"]["hits"] + st["spin"]["misses"] > spun)["spin"]
        assert spin["hits"] + spin["misses"] > spun, spin      # QD1: the target spins
        assert spin["skips_pressure"] == 0

        text = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", sock],
                              capture_output=True, text=True, timeout=20, check=True).stdout
        assert "reactor spin: 200 us (none above 100 % CPU pressure)" in text, text
        assert "skipped: depth " in text and " pressure 0" in text, text
    finally:
        proc.stop()
    assert "Traceback" not in proc.log, proc.log


def test_an_idle_controller_makes_neither_loop_spin(tmp_path, monkeypatch):
    """The admin queue holds Asynchronous Event Requests for good, on both ends: an idle
    controller (keep-alives every half second and nothing else) must not make either loop
    spin at each of its wake-ups, which is all an idle connection would then do."""
    port = free_port()
    config = ram_config(port, transport="tcp")
    config.update(reactors=1, spin_us=200, control_socket=str(tmp_path / "control.sock"))
    # the pressure guard off on both ends (it has unit tests): only the AERs may stop a spin
    monkeypatch.setenv("BLOCKFABRIC_REACTOR_SPIN_LOAD", "100")
    monkeypatch.setenv("BLOCKFABRIC_REACTOR_SPIN_US", "200")
    proc = TargetProc(config, tmp_path, env={"BLOCKFABRIC_REACTOR_SPIN_LOAD": "100"}).start()
    sock = config["control_socket"]
    try:
        with connect("127.0.0.1", NQN, port, transport="tcp", hostnqn=HOSTNQN,
                     nr_io_queues=1, keep_alive_tmo=1.0) as ctrl:
            admin_before = ctrl.queue_stats()[0]["completed"]
            host_before = ctrl.reactor.spin_stats()
            target_before = status(sock)["spin"]
            time.sleep(2.0)                 # about four keep-alives, each way a wake-up
            host = ctrl.reactor.spin_stats()
            target = status(sock)["spin"]
            keep_alives = ctrl.queue_stats()[0]["completed"] - admin_before
        assert keep_alives >= 2, keep_alives            # (so the loops did wake up)
        assert host["spin_us"] == 200 and target["spin_us"] == 200
        for key in ("hits", "misses"):
            assert host[key] == host_before[key], (host_before, host)
            assert target[key] == target_before[key], (target_before, target)
    finally:
        proc.stop()
    assert "Traceback" not in proc.log, proc.log

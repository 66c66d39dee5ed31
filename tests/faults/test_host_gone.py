"""A host that vanishes mid-command (SIGKILL: its QPs die) or stops answering (SIGSTOP past
the target's keep-alive timeout) leaves nothing held on the target: no connection, no
controller, no command in flight, no bounce buffer.  The paused one, once resumed,
reconnects and finishes its verify run with no error and no wrong byte."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers.targetstatus import settled, status

from e2e.conftest import addr_of, cli_via

from .conftest import HOSTNQN, NQN, REACTORS, TargetProc, file_config, free_port

BIN = pathlib.Path(sys.executable).parent
LOAD = pathlib.Path(__file__).with_name("verifyload.py")


def at_rest(st: dict) -> bool:
    res = st["resources"]
    return (not st["controllers"] and res["connections"] == 0
            and res["commands_in_flight"] == 0 and res["bounce_buffers_in_use"] == 0
            and res["bounce_waiters"] == 0)


def problems(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if "Traceback" in line or "ERROR" in line or "WARNING" in line][:20]


def wait_at_rest(sock: pathlib.Path, timeout: float) -> dict:
    return settled(sock, at_rest, timeout)


@pytest.fixture(params=REACTORS, ids=lambda n: f"{n}r")
def target(tmp_path, request):
    """One process, then two poll groups (the I/O queues in the worker: what it holds is
    in status' resources too)."""
    port = free_port()
    config = file_config(port, tmp_path / "vol.img", reactors=request.param)
    config["control_socket"] = str(tmp_path / "ctl.sock")
    proc = TargetProc(config, tmp_path).start()
    proc.port, proc.sock = port, tmp_path / "ctl.sock"
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log, proc.log


def start_host(port: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(LOAD), "--traddr", addr_of(), *cli_via(), "--port", str(port),
         "--nqn", NQN, "--hostnqn", HOSTNQN, "--seconds", str(seconds), "--threads", "8",
         "--queues", "2", "--kato", "1", "--ctrl-loss-tmo", "20", "--region-blocks", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_busy(proc: subprocess.Popen) -> None:
    assert "connected" in proc.stderr.readline()
    time.sleep(1.0)                                 # many commands in flight by now


@pytest.mark.timeout(60)
def test_sigkilled_host_frees_everything(target):
    host = start_host(target.port, 30)
    try:
        wait_busy(host)
        assert status(target.sock)["controllers"], "the host never connected"
        host.send_signal(signal.SIGKILL)
        host.wait(10)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    st = wait_at_rest(target.sock, 5)
    assert at_rest(st), (st["resources"], problems(target.log))
    assert target.alive()


@pytest.mark.timeout(60)
def test_paused_host_is_dropped_then_reconnects_and_loses_nothing(target):
    host = start_host(target.port, 6)
    try:
        wait_busy(host)
        host.send_signal(signal.SIGSTOP)
        assert target.wait_log("keep-alive timeout", 4), target.log
        st = wait_at_rest(target.sock, 3)
        assert at_rest(st), st["resources"]
        host.send_signal(signal.SIGCONT)
        out, err = host.communicate(timeout=40)
    finally:
        if host.poll() is None:
            host.send_signal(signal.SIGCONT)
            host.kill()
            host.wait()
    result = json.loads(out)
    assert host.returncode == 0, err
    assert result["errors"] == 0 and result["mismatches"] == 0, result
    rec = result["recovery"]
    assert rec["reconnects"] >= 1 and rec["retried"] >= 1, rec

"""Faults on loopback while a verify workload runs through the host library: the target
SIGKILLed and restarted, paused past keep-alive, its connections cut, a path lost for good.
Each test shows from the host's counters that I/O was held and re-issued across the fault."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from blockfabric.initiator.host import ControllerLost, CtrlState

from e2e.conftest import cli_via

from .conftest import host
from .proxy import THROUGH_A_PROXY, TcpProxy
from .verifyload import verify_load

pytestmark = pytest.mark.timeout(60)
BIN = pathlib.Path(sys.executable).parent


AFTER = 1.0     # s the load goes on at least after fault() returned ...
AFTER_IOS = 8   # ... and until this many I/Os completed after it (up to RECOVERY s)
RECOVERY = 30.0  # (within the module's 60 s test timeout)


def run_with_fault(ctrl, fault, seconds: float = 5.0, at: float = 1.0, **kw) -> dict:
    """The verify load for ``seconds``, with ``fault()`` called ``at`` seconds in, and on
    after ``fault()`` returned for AFTER s and until AFTER_IOS I/Os completed (at most
    RECOVERY s: a host that reconnects only seconds after a slow restart, as in a lab
    guest, still meets load afterwards); the result also counts the I/Os completed before
    the fault began and after ``fault()`` returned ("before", "after")."""
    result: dict = {}
    done: list[float] = []
    stop = threading.Event()
    start = time.monotonic()
    runner = threading.Thread(target=lambda: result.update(
        verify_load(ctrl, seconds + 120, stop=stop, completions=done, **kw)))
    runner.start()
    time.sleep(at)
    began = time.monotonic()
    fault()
    over = time.monotonic()
    until = max(start + seconds, over + AFTER)
    while time.monotonic() < over + RECOVERY and (
            time.monotonic() < until or sum(1 for t in done if t > over) < AFTER_IOS):
        time.sleep(0.05)
    stop.set()
    runner.join(30)
    assert not runner.is_alive(), "the workload hung"
    result["before"] = sum(1 for t in done if t < began)
    result["after"] = sum(1 for t in done if t > over)
    return result


def assert_held_and_retried(result: dict, multipath: bool = False) -> None:
    """``multipath``: the other path was connected all along, so the I/O moved to it
    without any reconnect (the lost path keeps reconnecting in the background)."""
    rec = result["recovery"]
    print(f"\nobserved: ios {result['ios']} (before the fault {result['before']}, after it "
          f"{result['after']}) errors {result['errors']} mismatches {result['mismatches']} "
          f"recovery {rec}")     # for docs/reliability.md (pytest -s)
    assert result["mismatches"] == 0, result
    assert result["errors"] == 0, result
    moved = rec["failovers"] if multipath else rec["reconnects"]
    assert moved >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, rec
    assert rec["state"] == "live" and rec["held_now"] == 0, rec
    # the load ran before the fault and went on after it (counts, not a rate: a lab guest
    # under TCG, whose target restarts in seconds, makes a few dozen I/Os where a host
    # makes thousands)
    assert result["before"] >= AFTER_IOS and result["after"] >= AFTER_IOS, result


def test_target_sigkill_and_restart_loses_nothing(any_file_target):
    with host(any_file_target.port, **any_file_target.via) as ctrl:
        def fault() -> None:
            any_file_target.kill()
            time.sleep(1.0)                     # down for a while: reconnects fail first
            any_file_target.start()
        result = run_with_fault(ctrl, fault, seconds=5.0)
        assert_held_and_retried(result)
        assert result["recovery"]["attempts"] >= 2, result["recovery"]   # one failed at least
        assert len(ctrl.io_queues) == 2               # the same number of I/O queues again


def test_target_paused_past_keep_alive_then_resumed(file_target):
    with host(file_target.port) as ctrl:
        def fault() -> None:
            file_target.signal(signal.SIGSTOP)
            time.sleep(2.5)                     # KATO is 1 s: the host must notice
            file_target.signal(signal.SIGCONT)
        result = run_with_fault(ctrl, fault, seconds=6.0)
        assert_held_and_retried(result)
        assert "keep-alive" in result["recovery"]["last_reason"] \
            or "RETRY_EXC" in result["recovery"]["last_reason"], result["recovery"]


def test_connections_cut_by_a_proxy(any_file_target, transport):
    if transport == "verbs":
        pytest.skip(THROUGH_A_PROXY.args[1])
    proxy = TcpProxy(("127.0.0.1", any_file_target.port))
    try:
        with host(proxy.port, **any_file_target.via) as ctrl:
            result = run_with_fault(ctrl, proxy.cut, seconds=4.0)
            assert_held_and_retried(result)
    finally:
        proxy.close()


@THROUGH_A_PROXY
def test_delay_slows_but_never_fails(file_target):
    """5 ms added to every chunk each way: slower, no loss detected, no errors."""
    proxy = TcpProxy(("127.0.0.1", file_target.port), delay=0.005)
    try:
        with host(proxy.port) as ctrl:
            result = verify_load(ctrl, 2.0, threads=2)
            assert result["errors"] == result["mismatches"] == 0, result
            assert result["recovery"]["losses"] == 0, result["recovery"]
            assert result["ios"] > 10, result
    finally:
        proxy.close()


@THROUGH_A_PROXY
def test_multipath_fails_over_to_the_second_listener(tmp_path, start_target):
    from .conftest import file_config, free_port
    port_a, port_b = free_port(), free_port()
    start_target(file_config(port_a, tmp_path / "vol.img", extra_ports=(port_b,)))
    proxy = TcpProxy(("127.0.0.1", port_a))
    try:
        with host(proxy.port, paths=[("127.0.0.1", port_b)]) as ctrl:
            result = run_with_fault(ctrl, proxy.down, seconds=4.0)
            assert_held_and_retried(result, multipath=True)
            rec = result["recovery"]
            assert rec["failovers"] >= 1 and rec["path"] == f"127.0.0.1:{port_b}", rec
    finally:
        proxy.close()


@THROUGH_A_PROXY
def test_bench_cli_fails_over_to_the_listener_given_with_path(tmp_path, start_target):
    """``blockfabric bench -a A -s P1 --path A:P2`` with a crc32c verify load; P1 (a proxy)
    is then taken away for good.  The bench exits 0 with no error, every block verified,
    and its JSON shows the commands held and the failover to P2."""
    from .conftest import HOSTNQN, NQN, file_config, free_port
    port_a, port_b = free_port(), free_port()
    start_target(file_config(port_a, tmp_path / "vol.img", extra_ports=(port_b,)))
    proxy = TcpProxy(("127.0.0.1", port_a))
    bench = subprocess.Popen(
        [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(proxy.port),
         "--path", f"127.0.0.1:{port_b}", "-n", NQN, "-q", HOSTNQN, *cli_via(),
         "-k", "1", "-c", "1", "-l", "20", "--rw", "randrw", "--verify", "crc32c",
         "--size", "8m", "--iodepth", "8", "--runtime", "4", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the bench connected both paths and its I/O goes through P1 too (a start slower
        # than a fixed sleep must not leave P1 dead before it was ever used)
        proxy.wait_forwarded(1 << 20)
        proxy.down()
        out, err = bench.communicate(timeout=45)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        proxy.close()
    assert bench.returncode == 0, err
    result = json.loads(out)
    bf, job = result["blockfabric"], result["jobs"][0]
    rec = bf["recovery"][0]
    print(f"\nobserved: read {job['read']['total_ios']} write {job['write']['total_ios']} "
          f"verified {job['blockfabric']['verified_blocks']} held {job['blockfabric']['held']} "
          f"recovery {rec}")                          # for docs/reliability.md (pytest -s)
    assert bf["paths"] == [f"127.0.0.1:{proxy.port}", f"127.0.0.1:{port_b}"]
    assert rec["failovers"] >= 1 and rec["path"] == f"127.0.0.1:{port_b}", rec
    assert rec["retried"] >= 1 and rec["failed"] == 0, rec
    assert job["error"] == 0 and not job["blockfabric"]["errors"], job["blockfabric"]
    assert job["blockfabric"]["held"] >= 1 and job["blockfabric"]["verified_blocks"] > 0
    assert "Traceback" not in err, err


def test_io_fails_only_after_ctrl_loss_tmo(file_target):
    """The target never comes back: held I/O fails (ControllerLost, EIO through FUSE) once
    ctrl_loss_tmo has passed, not before; new I/O then fails at once."""
    loss_tmo = 2.0
    with host(file_target.port, ctrl_loss_tmo=loss_tmo) as ctrl:
        ns = ctrl.namespaces[1]
        ns.write(0, b"x" * 4096)
        # the clock starts before the kill: the host may see the connection go while kill()
        # still waits for the process to end (slow under TCG), and its ctrl_loss_tmo runs
        # from then
        lost_at = time.monotonic()
        file_target.kill()
        rec = assert_lost_after_tmo(ctrl, loss_tmo, lost_at)
        assert rec["held"] >= 1 and rec["reconnects"] == 0, rec


def assert_lost_after_tmo(ctrl, loss_tmo: float, lost_at: float) -> dict:
    """A read fails (ControllerLost) once ctrl_loss_tmo has passed since ``lost_at``, not
    before, the controller is failed, and the next read fails at once; returns the
    recovery counters as the first failure left them."""
    ns = ctrl.namespaces[1]
    with pytest.raises(ControllerLost):
        ns.read(0, 4096)
    waited = time.monotonic() - lost_at
    assert loss_tmo <= waited < loss_tmo + 2.0, waited
    rec = ctrl.recovery_stats()
    assert rec["state"] == CtrlState.FAILED.value and rec["failed"] >= 1, rec
    started = time.monotonic()
    with pytest.raises(ControllerLost):
        ns.read(0, 4096)
    assert time.monotonic() - started < 0.5
    return rec


def test_an_idle_host_reconnects_by_itself(file_target):
    """No I/O while the target is killed and restarted: the host finds its queues gone and
    reconnects anyway (as the Linux host does), so an idle mount is connected again, and its
    controller drained on the next stop, without waiting for someone to touch it.  Seen in
    the systemd lab: the boot-time mount stayed disconnected until the next read."""
    with host(file_target.port) as ctrl:
        file_target.kill()
        file_target.start()
        deadline = time.monotonic() + 20
        while ctrl.recovery.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctrl.recovery.reconnects == 1 and ctrl.state == CtrlState.LIVE, ctrl.recovery
        assert ctrl.recovery.held == 0, ctrl.recovery          # nothing was in flight


@THROUGH_A_PROXY
def test_multipath_holds_io_until_ctrl_loss_tmo_when_no_path_is_left(tmp_path, start_target):
    """Two paths (two proxies in front of one target's two listeners), and both taken
    down: I/O has nowhere to go.  It is held, not failed: when a path is back within
    ctrl_loss_tmo the read completes with the data; with both down for good it fails
    (ControllerLost, EIO through FUSE) only once ctrl_loss_tmo has passed on every path,
    and new I/O then fails at once."""
    from .conftest import file_config, free_port
    loss_tmo = 2.5
    port_a, port_b = free_port(), free_port()
    start_target(file_config(port_a, tmp_path / "vol.img", extra_ports=(port_b,)))
    proxies = [TcpProxy(("127.0.0.1", port_a)), TcpProxy(("127.0.0.1", port_b))]
    try:
        with host(proxies[0].port, paths=[("127.0.0.1", proxies[1].port)],
                  ctrl_loss_tmo=loss_tmo) as ctrl:
            ns = ctrl.namespaces[1]
            ns.write(0, b"m" * 4096)
            # -- both paths lost, one back within ctrl_loss_tmo: no error -----------------
            for proxy in proxies:
                proxy.down()
            box: dict = {}
            reader = threading.Thread(target=lambda: box.update(data=ns.read(0, 4096)))
            reader.start()
            time.sleep(1.0)         # the read waits meanwhile: no path to send it to
            assert reader.is_alive() and not box, box
            proxies[1].up()
            reader.join(15)
            assert box.get("data") == b"m" * 4096, box
            rec = ctrl.recovery_stats()
            assert rec["state"] == "live" and rec["failed"] == 0 and rec["held"] >= 1, rec
            # -- both down for good: EIO after ctrl_loss_tmo, not before ------------------
            lost_at = time.monotonic()          # (before: as above)
            proxies[1].down()
            assert_lost_after_tmo(ctrl, loss_tmo, lost_at)
            assert [p["state"] for p in ctrl.paths_view()] == ["failed", "failed"]
    finally:
        for proxy in proxies:
            proxy.close()

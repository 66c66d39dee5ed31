"""DH-HMAC-CHAP against the real daemon: a host with the right secret connects (on every
queue) and does I/O; a wrong, missing or replayed answer is refused, the controller is torn
down, and the target and its other hosts carry on."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from blockfabric.initiator.host import (ADMIN_DEPTH, AuthenticationFailed, ConnectOptions,
                                        Controller, NvmeError, connect)
from blockfabric.protocol import (FeatureId, Identify, IdentifyCNS, IOOpcode, KeyedSGL,
                                  ReadWrite, SetFeatures, StatusCode)
from blockfabric.protocol import auth

from .conftest import (BIN, HOSTNQN, NQN, OTHER_HOSTNQN, addr_of, cli_via, free_port, listener,
                       ram_config, via)

SECRET = auth.generate_secret(32, 1)
CTRL_SECRET = auth.generate_secret(48, 2)


@pytest.fixture(scope="module")
def auth_target(tmp_path_factory):
    """HOSTNQN must authenticate (and may authenticate the controller, with ffdhe2048);
    OTHER_HOSTNQN is allowed without a secret."""
    from .conftest import TargetProc
    port, metrics = free_port(), free_port()
    config = ram_config(port, allow_any_host=False, hosts=[
        {"nqn": HOSTNQN, "dhchap_secret": str(SECRET), "dhchap_ctrl_secret": str(CTRL_SECRET),
         "dhchap_dhgroup": "ffdhe2048"},
        OTHER_HOSTNQN])
    tmp = tmp_path_factory.mktemp("auth")
    # these tests fail on purpose, many times from one address: no back-off here
    # (tests/hostile/test_auth_abuse.py tests it)
    config["limits"] = {"auth_max_failures": 1000}
    config["metrics"] = {"port": metrics}
    config["control_socket"] = str(tmp / "control.sock")
    proc_tcp_port = free_port()             # the same subsystem over NVMe/TCP
    config["listeners"].append(listener(proc_tcp_port, transport="tcp"))
    proc = TargetProc(config, tmp).start()
    proc.port, proc.metrics, proc.socket = port, metrics, config["control_socket"]
    proc.tcp_port = proc_tcp_port
    yield proc
    if proc.alive():
        proc.stop()
    assert "Traceback" not in proc.log, proc.log


DESTROYED = "destroyed (authentication failed on qid 0)"


def _wait_more(target, needle: str, before: int, timeout: float = 5) -> bool:
    """``needle`` appears in the target's log more often than ``before`` (earlier tests
    share this target's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if target.log.count(needle) > before:
            return True
        time.sleep(0.02)
    return False


def _connect(target, transport: str | None = None, **kw) -> Controller:
    kw.setdefault("hostnqn", HOSTNQN)
    return connect(addr_of(transport), NQN, target.tcp_port if transport == "tcp" else target.port,
                   **via(transport), nr_io_queues=2, **kw)


def _io(ctrl: Controller, fill: int) -> None:
    ns = ctrl.namespaces[1]
    ns.write(8192, bytes([fill]) * 4096)
    assert ns.read(8192, 4096) == bytes([fill]) * 4096


@pytest.mark.parametrize("bidirectional", [False, True], ids=["host", "bidirectional"])
def test_right_secret_connects_every_queue_and_does_io(auth_target, bidirectional, transport):
    kw = {"dhchap_ctrl_secret": str(CTRL_SECRET)} if bidirectional else {}
    with _connect(auth_target, transport, dhchap_secret=str(SECRET), **kw) as ctrl:
        assert ctrl.connect_result & auth.CONNECT_AUTHREQ_ATR
        assert sorted(ctrl.authenticated) == [0, 1, 2]      # the admin and both I/O queues
        assert all("ffdhe2048" in how for how in ctrl.authenticated.values())
        assert ("controller authenticated" in ctrl.authenticated[0]) == bidirectional
        _io(ctrl, 0x11 if bidirectional else 0x22)
        status = _status(auth_target)
        (mine,) = [c for c in json.loads(status)["controllers"] if c["hostnqn"] == HOSTNQN]
        assert mine["auth_required"] and mine["authenticated_queues"] == [0, 1, 2]
        assert str(SECRET).split(":")[2] not in status        # never a secret
        assert str(CTRL_SECRET).split(":")[2] not in status
    assert auth_target.wait_log("host authenticated (hash sha256, DH group ffdhe2048)"
                                + ("; it authenticated the controller too" if bidirectional
                                   else "\n"), 5)


def test_wrong_secret_is_refused_and_others_carry_on(auth_target, transport):
    warning = ("authentication failed: the host's response does not match (wrong secret?) "
               "(explanation 0x1): tearing the controller down")
    before = auth_target.log.count(warning)
    with _connect(auth_target, transport, hostnqn=OTHER_HOSTNQN) as bystander:
        _io(bystander, 0x33)
        with pytest.raises(AuthenticationFailed, match="refused authentication"):
            _connect(auth_target, transport, dhchap_secret=str(auth.generate_secret(32, 1)))
        assert _wait_more(auth_target, warning, before)
        _io(bystander, 0x44)                 # the other host never noticed
        with _connect(auth_target, transport, dhchap_secret=str(SECRET)) as good:
            _io(good, 0x55)
    assert auth_target.alive()
    assert _failures(auth_target) >= 1


def _status(target) -> str:
    out = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", target.socket,
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _failures(target) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{target.metrics}/metrics",
                                  timeout=5).read().decode()
    (line,) = [x for x in text.splitlines()
               if x.startswith("blockfabric_auth_failures_total ")]
    return float(line.split()[1])


def test_host_without_a_secret_may_not_start_an_exchange(auth_target):
    """A host listed without a secret is never asked to authenticate; an Auth Send from it
    is an unknown command there (as nvmet without authentication), on either queue, and
    costs it nothing else."""
    with _connect(auth_target, hostnqn=OTHER_HOSTNQN) as ctrl:
        assert not ctrl.connect_result & auth.CONNECT_AUTHREQ_ATR and not ctrl.authenticated
        for queue in (ctrl.admin, ctrl.io_queues[0]):
            with pytest.raises(NvmeError) as err:
                ctrl.auth_send(queue, auth.Negotiate.offer(1, (1,), (0,)).pack())
            assert (err.value.status, err.value.dnr) == (StatusCode.INVALID_OPCODE, True)
            with pytest.raises(NvmeError) as err:
                ctrl.auth_receive(queue, 4096)
            assert err.value.status == StatusCode.INVALID_OPCODE
        _io(ctrl, 0x99)


def test_controller_impostor_is_refused_by_the_host(auth_target):
    """The host asks the controller to prove it holds a controller secret it does not."""
    warning = "authentication failed: the host gave up (Failure2, explanation 0x1)"
    before = auth_target.log.count(warning)
    with pytest.raises(AuthenticationFailed, match="controller's response does not match"):
        _connect(auth_target, dhchap_secret=str(SECRET),
                 dhchap_ctrl_secret=str(auth.generate_secret(48, 2)))
    assert _wait_more(auth_target, warning, before)


def test_no_secret_is_refused_with_a_clear_error(auth_target):
    with pytest.raises(AuthenticationFailed, match="requires host .* to authenticate"):
        _connect(auth_target)


def _admin_queue(target, transport: str | None = None) -> tuple[Controller, object]:
    """A controller object with only its admin queue connected, not authenticated."""
    ctrl = Controller(ConnectOptions(
        addr_of(transport), NQN, target.tcp_port if transport == "tcp" else target.port,
        hostnqn=HOSTNQN, **via(transport), dhchap_secret=str(SECRET)))
    ctrl.reactor.start()
    queue = ctrl.open_queue(0, ADMIN_DEPTH)
    ctrl.admin = queue
    ctrl.cntlid = ctrl.fabrics_connect(queue, 0, ADMIN_DEPTH - 1, 0, authenticate=False)
    return ctrl, queue


def test_commands_before_authentication_are_auth_required(auth_target):
    ctrl, queue = _admin_queue(auth_target)
    try:
        assert ctrl.connect_result & auth.CONNECT_AUTHREQ_ATR
        assert ctrl.property_get(0x00, 8)            # Fabrics commands pass (nvmet does too)
        with pytest.raises(NvmeError) as err:
            ctrl.wait(queue, Identify(cns=IdentifyCNS.CONTROLLER).to_sqe(), "Identify",
                      data_in=4096)
        assert (err.value.status, err.value.dnr) == (StatusCode.AUTH_REQUIRED, True)
        with pytest.raises(NvmeError) as err:        # not our protocol: refused, DNR
            ctrl.wait(queue, auth.AuthSend(secp=0xEA, tl=72).to_sqe(), "Authentication Send",
                      data_out=auth.Negotiate.offer(1, (1,), (0, 1)).pack())
        assert (err.value.status, err.value.dnr) == (StatusCode.INVALID_FIELD, True)
        ctrl._authenticate(queue, 0, ctrl.connect_result)  # now it may
        ctrl._enable()
        assert len(ctrl._identify(IdentifyCNS.CONTROLLER)) == 4096
    finally:
        ctrl.close()


def test_replayed_reply_is_refused(auth_target):
    """A Reply captured from one host's transaction does not answer another challenge."""
    first, queue = _admin_queue(auth_target)
    captured: list[bytes] = []
    try:
        auth.host_authenticate(lambda m: (captured.append(m), first.auth_send(queue, m)),
                               lambda al: first.auth_receive(queue, al), t_id=7,
                             hostnqn=HOSTNQN, subnqn=NQN, secret=SECRET)
    finally:
        first.close()
    destroyed_before = auth_target.log.count(DESTROYED)
    replay, queue = _admin_queue(auth_target)
    try:
        replay.auth_send(queue, captured[0])           # the same Negotiate
        fresh = auth.Challenge.unpack(replay.auth_receive(queue, 4096))
        replay.auth_send(queue, captured[1])           # the old Reply
        answer = replay.auth_receive(queue, 4096)
        assert auth.failure_of(answer).rescode_exp == auth.Explanation.FAILED, fresh
        assert _wait_more(auth_target, DESTROYED, destroyed_before)
        with pytest.raises((NvmeError, ConnectionError)):    # and the host sees it gone
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                replay.property_get(0x1C, 4)
                time.sleep(0.01)
    finally:
        replay.close()


def test_forged_reply_is_refused(auth_target):
    """A reply computed with the right key but for another subsystem NQN (what a host could
    get another controller to sign) fails."""
    forger, queue = _admin_queue(auth_target)
    try:
        with pytest.raises(auth.AuthError, match="refused authentication"):
            auth.host_authenticate(lambda m: forger.auth_send(queue, m),
                                   lambda al: forger.auth_receive(queue, al), t_id=1,
                                 hostnqn=HOSTNQN, subnqn=NQN + "-other", secret=SECRET)
    finally:
        forger.close()


def test_unauthenticated_io_queue_is_refused(auth_target, transport):
    """I/O queues authenticate on their own: an authenticated admin queue does not let an
    unauthenticated I/O queue run I/O."""
    ctrl, admin = _admin_queue(auth_target, transport)
    try:
        ctrl._authenticate(admin, 0, ctrl.connect_result)
        ctrl._enable()
        ctrl.wait(admin, SetFeatures(fid=FeatureId.NUM_QUEUES, value=0).to_sqe(),
                  "Set Features (number of queues)")
        ctrl.inline_size = 4096                     # the target's default in-capsule size
        queue = ctrl.open_queue(1, 16)
        ctrl.io_queues.append(queue)
        ctrl.fabrics_connect(queue, 1, 15, 0, authenticate=False)
        assert ctrl.connect_result & auth.CONNECT_AUTHREQ_ATR
        arena = ctrl.arena
        read = ReadWrite(IOOpcode.READ, 1, 0, 0).to_sqe(
            sgl=KeyedSGL(arena.mr.addr, 4096, arena.mr.rkey))
        cqe = ctrl.raw(queue, read.pack())
        assert (cqe.status, cqe.dnr) == (StatusCode.AUTH_REQUIRED, True)
        # the kernel host's Auth Send on an I/O queue may come as in-capsule data
        auth.host_authenticate(
            lambda m: ctrl.wait(queue, auth.AuthSend(tl=len(m)).to_sqe(), "Authentication Send",
                                data_out=m, inline=True),
            lambda al: ctrl.auth_receive(queue, al), t_id=9, hostnqn=HOSTNQN, subnqn=NQN,
            secret=SECRET, ctrl_secret=CTRL_SECRET)
        assert ctrl.raw(queue, read.pack()).status == StatusCode.SUCCESS
    finally:
        ctrl.close()


def test_cli_connect_with_and_without_the_secret(auth_target):
    from .test_cli_and_identity import cli
    base = ["connect", "-a", addr_of(), "-s", str(auth_target.port), "-n", NQN,
            "-q", HOSTNQN, *cli_via(), "-o", "json"]
    ok = cli(*base, "--dhchap-secret", str(SECRET), "--dhchap-ctrl-secret", str(CTRL_SECRET))
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(ok.stdout)
    assert shown["authentication"] == ("hmac(sha256), ffdhe2048, controller authenticated")
    bad = cli(*base, "--dhchap-secret", str(auth.generate_secret(32, 1)))
    assert bad.returncode == 1
    assert "DH-HMAC-CHAP authentication with" in bad.stderr
    assert "refused authentication (failed)" in bad.stderr and "Traceback" not in bad.stderr
    none = cli(*base)
    assert none.returncode == 1 and "--dhchap-secret" in none.stderr, none.stderr


def test_reconnect_authenticates_again(start_target):
    """After the target restarts, the host's reconnect runs the exchange again on every
    queue, and held I/O completes."""
    import signal
    port = free_port()
    config = ram_config(port, allow_any_host=False, hosts=[
        {"nqn": HOSTNQN, "dhchap_secret": str(SECRET)}])
    first = start_target(config)
    first.port = port
    with _connect(first, dhchap_secret=str(SECRET), keep_alive_tmo=1.0, reconnect_delay=0.3,
                  connect_timeout=1.0, ctrl_loss_tmo=20) as ctrl:
        _io(ctrl, 0x77)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = start_target(config)
        _io(ctrl, 0x88)                       # held until the reconnect, then re-issued
        assert ctrl.recovery_stats()["reconnects"] >= 1
        # admin + 2 I/O queues (the log is read by another thread: wait for it)
        assert _wait_more(second, "host authenticated", 2)
        assert second.log.count("host authenticated") == 3


@pytest.mark.parametrize("mode", ["end", "silent"])
def test_controller_that_ends_instead_of_sending_failure1(tmp_path, mode):
    """Linux nvmet ends the controller as it answers a wrong response with Failure1, and the
    disconnect may overtake the message (the lab saw it: B/auth-wrong-secret).  The host
    must call that a failed authentication, with a reason, not a bare timeout: ``end``, the
    queue dies at once; ``silent``, no answer comes within connect_timeout."""
    from .conftest import TargetProc
    port = free_port()
    config = ram_config(port, allow_any_host=False,
                        hosts=[{"nqn": HOSTNQN, "dhchap_secret": str(SECRET)}])
    here = pathlib.Path(__file__).parent
    target = TargetProc(config, tmp_path, env={"NVMET_LIKE": mode},
                        command=[sys.executable, str(here / "nvmet_like_target.py")]).start()
    target.port = port
    try:
        t0 = time.monotonic()
        # (the soft provider flushes the receives as the event arrives: either may tell first)
        why = ("the target disconnected|work completion WR_FLUSH_ERR" if mode == "end"
               else "no answer from the target within 2 s")
        with pytest.raises(AuthenticationFailed, match=f"ended the exchange without an answer "
                           f"\\(Authentication Receive: ({why})\\); .* check the secret"):
            _connect(target, dhchap_secret=str(auth.generate_secret(32, 1)), connect_timeout=2)
        elapsed = time.monotonic() - t0
        assert elapsed < (1.5 if mode == "end" else 4), elapsed
        assert target.wait_log("nvmet-like: " + ("controller ended" if mode == "end"
                                                 else "Authentication Receive"), 5)
        with _connect(target, dhchap_secret=str(SECRET)) as good:    # the target carries on
            _io(good, 0x66)
    finally:
        target.stop()
    assert "Traceback" not in target.log, target.log

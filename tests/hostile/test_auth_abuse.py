"""Abuse of DH-HMAC-CHAP and of keep-alive against a live target (issue 13, class 5).

Repeated wrong answers on one connection used to go on for ever, never logged nor counted:
now a wrong answer ends the controller (whatever the host sends next), is logged with the
peer address and the (escaped) host NQN, and counts in ``blockfabric_auth_failures_total``;
``limits.auth_max_failures`` failures from one address within ``limits.auth_failure_window``
make the target refuse that address's authenticating Connects for ``limits.auth_backoff``.
A controller that never authenticates ends after ``limits.auth_timeout``; the keep-alive
timeout a Connect asks for is capped at ``keep_alive.max_timeout_ms``, and KATO 0 does not
let an unused controller live for ever."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from blockfabric.initiator.host import AuthenticationFailed, NvmeError, connect
from blockfabric.protocol import (ConnectData, FeatureId, GetFeatures, Property, SetFeatures,
                                  StatusCode)
from blockfabric.protocol import auth

from e2e.conftest import BIN, addr_of, via
from .attacker import ATTACKER, admin_queue, attacker, raw_connect
from .conftest import (HOSTNQN, MAX_CONN, NQN, OTHER_HOSTNQN, TargetProbe,
                       assert_accepts_new_host, assert_undisturbed, free_port, ram_config)

SECRET = auth.generate_secret(32, 1)
#: a host allowed without a secret (the bystander is another one)
KEEPER = "nqn.2026-12.io.blockfabric:keeper"
AUTH_TIMEOUT = 2
MAX_FAILURES = 3
BACKOFF = 3
KATO_CAP_MS = 3000


@pytest.fixture
def target(start_target, tmp_path, request):
    """HOSTNQN must authenticate; OTHER_HOSTNQN (the bystander) and KEEPER need not.
    Parametrize indirectly with {"limits": {...}, "keep_alive": {...}} to change more."""
    extra = getattr(request, "param", {})
    port, metrics = free_port(), free_port()
    config = ram_config(port, allow_any_host=False, hosts=[
        {"nqn": HOSTNQN, "dhchap_secret": str(SECRET)}, OTHER_HOSTNQN, KEEPER])
    config["limits"] = {"max_connections_per_host": MAX_CONN, "auth_timeout": AUTH_TIMEOUT,
                        "auth_max_failures": MAX_FAILURES, "auth_failure_window": 60,
                        "auth_backoff": BACKOFF, **extra.get("limits", {})}
    if "keep_alive" in extra:
        config["keep_alive"] = extra["keep_alive"]
    config["metrics"] = {"port": metrics}
    config["control_socket"] = str(tmp_path / "control.sock")
    proc = start_target(config)
    proc.port, proc.metrics, proc.socket = port, metrics, config["control_socket"]
    return proc


def failures(target) -> tuple[float, int]:
    """blockfabric_auth_failures_total, and status's auth_failures."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{target.metrics}/metrics",
                                  timeout=5).read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("blockfabric_auth_failures_total ")]
    out = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", target.socket,
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=20, check=True)
    return float(line.split()[1]), json.loads(out.stdout)["auth_failures"]


def admin_connect(ctrl, hostnqn: str = HOSTNQN, kato: int = 5000):
    queue = admin_queue(ctrl)
    got = raw_connect(ctrl, queue, ConnectData(hostid=bytes(16), subnqn=NQN, hostnqn=hostnqn),
                      kato=kato)
    assert got[0] == StatusCode.SUCCESS, got
    return queue, got[2]


def ended_within(ctrl, seconds: float, keep_alive: bool = True) -> float | None:
    """Seconds until the target ends ``ctrl``'s admin queue (None: still there), sending a
    Property Get every 0.2 s when ``keep_alive`` (which any host may send before it
    authenticates) or just watching."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if keep_alive:
                ctrl.property_get(Property.CSTS, 4)
            elif ctrl.admin.dead_reason:
                raise ConnectionError(ctrl.admin.dead_reason)
        except (NvmeError, ConnectionError, TimeoutError):
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def wait_lines(target, needle: str, count: int, timeout: float = 5) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in target.lines if needle in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", ["wrong", "none"])
def test_starting_over_on_one_connection_ends_it(target, bystander, answer):
    """Negotiate, a challenge, then Negotiate again, ... (20 times on base):
    - after a wrong Reply (instead of fetching Failure1), the second Negotiate ends the
      controller;
    - with no Reply at all, the third does (one start over is a host's whose first start
      went unanswered).  Each challenge with a DH group costs a Diffie-Hellman key pair on
      the target's loop: a peer that knows only a host NQN with a secret kept it busy
      (about 160 ffdhe2048 challenges a second, 5 ms each) until auth_timeout."""
    probe = TargetProbe(target)
    ctrl = attacker(target.port, NQN, HOSTNQN)
    rounds = 0
    try:
        with bystander.attack(f"DH-HMAC-CHAP started over on one connection ({answer})"):
            queue, result = admin_connect(ctrl)
            assert result & auth.CONNECT_AUTHREQ_ATR
            # (the Receive may still get the Failure1 before the controller is gone)
            with pytest.raises((NvmeError, ConnectionError, TimeoutError, auth.AuthError)):
                for t_id in range(1, 21):
                    ctrl.auth_send(queue, auth.Negotiate.offer(t_id, (1,), (0,)).pack())
                    auth.Challenge.unpack(ctrl.auth_receive(queue, 4096))
                    if answer == "wrong":
                        ctrl.auth_send(queue, auth.Reply(t_id, bytes(32)).pack())
                    rounds += 1
            assert rounds == (1 if answer == "wrong" else 2)
    finally:
        ctrl.close()
    (line,) = wait_lines(target, "authentication failed:", 1)
    assert line.startswith("WARNING ") and f"hostnqn={HOSTNQN} " in line, line
    assert f"peer={ATTACKER}:" in line, line
    assert ("does not match" if answer == "wrong" else "without an answer") in line, line
    assert wait_lines(target, "destroyed (authentication failed on qid 0)", 1)
    assert failures(target) == (1, 1)
    assert_undisturbed(bystander.finish(), bystander)
    probe.assert_bounded()
    assert_accepts_new_host(target.port, KEEPER)


@pytest.mark.timeout(60)
def test_a_failed_io_queue_costs_only_that_queue(target, bystander):
    """An I/O queue that fails its exchange (someone joining a controller with a queue it
    cannot authenticate) ends alone: the authenticated admin queue and controller stay,
    and a new I/O queue may still authenticate and do I/O."""
    probe = TargetProbe(target)
    ctrl = attacker(target.port, NQN, HOSTNQN, dhchap_secret=str(SECRET))
    try:
        with bystander.attack("wrong answer on an I/O queue"):
            queue, result = admin_connect(ctrl)
            ctrl.cntlid = result & 0xFFFF
            ctrl._authenticate(queue, 0, result)
            ctrl._enable()
            ctrl.wait(queue, SetFeatures(fid=FeatureId.NUM_QUEUES, value=1 << 16 | 1).to_sqe(),
                      "Set Features (number of queues)")
            ctrl.inline_size = 0
            bad = ctrl.open_queue(1, 16)
            ctrl.fabrics_connect(bad, 1, 15, 0, authenticate=False)
            ctrl.auth_send(bad, auth.Negotiate.offer(5, (1,), (0,)).pack())
            ctrl.auth_receive(bad, 4096)
            ctrl.auth_send(bad, auth.Reply(5, bytes(32)).pack())        # wrong
            with pytest.raises((NvmeError, ConnectionError, TimeoutError, auth.AuthError)):
                ctrl.auth_send(bad, auth.Negotiate.offer(6, (1,), (0,)).pack())
                ctrl.auth_receive(bad, 4096)
                ctrl.auth_receive(bad, 4096)
            assert ctrl.property_get(Property.CSTS, 4) & 1          # the controller lives
            good = ctrl.open_queue(2, 16)
            ctrl.io_queues.append(good)
            ctrl.fabrics_connect(good, 2, 15, 0)                    # authenticates
            ctrl.rescan()
            ns = ctrl.namespaces[1]                     # (away from the bystander's blocks)
            ns.write(4096 * 1002, b"\xa5" * 4096)
            assert ns.read(4096 * 1002, 4096) == b"\xa5" * 4096
    finally:
        ctrl.close()
    (line,) = wait_lines(target, "authentication failed:", 1)
    assert "qid=1" in line and line.endswith("tearing the queue down\n"), line
    assert "destroyed (authentication" not in target.log          # only the queue went
    assert wait_lines(target, "qid=1: authentication failed on qid 1", 1)
    assert failures(target) == (1, 1)
    assert_undisturbed(bystander.finish(), bystander)
    probe.assert_bounded()


@pytest.mark.timeout(60)
def test_failed_authentications_from_one_address_are_backed_off(target, bystander):
    """Three wrong secrets from one address: its next authenticating Connects get
    CONNECT_CTRL_BUSY (no DNR: later is fine) until the back-off is over, even with the
    right secret; other addresses, and hosts that need no authentication, are not
    affected."""
    probe = TargetProbe(target)

    def guess(secret, source: str = ATTACKER, hostnqn: str = HOSTNQN):
        ctrl = attacker(target.port, NQN, hostnqn, source=source, start=False,
                        dhchap_secret=str(secret), nr_io_queues=1)
        return ctrl.connect()

    with bystander.attack("guessing secrets from one address"):
        for _ in range(MAX_FAILURES):
            with pytest.raises(AuthenticationFailed):
                guess(auth.generate_secret(32, 1))
        blocked_at = time.monotonic()
        for secret in (auth.generate_secret(32, 1), SECRET):
            with pytest.raises(NvmeError) as err:
                guess(secret)
            assert (err.value.status, err.value.dnr) == (StatusCode.CONNECT_CTRL_BUSY, False)
        with guess(SECRET, source=addr_of()):         # another address: unaffected
            pass
        with attacker(target.port, NQN, KEEPER, start=False, nr_io_queues=1).connect():
            pass                                        # no authentication: unaffected
        time.sleep(max(0.0, blocked_at + BACKOFF + 0.2 - time.monotonic()))
        with guess(SECRET) as ctrl:                     # the back-off is over
            ns = ctrl.namespaces[1]                     # (away from the bystander's blocks)
            ns.write(4096 * 1001, b"\x5a" * 4096)
            assert ns.read(4096 * 1001, 4096) == b"\x5a" * 4096
    (line,) = wait_lines(target, "failed authentications within 60 s", 1)
    assert line.startswith(f"WARNING blockfabric.target.sessions: peer {ATTACKER}: 3 "), line
    assert f"for {BACKOFF} s" in line
    assert failures(target) == (MAX_FAILURES, MAX_FAILURES)
    assert_undisturbed(bystander.finish(), bystander)
    probe.assert_bounded()
    assert_accepts_new_host(target.port, KEEPER)


@pytest.mark.timeout(60)
def test_unauthenticated_controllers_end_after_auth_timeout(target, bystander):
    """A controller kept alive with Property Gets that never authenticates, and one that
    answered wrong and never fetches its Failure1: each ends ``limits.auth_timeout`` after
    its Connect (or its failure), logged and counted."""
    probe = TargetProbe(target)
    silent = attacker(target.port, NQN, HOSTNQN)
    wrong = attacker(target.port, NQN, HOSTNQN)
    try:
        with bystander.attack("controllers that never authenticate"):
            admin_connect(silent)
            took = ended_within(silent, AUTH_TIMEOUT + 8)
            assert took is not None and AUTH_TIMEOUT * 0.8 <= took < AUTH_TIMEOUT + 2, took
            queue, _ = admin_connect(wrong)
            ctrl = wrong
            ctrl.auth_send(queue, auth.Negotiate.offer(1, (1,), (0,)).pack())
            ctrl.auth_receive(queue, 4096)
            ctrl.auth_send(queue, auth.Reply(1, bytes(32)).pack())
            took = ended_within(wrong, AUTH_TIMEOUT + 8)
            assert took is not None and took < AUTH_TIMEOUT + 2, took
    finally:
        silent.close()
        wrong.close()
    assert wait_lines(target, f"not authenticated within {AUTH_TIMEOUT} s of the Connect", 1)
    assert len(wait_lines(target, "destroyed (authentication timed out on qid 0)", 2)) == 2
    assert failures(target) == (2, 2)
    assert_undisturbed(bystander.finish(), bystander)
    probe.assert_bounded()
    assert_accepts_new_host(target.port, KEEPER)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"keep_alive": {"max_timeout_ms": KATO_CAP_MS}}],
                         indirect=True)
@pytest.mark.parametrize("kato", [0xFFFFFFFF, 0], ids=["kato-max", "kato-0"])
def test_keep_alive_timeout_is_capped_in_connect(target, bystander, kato):
    """KATO 2^32-1 ms (49 days) in Connect is lowered to keep_alive.max_timeout_ms, as in
    Set Features; KATO 0 (no keep-alive) gets the same bound on a controller that sends
    nothing: either way a controller nobody uses is ended, and says so."""
    probe = TargetProbe(target)
    ctrl = attacker(target.port, NQN, KEEPER)
    try:
        with bystander.attack(f"KATO {kato:#x} in Connect"):
            queue, _ = admin_connect(ctrl, KEEPER, kato=kato)
            ctrl._enable()
            cqe, _ = ctrl.wait(queue, GetFeatures(fid=FeatureId.KATO).to_sqe(), "Get Features")
            assert cqe.result & 0xFFFFFFFF == KATO_CAP_MS
            took = ended_within(ctrl, KATO_CAP_MS / 1000 + 8, keep_alive=False)
            assert took is not None and KATO_CAP_MS / 1000 - 0.3 <= took < KATO_CAP_MS / 1000 \
                + 2, took
    finally:
        ctrl.close()
    assert wait_lines(target, f"keep-alive timeout kato_ms={KATO_CAP_MS}", 1)
    assert_undisturbed(bystander.finish(), bystander)
    probe.assert_bounded()
    with connect(addr_of(), NQN, target.port, **via(), hostnqn=KEEPER,
                 nr_io_queues=1) as ok:                 # KATO 5 s (Linux's default) is kept
        assert ok.wait(ok.admin, GetFeatures(fid=FeatureId.KATO).to_sqe(),
                       "Get Features")[0].result & 0xFFFFFFFF == 3000

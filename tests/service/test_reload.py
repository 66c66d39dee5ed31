"""SIGHUP reload against a running daemon while a host does verify I/O on an untouched
namespace the whole time: add, remove and resize namespaces, change the allow-list, break
the config on purpose.  The untouched namespace's I/O never fails."""

from __future__ import annotations

import copy
import logging
import random
import threading
import time

import pytest

from blockfabric.initiator.host import NvmeError, QueueDead
from blockfabric.protocol import DISCOVERY_NQN, DiscoveryLogHeader, LogPageId, StatusCode

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN, base_config, free_port

THIRD_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:33333333-2222-3333-4444-555555555555"
MiB = 1 << 20


class LiveIO(threading.Thread):
    """Write-then-verify on random blocks, 8 in flight, until stopped; keeps the first error."""

    def __init__(self, ns, seed: int) -> None:
        super().__init__(daemon=True)
        self.ns = ns
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.ops = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        bs = self.ns.block_size
        blocks = self.ns.nblocks
        try:
            while not self.stop.is_set():
                batch = []
                for slot in range(8):           # disjoint blocks: one per slot of the batch
                    block = self.rng.randrange(slot, blocks, 8)
                    data = self.rng.randbytes(bs)
                    batch.append((block, data, self.ns.submit_write(block * bs, data)))
                for _, _, fut in batch:
                    fut.result(10)
                for block, data, _ in batch:
                    assert self.ns.read(block * bs, bs) == data, f"block {block} differs"
                self.ops += 16
        except BaseException as exc:
            self.error = exc

    def finish(self) -> int:
        self.stop.set()
        self.join(20)
        if self.error is not None:
            raise AssertionError(f"live I/O failed after {self.ops} ops") from self.error
        return self.ops


def _wait(condition, timeout: float, what) -> None:
    """Until ``condition()``; past ``timeout`` fail with ``what`` (or ``what()``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def _config(tmp_path, port):
    config = base_config(tmp_path, port)
    config["subsystems"][0] = {
        "nqn": NQN, "hosts": [HOSTNQN, OTHER_HOSTNQN],
        "namespaces": [{"nsid": 1, "backend": "ramdisk", "size": "16MiB"},
                       {"nsid": 2, "backend": "ramdisk", "size": "8MiB"},
                       {"nsid": 3, "backend": "ramdisk", "size": "8MiB"}]}
    return config


def test_reload_with_live_io(tmp_path, start_service, caplog):
    caplog.set_level(logging.DEBUG, logger="blockfabric.initiator")
    config = _config(tmp_path, free_port())
    svc = start_service(config)
    host = svc.connect()
    other = svc.connect(hostnqn=OTHER_HOSTNQN)
    disc = svc.connect(DISCOVERY_NQN)
    events: list[set[int]] = []
    host.namespace_listeners.append(lambda _ctrl, nsids: events.append(set(nsids)))
    ns3 = host.namespaces[3]
    pattern = random.Random(7).randbytes(MiB)
    ns3.write(7 * MiB, pattern)
    genctr = DiscoveryLogHeader.unpack_from(
        disc.get_log_page(LogPageId.DISCOVERY, 1024)).genctr
    live = LiveIO(host.namespaces[1], seed=1)
    live.start()
    try:
        # THIRD is not allowed yet.
        with pytest.raises(NvmeError) as denied:
            svc.connect(hostnqn=THIRD_HOSTNQN)
        assert denied.value.status == StatusCode.CONNECT_INVALID_HOST

        # 1. add a file namespace, remove ns 2, grow ns 3, swap OTHER for THIRD.
        new = copy.deepcopy(config)
        sub = new["subsystems"][0]
        sub["hosts"] = [HOSTNQN, THIRD_HOSTNQN]
        sub["namespaces"] = [sub["namespaces"][0],
                             {"nsid": 3, "backend": "ramdisk", "size": "24MiB"},
                             {"nsid": 4, "backend": "file", "path": str(tmp_path / "v4.img"),
                              "size": "4MiB"}]
        svc.reload(new)
        assert "reloaded" in svc.proc.log, svc.proc.log
        _wait(lambda: 3 in host.namespaces and host.namespaces[3].size == 24 * MiB
              and 4 in host.namespaces and 2 not in host.namespaces, 5,
              f"host did not see the changes: {events}")
        assert host.namespaces[3] is ns3            # updated in place, as a mount needs
        assert ns3.read(7 * MiB, MiB) == pattern    # the resize kept the data
        ns3.write(20 * MiB, b"g" * 4096)            # and the new space is usable
        assert ns3.read(20 * MiB, 4096) == b"g" * 4096
        host.namespaces[4].write(0, b"4" * 4096)
        assert (tmp_path / "v4.img").stat().st_size == 4 * MiB
        assert set().union(*events) >= {2, 3, 4}
        # The removed host is disconnected; the newly allowed one gets in.
        with pytest.raises((QueueDead, ConnectionError, NvmeError)):
            for _ in range(100):
                other.namespaces[1].read(0, 4096)
                time.sleep(0.02)
        with svc.connect(hostnqn=THIRD_HOSTNQN) as third:
            assert sorted(third.namespaces) == [1, 3, 4]
        # Discovery hosts can see that the log changed.
        after = DiscoveryLogHeader.unpack_from(
            disc.get_log_page(LogPageId.DISCOVERY, 1024)).genctr
        assert after > genctr

        # 2. shrink the ramdisk: the host sees it, data below the new end stays.
        shrunk = copy.deepcopy(new)
        shrunk["subsystems"][0]["namespaces"][1]["size"] = "12MiB"
        svc.reload(shrunk)
        # (both sides' logs in the message: seen twice under CI load, once with the host's
        # keep-alive unanswered for 5 s around this reload, once with nothing in the target's
        # log after 'reloaded'; 10 s as the other reload waits under load)
        _wait(lambda: ns3.size == 12 * MiB, 10,
              lambda: f"host did not see the shrink (events {events}, host "
                      f"{host.state}); the host's log:\n{caplog.text}\nthe target's log:\n"
                      + svc.proc.log)
        assert ns3.read(7 * MiB, MiB) == pattern
        with pytest.raises(NvmeError) as beyond:
            ns3.read(20 * MiB, 4096)
        assert beyond.value.status == StatusCode.LBA_OUT_OF_RANGE

        # 3. broken on purpose: a YAML error, then an unknown key, then a file shrink
        # together with an addition that must not be applied either.
        for text in ("listeners: [\n", "listeners: []\nbogus: 1\n"):
            svc.reload(text)
        bad = copy.deepcopy(shrunk)
        bad["subsystems"][0]["namespaces"][2]["size"] = "1MiB"
        bad["subsystems"][0]["namespaces"].append({"nsid": 5, "backend": "ramdisk",
                                                   "size": "4MiB"})
        svc.reload(bad)
        assert svc.proc.log.count("reload rejected") == 3, svc.proc.log
        assert "cannot shrink" in svc.proc.log
        time.sleep(0.3)
        assert 5 not in host.namespaces and host.namespaces[4].size == 4 * MiB
        host.namespaces[4].write(4096, b"x" * 4096)   # the old configuration still serves
        svc.rewrite(shrunk)                            # leave a valid file behind
    finally:
        ops = live.finish()
        for c in (host, other, disc):
            c.close()
    assert ops >= 64, ops
    assert svc.proc.alive()
    assert svc.proc.stop() == 0


def test_a_namespace_notice_not_handled_to_the_end_is_not_lost(tmp_path, start_service):
    """The host read the Changed Namespace List (which clears it on the target), then its
    rescan failed: the next notice rescans every namespace, so the first change still
    reaches it."""
    config = _config(tmp_path, free_port())
    svc = start_service(config)
    host = svc.connect()
    rescan, failed = host.rescan, []

    def rescan_failing_once(nsids=None):
        if not failed:
            failed.append(nsids)
            raise TimeoutError("Identify timed out (injected by the test)")
        return rescan(nsids)

    host.rescan = rescan_failing_once
    try:
        grown = copy.deepcopy(config)
        grown["subsystems"][0]["namespaces"][1]["size"] = "16MiB"
        svc.reload(grown)
        _wait(lambda: failed, 10, "the host got no notice of the resize")
        assert failed == [(2,)], failed
        time.sleep(0.2)
        assert host.namespaces[2].size == 8 * MiB          # that change was missed ...
        both = copy.deepcopy(grown)
        both["subsystems"][0]["namespaces"][2]["size"] = "16MiB"
        svc.reload(both)                                    # ... a notice about nsid 3 only
        _wait(lambda: host.namespaces[3].size == 16 * MiB, 10, "no notice of nsid 3")
        assert host.namespaces[2].size == 16 * MiB         # ... brings nsid 2's too
    finally:
        host.close()
    assert svc.proc.stop() == 0


def test_reload_adds_and_removes_listeners_and_subsystems(tmp_path, start_service):
    port, port2 = free_port(), free_port()
    config = base_config(tmp_path, port)
    svc = start_service(config)
    host = svc.connect()
    live = LiveIO(host.namespaces[1], seed=2)
    live.start()
    extra_nqn = "nqn.2026-12.io.blockfabric:extra"
    try:
        new = copy.deepcopy(config)
        new["listeners"].append({"provider": "soft", "address": "127.0.0.1", "port": port2,
                                 "name": "second"})
        new["subsystems"].append({"nqn": extra_nqn, "allow_any_host": True,
                                  "listeners": ["second"],
                                  "namespaces": [{"nsid": 1, "backend": "null",
                                                  "size": "1GiB"}]})
        svc.reload(new)
        from blockfabric.initiator.host import connect
        # Its listener goes away below: the host retries (nvme-cli semantics) until
        # ctrl_loss_tmo, kept short here so the loss surfaces as an error.
        extra = connect("127.0.0.1", extra_nqn, port2, provider="soft", hostnqn=HOSTNQN,
                        nr_io_queues=1, ctrl_loss_tmo=1, reconnect_delay=0.3)
        assert extra.namespaces[1].size == 1 << 30
        # Not exposed on the first listener: Connect there is refused.
        with pytest.raises(NvmeError):
            svc.connect(extra_nqn)
        # Remove the listener and the subsystem again: the host on it is disconnected.
        svc.reload(config)
        with pytest.raises((QueueDead, ConnectionError, NvmeError)):
            for _ in range(100):
                extra.namespaces[1].read(0, 4096)
                time.sleep(0.02)
        extra.close()
        with pytest.raises(ConnectionError):
            connect("127.0.0.1", extra_nqn, port2, provider="soft", hostnqn=HOSTNQN)
        assert "subsystem removed: subnqn=" + extra_nqn in svc.proc.log
    finally:
        live.finish()
        host.close()
    assert svc.proc.stop() == 0


def test_reload_with_a_changed_secret_disconnects_that_host_only(tmp_path, start_service):
    """Revoking a DH-HMAC-CHAP secret must not leave a controller authenticated with it."""
    from blockfabric.initiator.host import AuthenticationFailed
    from blockfabric.protocol.auth import generate_secret
    old, new_secret = generate_secret(32, 1), generate_secret(32, 1)
    config = base_config(tmp_path, free_port())
    config["subsystems"][0] = {
        "nqn": NQN, "hosts": [{"nqn": HOSTNQN, "dhchap_secret": str(old)}, OTHER_HOSTNQN],
        "namespaces": [{"nsid": 1, "backend": "ramdisk", "size": "8MiB"}]}
    # The revoked host keeps reconnecting with its old secret from 127.0.0.1, the address
    # the new secret then connects from: no back-off of that address here (that is
    # tests/hostile/test_auth_abuse.py's subject).
    config.setdefault("limits", {})["auth_max_failures"] = 1000
    svc = start_service(config)
    host = svc.connect(dhchap_secret=str(old), reconnect_delay=0.2, ctrl_loss_tmo=1.0,
                       connect_timeout=1.0)
    other = svc.connect(hostnqn=OTHER_HOSTNQN)
    try:
        live = LiveIO(other.namespaces[1], seed=3)
        live.start()
        changed = copy.deepcopy(config)
        changed["subsystems"][0]["hosts"][0]["dhchap_secret"] = str(new_secret)
        svc.reload(changed)
        assert str(old) not in svc.proc.log and str(new_secret) not in svc.proc.log
        _wait(lambda: "no longer allowed by the configuration" in svc.proc.log, 5,
              "the host with the old secret was not disconnected")
        with pytest.raises((QueueDead, ConnectionError, NvmeError)):
            for _ in range(200):
                host.namespaces[1].read(0, 4096)
                time.sleep(0.02)
        with pytest.raises(AuthenticationFailed):
            svc.connect(dhchap_secret=str(old))
        with svc.connect(dhchap_secret=str(new_secret)) as again:
            again.namespaces[1].write(0, b"n" * 4096)
        assert live.finish() > 0                    # the other host never stopped
    finally:
        host.close()
        other.close()

"""Faults under a real FUSE mount: fio writes and verifies (crc32c) through ``n1`` while the
target is SIGKILLed and restarted; the mount holds the I/O and ``.status`` shows it was held
and re-issued.  When the target stays away past ctrl-loss-tmo, a read fails with EIO."""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest

from fuse.conftest import NQN as FUSE_NQN
from fuse.conftest import BIN, Mount, mounted_at

from e2e.conftest import addr_of, case_timeout, start_timeout

from .conftest import Restartable, file_config, free_port
from .proxy import THROUGH_A_PROXY, TcpProxy

pytestmark = pytest.mark.timeout(case_timeout(90))   # restarts: slower under TCG
if shutil.which("fio") is None:
    pytest.skip("fio is missing (Debian package fio)", allow_module_level=True)


class FaultMount(Mount):
    """A mount with nvme-cli's short fault options (seconds, integers on the CLI), and any
    ``extra`` flags (``--path``); of ``traddr``, from network namespace ``netns`` if given
    (entered with nsenter: only the network, so the mount is seen from here)."""

    def __init__(self, target, base, loss_tmo: int, extra: tuple[str, ...] = (),
                 traddr: str | None = None, netns: str | None = None) -> None:
        super().__init__(target, base)
        self.loss_tmo = loss_tmo
        self.extra = list(extra)
        self.traddr, self.netns = traddr or addr_of(), netns

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("-a") + 1] = self.traddr
        return argv[:-1] + ["-k", "1", "-c", "1", "-l", str(self.loss_tmo), *self.extra,
                            argv[-1]]

    def start(self) -> FaultMount:
        pre = [] if self.netns is None else ["nsenter", f"--net=/run/netns/{self.netns}"]
        self.log_path = pathlib.Path(self.path).parent / "mount.log"
        self.logf = open(self.log_path, "w")
        self.proc = subprocess.Popen([*pre, str(BIN / "blockfabric"), *self.argv()[:-1], "-f", "-v",
                                      self.argv()[-1]], stdout=self.logf, stderr=self.logf,
                                     env=self.env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout(30)
        while time.monotonic() < deadline:
            if mounted_at(self.path) or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        assert mounted_at(self.path), self.log_path.read_text()
        return self

    def logs(self, target: Restartable | None = None) -> str:
        """The mount's log without its DEBUG lines (but the errors among them), and the
        target's, for an assertion's message."""
        text = "\nMOUNTLOG\n" + "\n".join(
            line for line in self.log_path.read_text().splitlines()
            if "DEBUG" not in line or "error" in line.lower())[-3000:]
        if target is not None:
            text += "\nTARGETLOG\n" + "\n".join(
                line for line in target.proc.log.splitlines() if "DEBUG" not in line)[-6000:]
        return text

    def cleanup(self) -> None:
        """Unmount, then reap the foreground mount process (killed if it outlives the
        unmount, or never mounted) and close its log."""
        super().cleanup()
        proc = getattr(self, "proc", None)
        if proc is not None:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            self.logf.close()


@pytest.fixture
def target(tmp_path):
    port = free_port()
    config = file_config(port, tmp_path / "vol.img")
    config["subsystems"][0]["nqn"] = FUSE_NQN
    t = Restartable(config, tmp_path)
    t.port = port
    yield t
    t.stop()


def recovery(status: str) -> dict[str, int]:
    line = next(x for x in status.splitlines() if x.startswith("reconnect"))
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line.split(";", 1)[1])}


def fio_verify(mount: Mount, cwd) -> subprocess.Popen:
    """fio writing 12 MiB at 4 MiB/s through ``n1``, then reading it back with crc32c."""
    return subprocess.Popen(
        ["fio", "--name=verify", f"--filename={mount.file('n1')}", "--rw=write",
         "--bs=64k", "--size=12m", "--rate=4m", "--ioengine=psync", "--verify=crc32c",
         "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0",
         "--output-format=terse"], cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("fuse_workers", [1, 2])
def test_fio_verify_through_a_target_restart(target, tmp_path, fuse_workers):
    """With --fuse-workers 2 the worker's queues follow the controller: held, then
    connected to the controller the mount process reconnected, and re-issued."""
    # the controller outlives the target's restart (slow under TCG: start_timeout)
    mount = FaultMount(target, tmp_path, loss_tmo=int(2 * start_timeout(20)),
                       extra=("--fuse-workers", str(fuse_workers))).start()
    try:
        # the mount is ready (its record written) once its workers serve; a fault before
        # that is a worker's first connect, not the reconnect this test is about
        deadline = time.monotonic() + start_timeout(30)
        while True:
            try:
                mount.pid
                break
            except AssertionError:
                assert time.monotonic() < deadline, mount.logs(target)
                time.sleep(0.1)
        fio = fio_verify(mount, tmp_path)
        time.sleep(1.0)
        target.kill()
        time.sleep(1.0)
        target.start()
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err + mount.logs(target)
        rec = recovery(mount.status())
        assert rec["reconnects"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, rec
        assert rec["failed"] == 0, rec
        assert mount.counter("errors") == 0
        if fuse_workers > 1:
            status = mount.status()
            worker = re.search(r"worker 1: pid \d+, running, I/O queues 2 \(live; "
                               r"reconnects (\d+)", status)
            assert worker and int(worker.group(1)) >= 1, status + mount.logs(target)
    finally:
        mount.cleanup()


def test_workers_start_through_a_target_restart(target, tmp_path):
    """The target dies while the mount's 3 workers connect their queues (they start once
    the kernel's INIT is answered, ~1 s after the mount appears): each asks the mount
    process where the controller stands, and every one is answered while the others still
    start (the target stays down until each worker heard "reconnecting"); each connects
    once the controller is live again, to the controller it names; the mount comes up
    whole and fio verifies through it."""
    # the outage lasts as long as the workers take to start, then a target's start: the
    # mount's controller must outlive both (slow under TCG: BLOCKFABRIC_TEST_START_TIMEOUT)
    loss_tmo = int(3 * start_timeout(20))
    mount = FaultMount(target, tmp_path, loss_tmo=loss_tmo,
                       extra=("--fuse-workers", "3")).start()
    try:
        target.kill()
        deadline = time.monotonic() + start_timeout(20)
        heard = re.compile(r"fuse-worker-(\d) INFO __main__: connecting queues \S+: the "
                           r"mount's controller is reconnecting; waiting")
        while set(heard.findall(mount.log_path.read_text())) != {"1", "2"}:
            assert mount.proc.poll() is None, mount.logs(target)
            assert time.monotonic() < deadline, \
                "a starting worker's question went unanswered" + mount.logs(target)
            time.sleep(0.2)
        target.start()
        deadline = time.monotonic() + start_timeout(20) * 2
        while True:
            try:
                mount.pid           # the record: written once every worker serves
                break
            except AssertionError:
                assert mount.proc.poll() is None, mount.logs(target)
                assert time.monotonic() < deadline, mount.logs(target)
                time.sleep(0.2)
        fio = fio_verify(mount, tmp_path)
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err + mount.logs(target)
        status = mount.status()
        assert status.count(", running, I/O queues") == 3, status + mount.logs(target)
        assert mount.counter("errors") == 0
        assert "CONNECT_INVALID_PARAM" not in mount.log_path.read_text(), mount.logs(target)
    finally:
        mount.cleanup()


@pytest.mark.parametrize("fuse_workers", [1, 2])
def test_eio_only_after_ctrl_loss_tmo(target, tmp_path, fuse_workers):
    mount = FaultMount(target, tmp_path, loss_tmo=2,
                       extra=("--fuse-workers", str(fuse_workers))).start()
    try:
        fd = os.open(mount.file("n1"), os.O_RDWR)
        try:
            os.pwrite(fd, b"q" * 4096, 0)
            lost = time.monotonic()     # before: the host may see the loss while kill() waits
            target.kill()
            with pytest.raises(OSError) as err:
                for _ in range(100):
                    os.pread(fd, 4096, 0)
                    time.sleep(0.05)
            waited = time.monotonic() - lost
        finally:
            os.close(fd)
        assert err.value.errno == errno.EIO, err.value
        assert 2.0 <= waited < 6.0, waited
        assert "state       failed" in mount.status()
    finally:
        mount.cleanup()


def fails_over(mount: FaultMount, target: Restartable, fault, first: str, second: str,
               tmp_path) -> dict[str, int]:
    """Mount (paths ``first`` then ``second``), run fio's verify, call ``fault()`` 1 s in:
    fio must finish clean and .status show a failover to ``second``."""
    try:
        mount.start()
        before = mount.status()
        # both paths connected at once; with no ANA both serve (round robin)
        assert f"rdma {first}, {second} " in before, before
        assert f"(paths: {first}, {second})" in before, before
        fio = fio_verify(mount, tmp_path)
        time.sleep(1.0)
        fault()
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err + mount.logs(target)
        status = mount.status()
        rec = recovery(status)
        print(f"\nobserved: {rec}")          # for docs/reliability.md (pytest -s)
        assert rec["failovers"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, status
        assert rec["failed"] == 0, status
        assert f"rdma {second} " in status, status
        assert mount.counter("errors") == 0
    finally:
        mount.cleanup()
        target.stop()
    assert "Traceback" not in target.log, target.log
    return rec


@THROUGH_A_PROXY
def test_mount_fails_over_to_the_listener_given_with_path(tmp_path):
    """One target, two listeners; the mount reaches the first through a TCP proxy and is
    told of the second with --path.  The proxy then cuts every connection and refuses new
    ones (path 1 is gone for good)."""
    port_a, port_b = free_port(), free_port()
    config = file_config(port_a, tmp_path / "vol.img", extra_ports=(port_b,))
    config["subsystems"][0]["nqn"] = FUSE_NQN
    target = Restartable(config, tmp_path)
    proxy = TcpProxy(("127.0.0.1", port_a))
    target.port = proxy.port                # the mount's -a/-s: path 1, via the proxy
    mount = FaultMount(target, tmp_path, loss_tmo=20,
                       extra=("--path", f"127.0.0.1:{port_b}"))
    try:
        fails_over(mount, target, proxy.down, f"127.0.0.1:{proxy.port}",
                   f"127.0.0.1:{port_b}", tmp_path)
    finally:
        proxy.close()


@pytest.mark.netns
@pytest.mark.skipif(shutil.which("nft") is None or shutil.which("nsenter") is None,
                    reason="needs nft (Debian nftables) and nsenter (util-linux)")
@pytest.mark.needs_transport("rdma", "network namespaces joined by veth: the lab's rxe0 is in "
                             "the guest's root namespace")
def test_mount_fails_over_from_ipv4_to_ipv6_between_namespaces(netns_pair, tmp_path):
    """The target in namespace B listens on B's IPv4 and IPv6 addresses; the mount runs in
    A with -a IPV4 --path [IPV6].  nftables in B then resets every IPv4 packet to the port
    (path 1 gone, path 2 untouched): the mount fails over to the IPv6 listener."""
    port = 4420 + free_port() % 1000
    v4, v6 = netns_pair.ipv4[1], netns_pair.ipv6[1]
    config = file_config(port, tmp_path / "vol.img", v4)
    config["listeners"].append({"provider": "soft", "address": v6, "port": port})
    config["subsystems"][0]["nqn"] = FUSE_NQN
    target = Restartable(config, tmp_path, netns=netns_pair.names[1])
    target.port = port
    mount = FaultMount(target, tmp_path, loss_tmo=20, extra=("--path", f"[{v6}]"),
                       traddr=v4, netns=netns_pair.names[0])

    def cut_ipv4() -> None:
        for rule in ("add table inet bffault",
                     "add chain inet bffault in { type filter hook input priority 0 ; }",
                     f"add rule inet bffault in ip daddr {v4} tcp dport {port} "
                     "reject with tcp reset"):
            subprocess.run(["ip", "netns", "exec", netns_pair.names[1], "nft", *rule.split()],
                           check=True, capture_output=True, timeout=10)
    fails_over(mount, target, cut_ipv4, f"{v4}:{port}", f"[{v6}]:{port}", tmp_path)

"""Faults under a real FUSE mount: fio writes and verifies (crc32c) through ``n1`` while the
target is SIGKILLed and restarted; the mount holds the I/O and ``.status`` shows it was held
and re-issued.  When the target stays away past ctrl-loss-tmo, a read fails with EIO."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time

import pytest

from fuse.conftest import NQN as FUSE_NQN
from fuse.conftest import Mount

from .conftest import Restartable, file_config, free_port
from .proxy import TcpProxy

pytestmark = pytest.mark.timeout(90)
if shutil.which("fio") is None:
    pytest.skip("fio is missing (Debian package fio)", allow_module_level=True)


class FaultMount(Mount):
    """A mount with nvme-cli's short fault options (seconds, integers on the CLI), and any
    ``extra`` flags (``--path``)."""

    def __init__(self, target, base, loss_tmo: int, extra: tuple[str, ...] = ()) -> None:
        super().__init__(target, base)
        self.loss_tmo = loss_tmo
        self.extra = list(extra)

    def argv(self) -> list[str]:
        argv = super().argv()
        return argv[:-1] + ["-k", "1", "-c", "1", "-l", str(self.loss_tmo), *self.extra,
                            argv[-1]]


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


def test_fio_verify_through_a_target_restart(target, tmp_path):
    mount = FaultMount(target, tmp_path, loss_tmo=20).start()
    try:
        fio = fio_verify(mount, tmp_path)
        time.sleep(1.0)
        target.kill()
        time.sleep(1.0)
        target.start()
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err
        rec = recovery(mount.status())
        assert rec["reconnects"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, rec
        assert rec["failed"] == 0, rec
        assert mount.counter("errors") == 0
    finally:
        mount.cleanup()


def test_eio_only_after_ctrl_loss_tmo(target, tmp_path):
    mount = FaultMount(target, tmp_path, loss_tmo=2).start()
    try:
        fd = os.open(mount.file("n1"), os.O_RDWR)
        try:
            os.pwrite(fd, b"q" * 4096, 0)
            target.kill()
            lost = time.monotonic()
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


def test_mount_fails_over_to_the_listener_given_with_path(tmp_path):
    """One target, two listeners; the mount reaches the first through a TCP proxy and is
    told of the second with --path.  The proxy then cuts every connection and refuses new
    ones (path 1 is gone for good): fio's verify run finishes clean, and .status shows the
    I/O held, a failover, and the second listener in use."""
    port_a, port_b = free_port(), free_port()
    config = file_config(port_a, tmp_path / "vol.img", extra_ports=(port_b,))
    config["subsystems"][0]["nqn"] = FUSE_NQN
    target = Restartable(config, tmp_path)
    proxy = TcpProxy(("127.0.0.1", port_a))
    target.port = proxy.port                # the mount's -a/-s: path 1, via the proxy
    mount = FaultMount(target, tmp_path, loss_tmo=20,
                       extra=("--path", f"127.0.0.1:{port_b}"))
    try:
        mount.start()
        before = mount.status()
        assert f"rdma 127.0.0.1:{proxy.port} " in before, before
        assert f"(paths: 127.0.0.1:{proxy.port}, 127.0.0.1:{port_b})" in before, before
        fio = fio_verify(mount, tmp_path)
        time.sleep(1.0)
        proxy.down()
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err
        status = mount.status()
        rec = recovery(status)
        print(f"\nobserved: {rec}")          # for docs/reliability.md (pytest -s)
        assert rec["failovers"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, status
        assert rec["failed"] == 0, status
        assert f"rdma 127.0.0.1:{port_b} " in status, status
        assert mount.counter("errors") == 0
    finally:
        mount.cleanup()
        proxy.close()
        target.stop()
    assert "Traceback" not in target.log, target.log

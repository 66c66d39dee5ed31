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

pytestmark = pytest.mark.timeout(90)
if shutil.which("fio") is None:
    pytest.skip("fio is missing (Debian package fio)", allow_module_level=True)


class FaultMount(Mount):
    """A mount with nvme-cli's short fault options (seconds, integers on the CLI)."""

    def __init__(self, target, base, loss_tmo: int) -> None:
        super().__init__(target, base)
        self.loss_tmo = loss_tmo

    def argv(self) -> list[str]:
        argv = super().argv()
        return argv[:-1] + ["-k", "1", "-c", "1", "-l", str(self.loss_tmo), argv[-1]]


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


def test_fio_verify_through_a_target_restart(target, tmp_path):
    mount = FaultMount(target, tmp_path, loss_tmo=20).start()
    try:
        fio = subprocess.Popen(
            ["fio", "--name=verify", f"--filename={mount.file('n1')}", "--rw=write",
             "--bs=64k", "--size=12m", "--rate=4m", "--ioengine=psync", "--verify=crc32c",
             "--do_verify=1", "--verify_fatal=1", f"--verify_state_save=0",
             "--output-format=terse"], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
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

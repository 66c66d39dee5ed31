"""A target reload reaches a live mount: a resized namespace's file takes the new size and
an added namespace appears as a new file (AEN -> changed namespace list -> rescan)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from e2e.conftest import TargetProc, free_port

from .conftest import NQN, Mount

MiB = 1 << 20


def wait_for(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("fuse_workers", [1, 3])
def test_resize_and_added_namespace_show_up_in_the_mount(tmp_path, fuse_workers):
    """With --fuse-workers 3 the mount process tells its workers: every process serves
    the new size and the new file (many requests, so that each process gets some)."""
    port = free_port()
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
              "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                  {"nsid": 1, "backend": "ramdisk", "size": "8MiB"}]}]}
    target = TargetProc(config, tmp_path).start()
    target.port = port
    mount = Mount(target, tmp_path, flags=("--fuse-workers", str(fuse_workers)))
    try:
        mount.start()
        n1 = mount.file("n1")
        assert os.stat(n1).st_size == 8 * MiB
        payload = os.urandom(64 * 1024)
        with open(n1, "r+b") as f:
            f.write(payload)
        config["subsystems"][0]["namespaces"] = [
            {"nsid": 1, "backend": "ramdisk", "size": "16MiB"},
            {"nsid": 2, "backend": "ramdisk", "size": "4MiB"}]
        target.path.write_text(yaml.safe_dump(config))
        target.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: os.stat(n1).st_size == 16 * MiB), \
            f"size stayed {os.stat(n1).st_size}\n{target.log}"
        assert wait_for(lambda: os.path.exists(mount.file("n2")))
        assert os.stat(mount.file("n2")).st_size == 4 * MiB
        with open(n1, "r+b") as f:
            assert f.read(len(payload)) == payload          # data kept across the resize
            f.seek(12 * MiB)
            f.write(b"beyond the old end")
            f.seek(12 * MiB)
            assert f.read(18) == b"beyond the old end"
        fd = os.open(n1, os.O_RDWR)
        try:
            for i in range(60):         # unbuffered, each one a FUSE request
                data = os.urandom(4096)
                assert os.pwrite(fd, data, 12 * MiB + i * 4096) == 4096
                assert os.pread(fd, 4096, 12 * MiB + i * 4096) == data
        finally:
            os.close(fd)
        for _ in range(20):
            with open(mount.file("n2"), "rb") as f:
                assert len(f.read()) == 4 * MiB
        if fuse_workers > 1:
            served = mount.status()
            assert served.count(", running, I/O queues") == fuse_workers, served
    finally:
        mount.cleanup()
        target.stop()
    assert "Traceback" not in target.log, target.log

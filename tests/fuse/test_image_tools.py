"""Image tools treat a mounted namespace file as the raw disk image it is."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

MiB = 1 << 20


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-img missing (qemu-utils)")
def test_qemu_img_info_and_convert(shared_mount, tmp_path):
    n1 = shared_mount.file("n1")
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", "-f", "raw", n1],
                                     capture_output=True, text=True, check=True,
                                     timeout=60).stdout)
    assert info["format"] == "raw" and info["virtual-size"] == 64 * MiB
    # qemu-img reads through the mount: a qcow2 copy of the first 4 MiB converts back equal.
    with open(n1, "r+b") as f:
        f.write(b"qemu" * 1024)
    small = tmp_path / "head.raw"
    with open(n1, "rb") as src, open(small, "wb") as dst:
        dst.write(src.read(4 * MiB))
    qcow = tmp_path / "head.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(small), str(qcow)],
                   check=True, timeout=60)
    # -n: write into the existing file; like a block device it cannot be resized (EINVAL).
    subprocess.run(["qemu-img", "convert", "-n", "-f", "qcow2", "-O", "raw", str(qcow), n1],
                   check=True, timeout=60)           # written back through the mount
    with open(n1, "rb") as f:
        assert f.read(4 * MiB) == small.read_bytes()

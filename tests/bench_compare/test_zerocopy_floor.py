"""benchmarks/prototypes/zerocopy_floor: the patch still applies to the perf floor, and the
shared-memory floor with two FUSE readers (the design docs/performance.md measures) reads
back what was written through its mount.  Skipped where the floor is not next to the
project (it lives outside it) or without root and /dev/fuse.  No assertions on speed."""

from __future__ import annotations

import mmap
import os
import pathlib
import py_compile
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "prototypes" / "zerocopy_floor"))

import run as zerocopy  # noqa: E402
from compare import systems  # noqa: E402

FLOOR = systems.find_floor()
pytestmark = pytest.mark.skipif(FLOOR is None, reason="no perf floor next to the project "
                                "(BLOCKFABRIC_PERF_FLOOR, ../shared/perf-floor)")


def test_the_patch_applies_and_every_variant_is_there(tmp_path):
    patched = zerocopy.patched_floor(FLOOR, tmp_path)
    for name in ("floor_host.py", "floor_target.py"):
        py_compile.compile(str(patched / name), doraise=True)
    host = (patched / "floor_host.py").read_text()
    target = (patched / "floor_target.py").read_text()
    for flag in ("--maxio=", "--pipe=", "--splice", "--shm=", "--clone="):
        assert flag in host, flag
    for flag in ("--sendfile", "--shm=", "--volume="):
        assert flag in target, flag


def _ready_port(proc: subprocess.Popen, log: pathlib.Path) -> int:
    deadline = time.monotonic() + 20
    while not log.read_text().startswith("ready"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return int(log.read_text().split()[1])


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="mounts FUSE: needs root and /dev/fuse")
def test_the_shared_memory_floor_with_two_readers_reads_back_what_it_wrote(tmp_path):
    patched = zerocopy.patched_floor(FLOOR, tmp_path)
    volume, mnt = tmp_path / "volume", tmp_path / "mnt"
    mnt.mkdir()
    procs = []
    try:
        ports = []
        for i in (1, 2):
            log = tmp_path / f"target{i}.log"
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, patched / "floor_target.py", "0", f"--volume={volume}",
                     f"--shm={tmp_path / f'buffers{i}'}"], stdout=out, stderr=out))
            ports.append(_ready_port(procs[-1], log))
        hlog = tmp_path / "host.log"
        with open(hlog, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, patched / "floor_host.py", mnt, str(ports[0]),
                 "--maxio=1024", f"--shm={tmp_path / 'buffers1'}",
                 f"--clone={ports[1]},{tmp_path / 'buffers2'}"], stdout=out, stderr=out))
        deadline = time.monotonic() + 20
        while not (mnt / "n1").exists():
            assert procs[-1].poll() is None and time.monotonic() < deadline, hlog.read_text()
            time.sleep(0.05)
        data = os.urandom(8 << 20)
        fd = os.open(mnt / "n1", os.O_RDWR | os.O_DIRECT)
        try:
            aligned = mmap.mmap(-1, 1 << 20)       # O_DIRECT: whole, aligned blocks
            for off in range(0, len(data), 1 << 20):
                aligned[:] = data[off:off + (1 << 20)]
                assert os.pwrite(fd, aligned, (3 << 20) + off) == 1 << 20
            back = bytearray()
            for off in range(0, len(data), 1 << 20):
                n = os.preadv(fd, [aligned], (3 << 20) + off)
                back += aligned[:n]
        finally:
            os.close(fd)
        assert bytes(back) == data
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

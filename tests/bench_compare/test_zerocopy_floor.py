"""benchmarks/prototypes/zerocopy_floor: the patch still applies to the perf floor, and the
shared-memory floor with two FUSE readers (the design docs/performance.md measures) reads
back what was written through its mount.  Skipped where the floor is not next to the
project (it lives outside it) or without root and /dev/fuse.  No assertions on speed."""

from __future__ import annotations

import mmap
import os
import pathlib
import py_compile
import sys

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


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists("/dev/fuse"),
                    reason="mounts FUSE: needs root and /dev/fuse")
def test_the_shared_memory_floor_with_two_readers_reads_back_what_it_wrote(tmp_path):
    data = os.urandom(8 << 20)
    with systems.Workspace() as ws:         # unmounts and stops all of it, also on failure
        system = zerocopy.two_readers(ws, zerocopy.patched_floor(FLOOR, tmp_path), "shm")
        fd = os.open(system.path, os.O_RDWR | os.O_DIRECT)
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

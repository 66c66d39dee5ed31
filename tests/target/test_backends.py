"""Volume backends: one contract run over all three, then what is particular to each."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from blockfabric.sizes import KiB, MiB
from blockfabric.target import backends
from blockfabric.target.backends import (Backend, FileBackend, NullBackend, RamdiskBackend,
                                         open_backend)
from blockfabric.target.config import BACKENDS, Namespace

SIZE = 4 * MiB
Factory = Callable[..., Backend]


@pytest.fixture(params=["ramdisk", "file", "null"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Opens backends of one kind and closes them all afterwards, whatever happens."""
    opened: list[Backend] = []

    def factory(size: int = SIZE, block_size: int = 4096, read_only: bool = False) -> Backend:
        if request.param == "ramdisk":
            backend = RamdiskBackend(size, block_size, read_only)
        elif request.param == "null":
            backend = NullBackend(size, block_size, read_only)
        else:
            path = tmp_path / f"vol{len(opened)}.img"
            if read_only:
                path.write_bytes(b"")
                os.truncate(path, size)
            backend = FileBackend(str(path), size, block_size, read_only)
        opened.append(backend)
        return backend

    factory.kind = request.param  # type: ignore[attr-defined]
    yield factory
    for backend in opened:
        backend.close()


def _pattern(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _read(backend: Backend, offset: int, length: int) -> bytes:
    buf = bytearray(b"\xee" * length)
    backend.readinto(offset, memoryview(buf))
    return bytes(buf)


# --- the contract ---------------------------------------------------------------------------

def test_fresh_volume_reads_zero(make: Factory) -> None:
    backend = make()
    assert (backend.size, backend.block_size, backend.read_only) == (SIZE, 4096, False)
    assert _read(backend, 0, 8192) == bytes(8192)
    assert _read(backend, SIZE - 3 * MiB - 7, 3 * MiB + 7) == bytes(3 * MiB + 7)


def test_write_then_read_back(make: Factory) -> None:
    backend = make()
    data = _pattern(3 * 4096 + 100, seed=1)
    backend.write(4096 - 50, data)            # unaligned, across block boundaries
    backend.flush()
    expected = bytes(len(data)) if make.kind == "null" else data
    assert _read(backend, 4096 - 50, len(data)) == expected
    assert _read(backend, 0, 4096 - 50) == bytes(4096 - 50)


def test_buffers_of_any_shape_are_counted_in_bytes(make: Factory) -> None:
    backend = make()
    words = memoryview(bytearray(_pattern(64, seed=2))).cast("I")   # 16 items, 64 bytes
    backend.write(0, words)
    out = memoryview(bytearray(64)).cast("Q")
    backend.readinto(0, out)
    assert len(out.tobytes()) == 64
    if make.kind != "null":
        assert out.tobytes() == words.tobytes()


@pytest.mark.parametrize(("offset", "length"), [(-1, 1), (SIZE, 1), (SIZE - 4095, 4096),
                                                 (0, SIZE + 1)])
def test_out_of_range_is_erange(make: Factory, offset: int, length: int) -> None:
    backend = make()
    for op in (lambda: backend.readinto(offset, bytearray(length)),
               lambda: backend.write(offset, bytes(length)),
               lambda: backend.write_zeroes(offset, length),
               lambda: backend.discard(offset, length)):
        with pytest.raises(OSError) as info:
            op()
        assert info.value.errno == errno.ERANGE
        assert "outside the volume" in str(info.value)


def test_read_only_refuses_writes_with_erofs(make: Factory) -> None:
    backend = make(read_only=True)
    for op in (lambda: backend.write(0, b"x"), lambda: backend.write_zeroes(0, 4096),
               lambda: backend.discard(0, 4096)):
        with pytest.raises(OSError) as info:
            op()
        assert info.value.errno == errno.EROFS
    assert _read(backend, 0, 4096) == bytes(4096)   # reads still work
    backend.flush()


def test_write_zeroes_clears_exactly_the_range(make: Factory) -> None:
    backend = make()
    data = _pattern(SIZE, seed=3)
    backend.write(0, data)
    start, length = 4096 * 3 + 123, 4096 * 300 + 77   # ragged both ends, whole pages inside
    backend.write_zeroes(start, length)
    backend.discard(0, 0)
    got = _read(backend, 0, SIZE)
    if make.kind == "null":
        assert got == bytes(SIZE)
    else:
        assert got == data[:start] + bytes(length) + data[start + length:]


def test_closed_backend_is_ebadf_and_close_is_idempotent(make: Factory) -> None:
    backend = make()
    backend.close()
    backend.close()
    with pytest.raises(OSError) as info:
        backend.readinto(0, bytearray(1))
    assert info.value.errno == errno.EBADF
    with pytest.raises(OSError):
        backend.flush()


def test_size_must_be_a_multiple_of_the_block_size(make: Factory) -> None:
    with pytest.raises(ValueError, match="multiple"):
        make(size=4096 + 512)


def test_open_backend_covers_every_configured_kind(tmp_path: Path) -> None:
    assert set(backends._OPENERS) == set(BACKENDS)
    kinds = {"ramdisk": RamdiskBackend, "file": FileBackend, "null": NullBackend}
    local = [b for b in BACKENDS if b != "rbd"]    # rbd needs a cluster: tests/ceph
    for nsid, name in enumerate(local, 1):
        ns = Namespace(nsid=nsid, backend=name, size=MiB, block_size=512, read_only=False,
                       path=str(tmp_path / "v.img") if name == "file" else None)
        with open_backend(ns) as backend:
            assert type(backend) is kinds[name]
            assert (backend.size, backend.block_size) == (MiB, 512)


# --- ramdisk ----------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * KiB for line in f if line.startswith("VmRSS:"))


def test_ramdisk_memory_is_the_volume() -> None:
    with RamdiskBackend(MiB) as disk:
        mem = disk.memory
        assert len(mem) == MiB and not mem.readonly
        disk.write(100, b"hello")
        assert bytes(mem[100:105]) == b"hello"
        mem[200:203] = b"abc"                 # as an RDMA READ landing in it would
        assert _read(disk, 200, 3) == b"abc"
        del mem


def test_ramdisk_costs_memory_only_where_written_and_gives_it_back() -> None:
    with RamdiskBackend(1024 * MiB) as disk:
        base = _rss()
        assert _rss() - base < 16 * MiB       # 1 GiB mapped, nothing touched
        disk.write(64 * MiB, b"\x01" * (64 * MiB))
        touched = _rss()
        assert touched - base > 60 * MiB
        disk.write_zeroes(64 * MiB, 64 * MiB)
        assert touched - _rss() > 60 * MiB    # MADV_DONTNEED handed the pages back
        assert _read(disk, 64 * MiB, 4096) == bytes(4096)


# --- file -----------------------------------------------------------------------------------

def test_file_is_created_sparse_at_the_configured_size(tmp_path: Path) -> None:
    path = tmp_path / "new.img"
    with FileBackend(str(path), 256 * MiB) as vol:
        assert vol.memory is None
        st = os.stat(path)
        assert st.st_size == 256 * MiB
        assert st.st_blocks * 512 < MiB
        assert oct(st.st_mode & 0o777) == oct(0o600)


def test_file_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "vol.img")
    data = _pattern(MiB + 4096, seed=4)
    with FileBackend(path, 8 * MiB) as vol:
        vol.write(3 * MiB, data)
        vol.flush()
    with FileBackend(path, 8 * MiB, read_only=True) as vol:
        assert _read(vol, 3 * MiB, len(data)) == data


def test_smaller_file_grows_and_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "grow.img"
    path.write_bytes(b"A" * 4096)
    with FileBackend(str(path), MiB) as vol:
        assert _read(vol, 0, 8192) == b"A" * 4096 + bytes(4096)
    assert path.stat().st_size == MiB


def test_larger_file_is_refused_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "big.img"
    path.write_bytes(b"B" * (2 * MiB))
    with pytest.raises(OSError) as info:
        FileBackend(str(path), MiB)
    assert info.value.errno == errno.EINVAL
    assert "larger than the configured size 1MiB" in str(info.value)
    assert "set size to 2MiB" in str(info.value)
    assert path.read_bytes() == b"B" * (2 * MiB)


def test_read_only_never_creates_or_grows(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        FileBackend(str(tmp_path / "missing.img"), MiB, read_only=True)
    assert not (tmp_path / "missing.img").exists()
    small = tmp_path / "small.img"
    small.write_bytes(bytes(4096))
    with pytest.raises(OSError, match="smaller than"):
        FileBackend(str(small), MiB, read_only=True)
    assert small.stat().st_size == 4096


def test_not_a_file_or_block_device_is_refused() -> None:
    with pytest.raises(OSError, match="not a regular file or block device"):
        FileBackend("/dev/null", MiB)


def test_file_truncated_behind_our_back_reads_eio(tmp_path: Path) -> None:
    path = tmp_path / "vol.img"
    with FileBackend(str(path), MiB) as vol:
        os.truncate(path, 4096)
        with pytest.raises(OSError) as info:
            _read(vol, 0, 8192)
        assert info.value.errno == errno.EIO


# File systems known to punch holes: on these, a range that is not deallocated is a failure.
PUNCHING_FS = {"ext2/ext3", "xfs", "btrfs", "tmpfs"}


def _fs_type(folder: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(folder)], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_punch_hole_reads_zero_and_frees_blocks(tmp_path: Path, where: str) -> None:
    folder = tmp_path if where == "tmp" else Path("/dev/shm")
    if not folder.is_dir():
        pytest.skip(f"{folder} does not exist")
    path = folder / f"bf-punch-{os.getpid()}.img"
    try:
        with FileBackend(str(path), 16 * MiB) as vol:
            vol.write(0, _pattern(16 * MiB, seed=5))
            vol.flush()
            before = os.stat(path).st_blocks
            vol.discard(MiB, 8 * MiB)
            vol.write_zeroes(10 * MiB, 2 * MiB)
            after = os.stat(path).st_blocks
            if after >= before and _fs_type(folder) not in PUNCHING_FS:
                pytest.skip(f"{where}: {_fs_type(folder)} did not deallocate (no hole punching)")
            assert (before - after) * 512 >= 10 * MiB - 64 * KiB
            assert _read(vol, MiB, 8 * MiB) == bytes(8 * MiB)
            assert _read(vol, 10 * MiB, 2 * MiB) == bytes(2 * MiB)
            assert _read(vol, 9 * MiB, 4096) != bytes(4096)
    finally:
        path.unlink(missing_ok=True)


def test_write_zeroes_falls_back_to_writing_zeros(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fallocate cannot punch holes (EOPNOTSUPP), zeros are written instead and discard
    quietly does nothing.  The unsupported fallocate is simulated; the file I/O is real."""
    def unsupported(*args: object) -> int:
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(backends, "_fallocate", unsupported)
    with FileBackend(str(tmp_path / "v.img"), 4 * MiB) as vol:
        data = _pattern(4 * MiB, seed=6)
        vol.write(0, data)
        vol.discard(0, MiB)
        assert _read(vol, 0, MiB) == data[:MiB]          # discard is advisory
        vol.write_zeroes(5, 2 * MiB + 3)
        assert _read(vol, 0, 4 * MiB) == data[:5] + bytes(2 * MiB + 3) + data[2 * MiB + 8:]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_flush_calls_fdatasync_on_the_volume(tmp_path: Path) -> None:
    """Observed in a real process with strace: flush (and nothing before it) syncs the fd."""
    trace = tmp_path / "trace"
    code = ("import os; from blockfabric.target.backends import FileBackend\n"
            f"vol = FileBackend({str(tmp_path / 'v.img')!r}, 1 << 20)\n"
            "vol.write(0, b'x' * 4096)\n"
            "os.write(2, b'fd=%d' % vol.fileno())\n"
            "vol.flush()\n")
    proc = subprocess.run(["strace", "-o", str(trace), "-e", "trace=fsync,fdatasync",
                           sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    fd = int(re.search(rb"fd=(\d+)", proc.stderr)[1])
    syncs = re.findall(r"^(f(?:data)?sync)\((\d+)\)\s+= 0", trace.read_text(), re.M)
    assert syncs == [("fdatasync", str(fd))]


def test_file_map_memory_is_shared_with_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "m.img")
    with FileBackend(path, MiB, map_memory=True) as vol:
        mem = vol.memory
        assert mem is not None and len(mem) == MiB
        mem[0:4] = b"mmap"
        vol.write(4096, b"pwrite")
        assert bytes(mem[4096:4102]) == b"pwrite"
        vol.flush()
        del mem
    with open(path, "rb") as f:
        assert f.read(4) == b"mmap"


# --- null -----------------------------------------------------------------------------------

def test_null_drops_writes_and_has_no_memory() -> None:
    with NullBackend(MiB) as null:
        null.write(0, b"\xff" * 4096)
        assert null.memory is None
        assert _read(null, 0, 4096) == bytes(4096)

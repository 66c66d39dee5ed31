"""Data through a real mount: a model comparison, fsync, punch hole / zero range, read-only
refusal, concurrency with more than one NVMe command in flight, and fio's own verifier."""

from __future__ import annotations

import errno
import os
import random
import re
import stat
import subprocess
import threading
import time

import pytest

from .conftest import MiB, Mount

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, mode, offset, length):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_files_sizes_and_modes(shared_mount):
    names = sorted(os.listdir(shared_mount.path))
    assert names == [".status", "n1", "n2", "n3"]
    sizes = {n: os.stat(shared_mount.file(n)) for n in ("n1", "n2", "n3")}
    assert sizes["n1"].st_size == 64 * MiB and sizes["n2"].st_size == 16 * MiB
    assert stat.S_ISREG(sizes["n1"].st_mode)
    assert stat.S_IMODE(sizes["n1"].st_mode) == 0o644
    assert stat.S_IMODE(sizes["n3"].st_mode) == 0o444
    assert stat.S_IMODE(os.stat(shared_mount.file(".status")).st_mode) == 0o444


def test_read_only_namespace_refuses_writes_with_erofs(shared_mount):
    with pytest.raises(OSError) as exc:
        os.open(shared_mount.file("n3"), os.O_WRONLY)
    assert exc.value.errno == errno.EROFS
    with pytest.raises(OSError) as exc:
        os.open(shared_mount.file(".status"), os.O_WRONLY)
    assert exc.value.errno == errno.EROFS
    fd = os.open(shared_mount.file("n3"), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == bytes(4096)
        with pytest.raises(OSError) as exc:
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096)
        assert exc.value.errno in (errno.EBADF, errno.EROFS)
    finally:
        os.close(fd)


def test_read_only_mount_option(make_mount):
    m = make_mount("ro", name="ro")
    assert stat.S_IMODE(os.stat(m.file("n1")).st_mode) == 0o444
    with pytest.raises(OSError) as exc:
        os.open(m.file("n1"), os.O_RDWR)
    assert exc.value.errno == errno.EROFS
    status = m.status()
    assert "ro," in status
    # the mount's reactor spin and its counters (docs/operations.md, spin_us)
    assert re.search(r"^spin +\d+ us: hits \d+, misses \d+, skipped for depth \d+, for CPU "
                     r"pressure \d+ \(limit \d+ %\)$", status, re.M), status


def _sleeps(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid``: its sleeps (a sched_yield
    counts as involuntary)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass                            # a thread that ended meanwhile
    return total


def test_the_spin_catches_a_qd1_readers_next_request(make_mount, monkeypatch):
    """With a spin (--spin-us), the mount's loop spins on after a reply while requests
    keep coming (fuse_kernel.EXPECT_WINDOW): a QD1 reader's next request, like the
    target's answer, is caught by the spin, so the mount hardly sleeps at all. (Without
    it the mount slept once a read, waiting for the next request; without a spin, twice.)"""
    monkeypatch.setenv("BLOCKFABRIC_REACTOR_SPIN_LOAD", "100")   # (the guard's own tests)
    m = make_mount(name="spin", transport="tcp", flags=("--spin-us", "5000"))
    pid = m.pid
    fd = os.open(m.file("n1"), os.O_RDONLY)
    try:
        os.pread(fd, 4096, 0)
        before = _sleeps(pid)
        reads = 400
        for i in range(reads):
            os.pread(fd, 4096, (i % 1024) * 4096)
        sleeps = _sleeps(pid) - before
    finally:
        os.close(fd)
    assert sleeps < 0.3 * reads, (sleeps, reads, m.status())


@pytest.mark.parametrize("options", ["", "cache", "binding=libfuse",
                                     "binding=libfuse,cache"])
def test_random_unaligned_io_matches_a_model(make_mount, options):
    """Seeded random writes and reads at any offset and length (mostly unaligned), in
    direct-I/O and page-cache modes, through both bindings, compared with a bytearray after
    every read."""
    m = make_mount(options, name=f"model-{options.replace('=', '-') or 'direct'}")
    assert f"binding={'libfuse' if 'libfuse' in options else 'kernel'}" in m.status()
    rnd = random.Random(5 + len(options))
    region = 2 * MiB
    base = 8 * MiB if options else 4 * MiB          # keep the two runs apart on n1
    fd = os.open(m.file("n1"), os.O_RDWR)
    try:
        model = bytearray(os.pread(fd, region, base))
        for _ in range(150):
            off = rnd.randrange(region - 1)
            length = rnd.choice([1, 7, 511, 512, 4095, 4096, 4097, 9000, 70000])
            length = min(length, region - off)
            if rnd.random() < 0.6:
                data = rnd.randbytes(length)
                assert os.pwrite(fd, data, base + off) == length
                model[off:off + length] = data
            else:
                assert os.pread(fd, length, base + off) == bytes(model[off:off + length])
        assert os.pread(fd, region, base) == bytes(model)
    finally:
        os.close(fd)
    assert m.counter("rmw blocks") > 0


def test_io_beyond_the_end(shared_mount):
    fd = os.open(shared_mount.file("n2"), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        assert os.pread(fd, 8192, size - 4096) == os.pread(fd, 4096, size - 4096)
        assert os.pread(fd, 10, size) == b""
        with pytest.raises(OSError) as exc:
            os.pwrite(fd, b"x", size)
        assert exc.value.errno in (errno.ENOSPC, errno.EFBIG)
    finally:
        os.close(fd)


def test_fsync_sends_flush_that_reaches_the_backing_file(shared_mount, target):
    """The target's file backend answers Flush with fdatasync: strace on the target shows
    it happen for our fsync, and the data is in the backing file."""
    strace = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=fdatasync,fsync",
                               "-p", str(target.proc.pid)], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)                     # strace attaches to every thread
        data = random.Random(3).randbytes(3 * 4096 + 100)
        fd = os.open(shared_mount.file("n2"), os.O_RDWR)
        try:
            before = shared_mount.counter("flushes")
            os.pwrite(fd, data, 12345)
            os.fsync(fd)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        time.sleep(0.3)
    finally:
        strace.terminate()
        _, err = strace.communicate(timeout=10)
    assert shared_mount.counter("flushes") >= before + 2
    assert "fdatasync(" in err, err
    with open(target.backing, "rb") as f:
        f.seek(12345)
        assert f.read(len(data)) == data


def allocated(path, offset: int, length: int) -> int:
    """Bytes of [offset, offset+length) that the file system holds data for (SEEK_DATA)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total, pos, end = 0, offset, offset + length
        while pos < end:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            if start >= end:
                break
            stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
            total += stop - start
            pos = stop
        return total
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode,counter", [
    (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, "discards"),
    (FALLOC_FL_ZERO_RANGE, "write zeroes"),
])
def test_punch_hole_and_zero_range(shared_mount, target, mode, counter):
    """Unaligned range: edges zeroed by RMW, whole blocks by DSM deallocate / Write Zeroes,
    which the file backend turns into a hole in its backing file."""
    base = 4 * MiB if counter == "discards" else 6 * MiB
    data = random.Random(mode).randbytes(MiB)
    fd = os.open(shared_mount.file("n2"), os.O_RDWR)
    try:
        os.pwrite(fd, data, base)
        os.fsync(fd)
        assert allocated(target.backing, base, MiB) == MiB
        before = shared_mount.counter(counter)
        lo, hi = 1000, 700_000                    # both edges mid-block
        fallocate(fd, mode, base + lo, hi - lo)
        expect = data[:lo] + bytes(hi - lo) + data[hi:]
        assert os.pread(fd, MiB, base) == expect
    finally:
        os.close(fd)
    assert shared_mount.counter(counter) == before + 1
    whole = (hi // 4096) * 4096 - (-(-lo // 4096) * 4096)
    assert allocated(target.backing, base, MiB) <= MiB - whole


def test_many_concurrent_readers_and_writers(shared_mount):
    """16 threads on disjoint regions of n1 (unaligned writes too), then a check; .status
    must show more than one command in flight on some queue at once."""
    rnd = random.Random(11)
    chunk = 256 * 1024
    payloads = [rnd.randbytes(chunk) for _ in range(16)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            fd = os.open(shared_mount.file("n1"), os.O_RDWR)
            try:
                base = 32 * MiB + i * chunk
                r = random.Random(i)
                for _ in range(40):
                    off = r.randrange(0, chunk - 5000)
                    n = r.randrange(1, 5000)
                    os.pwrite(fd, payloads[i][off:off + n], base + off)
                    got = os.pread(fd, 4096, base + r.randrange(0, chunk - 4096))
                    assert len(got) == 4096
                os.pwrite(fd, payloads[i], base)
                assert os.pread(fd, chunk, base) == payloads[i]
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    inflight = [int(line.split("max in flight ")[1].split(",")[0])
                for line in shared_mount.status().splitlines() if "(io)" in line]
    assert max(inflight) > 1, shared_mount.status()


@pytest.mark.parametrize("binding, transport", [("kernel", "rdma"), ("libfuse", "rdma"),
                                                ("kernel", "tcp")])
def test_fio_verify_crc32c(make_mount, binding, transport):
    shared_mount = make_mount(f"binding={binding}", name=f"fio-{binding}-{transport}",
                              transport=transport)
    assert f"path        {transport} 127.0.0.1:" in shared_mount.status()
    proc = subprocess.run(
        ["fio", "--name=verify", f"--filename={shared_mount.file('n1')}", "--direct=1",
         "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k", "--size=8M",
         "--offset=48M", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
         "--randrepeat=1", "--verify_state_save=0", "--output-format=terse"],
        capture_output=True, text=True, timeout=60, cwd=shared_mount.path + "/..")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if binding == "kernel":
        # half the pipeline per wake-up (fuse_kernel._on_readable): fio keeps 16 requests
        # going, so a wake-up read several of them, and never more than 8
        intake = shared_mount.counter("largest intake")
        assert 2 <= intake <= 8, shared_mount.status()


def test_shallow_queue_parks_requests_and_loses_nothing(target, tmp_path):
    """-Q 16: the kernel binding may keep only 8 commands in flight from the reactor (the
    rest of the slots are the workers'), so fio at depth 64 with 1 MiB and unaligned 4 KiB
    writes makes it park requests and stop reading /dev/fuse; everything must still verify,
    and no queue may ever hold more than its 16 slots."""
    m = Mount(target, tmp_path, name="shallow")
    argv = m.argv()
    m.argv = lambda: argv[:-1] + ["-Q", "16", "-i", "1"] + argv[-1:]
    m.start()
    try:
        jobs = [["--name=big", "--bs=1m", "--iodepth=64", "--size=16M", "--offset=0"],
                ["--name=small", "--bs=4k", "--iodepth=64", "--size=4M", "--offset=20M"],
                ["--name=odd", "--bs=3k", "--iodepth=8", "--size=3M", "--offset=30M",
                 "--direct=0"]]
        procs = [subprocess.Popen(
            ["fio", *job, f"--filename={m.file('n1')}", "--direct=1", "--ioengine=libaio",
             "--rw=randwrite", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
             "--randrepeat=1", "--verify_state_save=0", "--output-format=terse"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for job in jobs]
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, out + err
        status = m.status()
        inflight = [int(line.split("max in flight ")[1].split(",")[0])
                    for line in status.splitlines() if "(io)" in line]
        assert inflight and max(inflight) <= 16, status
        assert m.counter("parked") > 0, status
        assert m.counter("errors") == 0, status
    finally:
        m.cleanup()

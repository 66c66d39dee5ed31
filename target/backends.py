"""Volume backends: where a namespace's bytes live.

The interface is offset based, in the nbdkit style: ``readinto`` fills the caller's buffer
(typically a registered RDMA buffer, so no copy is made on the way), ``write`` takes any
buffer.  Offsets and lengths are in bytes; the controller converts LBAs and checks alignment.

Errors are ``OSError`` with an errno, which the controller maps to an NVMe status:
``ERANGE`` (outside the volume) -> LBA out of range 0x080, ``EROFS`` -> namespace is write
protected 0x020, ``ENOSPC`` -> capacity exceeded 0x081 (as nvmet's errno_to_nvme_status),
anything else (``EIO``...) -> a media or internal error.  ``EBADF`` means the backend is closed.

``memory`` is a writable memoryview of the whole volume when the volume *is* memory (the
ramdisk): the target registers it as an RDMA memory region and RDMA-WRITEs read data straight
out of it / RDMA-READs write data straight into it.  Other backends return None and the
target moves data through registered bounce buffers with ``readinto``/``write``.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import stat
from typing import Any, Callable

from blockfabric import numa
from blockfabric.sizes import MiB, format_size
from blockfabric.target.config import Namespace

log = logging.getLogger(__name__)

_ZEROS = memoryview(bytes(MiB))


def _fill_zero(buf: memoryview) -> None:
    """Zero ``buf`` in place without allocating a buffer of its size."""
    for start in range(0, len(buf), len(_ZEROS)):
        chunk = min(len(_ZEROS), len(buf) - start)
        buf[start:start + chunk] = _ZEROS[:chunk]


def _bytes_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (lengths then count bytes)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Unavailable(OSError):
    """The volume's store did not answer (a Ceph cluster that is down): not this command's
    fault; the target marks the namespace unavailable (see rbdvolume.VolumeWatch)."""


class Backend(abc.ABC):
    """One volume.  The public methods check state, bounds and read-only once, here; the
    subclasses implement the underscored operations on ranges known to be valid.

    A backend with ``aio = True`` (RBD) also runs the per-I/O operations asynchronously with
    ``start(post, done, op, *args)``, ``done(exc)`` handed back through ``post`` (the
    reactor's call_soon_threadsafe), instead of on the target's backend threads."""

    aio = False
    #: Why the volume does not answer now (None: it does); set on the reactor only.
    unavailable: str | None = None

    def start(self, post: Callable[[Callable[[], None]], None],
              done: Callable[[BaseException | None], None], op: str, *args: object) -> None:
        raise NotImplementedError

    def __init__(self, size: int, block_size: int = 4096, read_only: bool = False) -> None:
        if size <= 0 or size % block_size:
            raise ValueError(f"size {size} is not a positive multiple of block size {block_size}")
        self.size = size
        self.block_size = block_size
        self.read_only = read_only
        self.pinned = False     # True while an RDMA memory region covers ``memory``
        self.closed = False

    @property
    def memory(self) -> memoryview | None:
        """The whole volume as writable memory, when it is memory; else None."""
        return None

    def readinto(self, offset: int, buf: object) -> None:
        """Fill ``buf`` (a writable buffer) with the bytes at ``offset``."""
        view = _bytes_view(buf)
        self._check(offset, len(view))
        self._readinto(offset, view)

    def write(self, offset: int, data: object) -> None:
        """Write all of ``data`` (any buffer) at ``offset``."""
        view = _bytes_view(data)
        self._check(offset, len(view), writing=True)
        self._write(offset, view)

    def write_zeroes(self, offset: int, length: int) -> None:
        """Make ``length`` bytes at ``offset`` read as zero (deallocating where possible)."""
        self._check(offset, length, writing=True)
        self._write_zeroes(offset, length)

    def discard(self, offset: int, length: int) -> None:
        """Tell the backend the range is unused (NVMe deallocate; advisory)."""
        self._check(offset, length, writing=True)
        self._discard(offset, length)

    def flush(self) -> None:
        """Make completed writes durable."""
        self._check(0, 0)
        self._flush()

    def resize(self, size: int) -> None:
        """Change the volume's size (a reload).  Memory regions over ``memory`` must be gone
        first, since the mapping may move."""
        if self.closed:
            raise OSError(errno.EBADF, f"{self!r} is closed")
        if size <= 0 or size % self.block_size:
            raise OSError(errno.EINVAL, f"size {size} is not a positive multiple of block "
                                        f"size {self.block_size}")
        self._resize(size)
        self.size = size

    def _resize(self, size: int) -> None:
        pass

    def close(self) -> None:
        """Release the volume (idempotent).  Memory regions over ``memory`` go first."""
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "ro" if self.read_only else "rw"
        return f"<{type(self).__name__} {format_size(self.size)} bs={self.block_size} {mode}>"

    def _check(self, offset: int, length: int, writing: bool = False) -> None:
        if self.closed:
            raise OSError(errno.EBADF, f"{self!r} is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OSError(errno.ERANGE, f"bytes {offset}..{offset + length} lie outside the "
                                        f"volume of {self.size} bytes")
        if writing and self.read_only:
            raise OSError(errno.EROFS, f"{self!r} is read-only")

    @abc.abstractmethod
    def _readinto(self, offset: int, buf: memoryview) -> None: ...

    @abc.abstractmethod
    def _write(self, offset: int, data: memoryview) -> None: ...

    @abc.abstractmethod
    def _write_zeroes(self, offset: int, length: int) -> None: ...

    def _discard(self, offset: int, length: int) -> None:
        self._write_zeroes(offset, length)

    def _flush(self) -> None:
        pass

    def _close(self) -> None:
        pass


class RamdiskBackend(Backend):
    """Anonymous private memory.  Pages cost nothing until written, and zeroing whole pages
    hands them back to the kernel (MADV_DONTNEED), so a large, mostly empty ramdisk stays
    cheap.  Contents vanish with the process.  The mapping is accounted at creation (no
    MAP_NORESERVE), so a ramdisk larger than RAM + swap fails at start rather than getting
    the daemon OOM-killed later."""

    #: Set by a target with poll groups (target.pollgroups): ramdisks are then made in
    #: shared memory (a memfd mapped MAP_SHARED) so that every worker maps the same bytes.
    #: A shared ramdisk zeroes in place (no page is handed back: see _write_zeroes).
    shared = False

    def __init__(self, size: int, block_size: int = 4096, read_only: bool = False,
                 fd: int | None = None) -> None:
        super().__init__(size, block_size, read_only)
        #: the memfd behind a shared ramdisk (``fd``: another process's, inherited), or None
        self.memfd: int | None = None
        if fd is None and self.shared:
            fd = os.memfd_create(f"blockfabric-ramdisk-{size}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                raise
        if fd is None:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            self.memfd = fd
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        numa.bind_region(self._map, "ramdisks")     # before any page is touched
        self._view = memoryview(self._map)

    @property
    def memory(self) -> memoryview:
        return self._view

    def _readinto(self, offset: int, buf: memoryview) -> None:
        buf[:] = self._view[offset:offset + len(buf)]

    def _write(self, offset: int, data: memoryview) -> None:
        self._view[offset:offset + len(data)] = data

    def _write_zeroes(self, offset: int, length: int) -> None:
        page = mmap.PAGESIZE
        first = -(-offset // page) * page               # first whole page in the range
        last = (offset + length) // page * page          # end of the last whole page
        # Not while an RDMA memory region pins the volume: MADV_DONTNEED would give the
        # process fresh zero pages while the NIC keeps the old ones, and reads (RDMA WRITEs
        # straight out of the MR) would return the discarded data (seen on rxe in the lab).
        # Nor in shared memory (poll groups): ``pinned`` is this process's, and another
        # process may have the pages registered; and a hole punched here is faulted back
        # page by page (allocated, cleared, then zeroed again) by a group that zeroes in
        # place: 4 MiB Write Zeroes cost 250 us on one reactor, 630-940 us on two, with the
        # worker taking 250-340k minor faults/s (docs/scaling.md, "Write Zeroes").
        if last > first and not self.pinned and self.memfd is None:
            _fill_zero(self._view[offset:first])
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
            _fill_zero(self._view[last:offset + length])
        else:
            _fill_zero(self._view[offset:offset + length])

    def _resize(self, size: int) -> None:
        # mremap keeps the pages (no copy, and untouched pages stay unallocated); growing
        # adds zero pages, shrinking hands the tail back.
        self._view.release()
        try:
            self._map.resize(size)
        finally:
            self._view = memoryview(self._map)

    def _close(self) -> None:
        self._view.release()
        self._map.close()   # BufferError here means a memory region still holds the volume
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int
_PUNCH_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FileBackend(Backend):
    """A regular file or a block device, read and written with os.preadv/os.pwritev straight
    into/out of the caller's (registered) buffers; they release the GIL, so a thread pool can
    run them in parallel.

    Sizing: a missing file is created sparse at ``size``; an existing smaller file is grown
    sparse to ``size`` (the new tail reads as zeros: this is how a volume is enlarged); an
    existing file or device *larger* than ``size`` is refused with EINVAL, since exposing a
    prefix hides data and truncating would destroy it.  A read-only volume is never created
    or grown.

    write_zeroes and discard punch holes (fallocate PUNCH_HOLE|KEEP_SIZE) where the file system
    or device supports it; otherwise write_zeroes writes zeros and discard does nothing (NVMe
    deallocate is advisory).

    ``map_memory=True`` also maps the file MAP_SHARED and offers it as ``memory``.  It is off by
    default: on a sparse file, a store into a hole when the file system is full raises SIGBUS,
    which would kill the whole daemon instead of failing one command with ENOSPC.
    """

    def __init__(self, path: str, size: int, block_size: int = 4096, read_only: bool = False,
                 map_memory: bool = False) -> None:
        super().__init__(size, block_size, read_only)
        self.path = path
        flags = os.O_CLOEXEC | (os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT)
        self._fd = os.open(path, flags, 0o600)
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        try:
            self._fit_size()
            if map_memory:
                prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
                self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=prot)
                self._view = memoryview(self._map)
        except BaseException:
            os.close(self._fd)
            raise

    def _fit_size(self) -> None:
        st = os.fstat(self._fd)
        if stat.S_ISBLK(st.st_mode):
            actual = os.lseek(self._fd, 0, os.SEEK_END)
        elif stat.S_ISREG(st.st_mode):
            actual = st.st_size
        else:
            raise OSError(errno.EINVAL, "not a regular file or block device", self.path)
        if actual > self.size:
            raise OSError(errno.EINVAL, f"is {actual} bytes ({format_size(actual)}), larger than "
                          f"the configured size {format_size(self.size)}: set size to "
                          f"{format_size(actual)} (refusing to hide or truncate data)", self.path)
        if actual < self.size:
            if self.read_only or stat.S_ISBLK(st.st_mode):
                raise OSError(errno.EINVAL, f"is {actual} bytes, smaller than the configured "
                              f"size {format_size(self.size)}", self.path)
            os.ftruncate(self._fd, self.size)
            log.info("%s: %s sparse to %s", self.path, "grew" if actual else "created",
                     format_size(self.size))

    @property
    def memory(self) -> memoryview | None:
        return self._view

    def _resize(self, size: int) -> None:
        # Grow only: shrinking a file would destroy the data past the new end.
        if size < self.size:
            raise OSError(errno.EINVAL, f"cannot shrink a file volume from "
                          f"{format_size(self.size)} to {format_size(size)} (data would be "
                          "lost)", self.path)
        if self.read_only:
            raise OSError(errno.EROFS, "a read-only volume is never grown", self.path)
        st = os.fstat(self._fd)
        if stat.S_ISBLK(st.st_mode):
            raise OSError(errno.EINVAL, "a block device takes its size from the device",
                          self.path)
        os.ftruncate(self._fd, size)
        if self._map is not None and self._view is not None:
            self._view.release()
            self._map.resize(size)
            self._view = memoryview(self._map)
        log.info("%s: grew sparse to %s", self.path, format_size(size))

    def fileno(self) -> int:
        return self._fd

    def _readinto(self, offset: int, buf: memoryview) -> None:
        done = os.preadv(self._fd, (buf,), offset) if buf else 0
        if done == len(buf):        # all of it at once: the usual case, no slicing
            return
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"unexpected end of file at {offset + done} (was the "
                                         "file truncated behind the target's back?)", self.path)
            done += n

    def _write(self, offset: int, data: memoryview) -> None:
        done = os.pwritev(self._fd, (data,), offset) if data else 0
        while done < len(data):
            done += os.pwritev(self._fd, [data[done:]], offset + done)

    def _punch(self, offset: int, length: int) -> bool:
        """Deallocate the range; False where the file system or device cannot."""
        if length == 0:
            return True
        if _fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length):
            err = ctypes.get_errno()
            if err in _PUNCH_UNSUPPORTED:
                return False
            raise OSError(err, os.strerror(err), self.path)
        return True

    def _write_zeroes(self, offset: int, length: int) -> None:
        if not self._punch(offset, length):
            for start in range(offset, offset + length, len(_ZEROS)):
                self._write(start, _ZEROS[:min(len(_ZEROS), offset + length - start)])

    def _discard(self, offset: int, length: int) -> None:
        self._punch(offset, length)

    def _flush(self) -> None:
        if self._map is not None:
            self._map.flush()
        os.fdatasync(self._fd)

    def _close(self) -> None:
        try:
            if self._map is not None:
                if self._view is not None:
                    self._view.release()
                self._map.close()
        finally:
            os.close(self._fd)


class NullBackend(Backend):
    """Reads return zeros and writes are dropped: measures the fabric without any storage."""

    def _readinto(self, offset: int, buf: memoryview) -> None:
        _fill_zero(buf)

    def _write(self, offset: int, data: memoryview) -> None:
        pass

    def _write_zeroes(self, offset: int, length: int) -> None:
        pass


def _sized(ns: Namespace) -> int:
    assert ns.size is not None      # the config requires a size of every backend but rbd
    return ns.size


def _path(ns: Namespace) -> str:
    assert ns.path is not None      # the config requires a path of backend file
    return ns.path


_OPENERS: dict[str, Callable[[Namespace], Backend]] = {
    "ramdisk": lambda ns: RamdiskBackend(_sized(ns), ns.block_size, ns.read_only),
    "file": lambda ns: FileBackend(_path(ns), _sized(ns), ns.block_size, ns.read_only),
    "null": lambda ns: NullBackend(_sized(ns), ns.block_size, ns.read_only),
    "rbd": lambda ns: _open_rbd(ns),
}


def _open_rbd(ns: Namespace) -> Backend:
    from blockfabric.target.rbdvolume import open_rbd    # python3-rbd only when used
    return open_rbd(ns)


def open_backend(ns: Namespace) -> Backend:
    """Open the volume behind a configured namespace."""
    return _OPENERS[ns.backend](ns)

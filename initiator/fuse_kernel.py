"""A FUSE server that speaks the kernel's protocol on /dev/fuse itself, run by the reactor.

Why (measured, docs/fuse.md): with a FUSE library, every request is a worker thread that
submits an NVMe command and then sleeps until the controller's reactor wakes it: two thread
hand-offs and a GIL round trip per I/O, and a pool of threads fighting for the GIL.  Here the
/dev/fuse descriptor is one more file the controller's reactor polls, so a read or write goes
from the FUSE request to the NVMe command and back to the FUSE reply on one thread, with no
wait and no wake-up:

* each request is read (``readv``) into a buffer of a region registered with the
  controller's protection domain, so a WRITE's payload is already where the target's RDMA
  READ fetches it, and a READ's data lands by RDMA WRITE where the reply is sent from
  (``writev`` of the reply header and that memory): no copy of the data in this process;
* the reply is written from the completion callback, on the reactor;
* what must wait (read-modify-write of unaligned edges, fsync, fallocate) runs on a few
  worker threads that reply themselves, and never holds the reactor.

Flow control: at most ``buffers`` requests are read ahead; at most ``depth - reserve`` NVMe
commands are in flight from here, so a queue always has a free slot for the reactor (it must
never wait for one: it is the thread that frees them) and the workers keep a reserve.

The protocol facts (structure layouts, opcodes, flags) are those of the kernel's UAPI header
``linux/fuse.h``; the mount is mount(2) as root, or fusermount3 passing the descriptor back
over a socket (``_FUSE_COMMFD``) for an ordinary user.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import mmap
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from typing import Any, Callable

from blockfabric.initiator.fusefs import STATUS_NAME, SUBTYPE, VolumeFS, nvme_errno
from blockfabric.protocol import IOOpcode
from blockfabric.rdma import Access

log = logging.getLogger(__name__)

MAX_REQUEST = 1 << 20           # max_read / max_write: 1 MiB requests both ways
DATA_OFF = 4096                 # where a READ's data lands in its buffer (page aligned)
EDGE_ROOM = 64 << 10            # room for unaligned edges (two blocks of up to 32 KiB)
BUF_SIZE = DATA_OFF + MAX_REQUEST + EDGE_ROOM
DEFAULT_BUFFERS = 48
WORKER_RESERVE = 16             # command slots left to the worker threads
ATTR_TIMEOUT = 1.0              # seconds the kernel may cache names and attributes
INIT_TIMEOUT = 10.0

# -- linux/fuse.h ------------------------------------------------------------------------
KERNEL_MAJOR, OUR_MINOR = 7, 31
ROOT_ID, STATUS_ID, NS_BASE_ID = 1, 2, 16
(LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME,
 LINK, OPEN, READ, WRITE, STATFS, RELEASE) = (1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15,
                                              16, 17, 18)
(FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT, OPENDIR, READDIR,
 RELEASEDIR, FSYNCDIR, ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE,
 RENAME2, TMPFILE) = (20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 34, 35, 36, 38, 42, 43,
                      45, 51)
_READ_ONLY_FS_OPS = {SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, CREATE, RENAME2,
                     TMPFILE}
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_ASYNC_DIO, FUSE_MAX_PAGES = 1, 1 << 5, 1 << 15, 1 << 22
FOPEN_DIRECT_IO, FOPEN_PARALLEL_DIRECT_WRITES = 1, 1 << 6
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8

IN_HDR = struct.Struct("<IIQQIIIHH")             # fuse_in_header, 40
OUT_HDR = struct.Struct("<IiQ")                  # fuse_out_header, 16
IN_SIZE = IN_HDR.size
_ATTR = "QQQQQQIIIIIIIIII"                       # fuse_attr, 88
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)     # fuse_entry_out, 128
ATTR_OUT = struct.Struct("<QII" + _ATTR)         # fuse_attr_out, 104
INIT_IN = struct.Struct("<IIII")                 # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")      # fuse_init_out, 64
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QII")
RW_IN = struct.Struct("<QQIIQII")                # fuse_read_in / fuse_write_in, 40
WRITE_OUT = struct.Struct("<II")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # fuse_setattr_in, 88
FALLOCATE_IN = struct.Struct("<QQQII")
KSTATFS = struct.Struct("<QQQQQIIII24x")         # fuse_kstatfs, 80
DIRENT = struct.Struct("<QQII")
WRITE_DATA = IN_SIZE + RW_IN.size                # a WRITE's payload starts here (80)

MS_RDONLY, MS_NOSUID, MS_NODEV, MNT_DETACH = 1, 2, 4, 2
_TERM_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class FuseMountError(RuntimeError):
    """The kernel or fusermount3 refused the mount; the message says why."""


def library_version() -> str:
    return f"kernel FUSE protocol {KERNEL_MAJOR}.{OUR_MINOR}, no library"


# --------------------------------------------------------------------------- mounting

def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_fd(mountpoint: str, fsname: str, *, read_only: bool, allow_other: bool,
             extra: list[str]) -> int:
    """A /dev/fuse descriptor mounted at ``mountpoint``: mount(2) when allowed (root),
    else fusermount3."""
    words = ["default_permissions", f"max_read={MAX_REQUEST}"] + \
        (["allow_other"] if allow_other else []) + list(extra)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = (f"fd={fd},rootmode={stat.S_IFDIR:o},user_id={os.getuid()},"
            f"group_id={os.getgid()}," + ",".join(words))
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    libc = _libc()
    if libc.mount(fsname.encode(), mountpoint.encode(), f"fuse.{SUBTYPE}".encode(), flags,
                  data.encode()) == 0:
        return fd
    err = ctypes.get_errno()
    os.close(fd)
    if err != errno.EPERM:
        raise FuseMountError(f"mount {mountpoint} (options {','.join(words)}): "
                             f"{os.strerror(err)}")
    return _fusermount(mountpoint, fsname, read_only, words)


def _fusermount(mountpoint: str, fsname: str, read_only: bool, words: list[str]) -> int:
    tool = shutil.which("fusermount3")
    if tool is None:
        raise FuseMountError("not root and fusermount3 is not installed (package fuse3)")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        opts = ",".join(["ro" if read_only else "rw", "nosuid", "nodev",
                         f"fsname={fsname}", f"subtype={SUBTYPE}"] + words)
        done = subprocess.run([tool, "-o", opts, "--", mountpoint], capture_output=True,
                              text=True, pass_fds=(theirs.fileno(),),
                              env=dict(os.environ, _FUSE_COMMFD=str(theirs.fileno())),
                              stdin=subprocess.DEVNULL, check=False)
        if done.returncode:
            raise FuseMountError(f"fusermount3: {done.stderr.strip() or done.returncode}")
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise FuseMountError("fusermount3 mounted but passed no descriptor back")
    os.set_inheritable(fds[0], False)
    return fds[0]


def unmount_path(mountpoint: str) -> None:
    """Detach the mount (the kernel then ends the session: reads get ENODEV)."""
    if _libc().umount2(mountpoint.encode(), MNT_DETACH) == 0:
        return
    tool = shutil.which("fusermount3")
    if tool is not None:
        subprocess.run([tool, "-u", "-z", mountpoint], capture_output=True,
                       stdin=subprocess.DEVNULL, check=False)


# --------------------------------------------------------------------------- the server

class _Buffers:
    """Request buffers in one region registered with the controller's PD."""

    def __init__(self, ctrl: Any, count: int) -> None:
        self._mem = mmap.mmap(-1, count * BUF_SIZE)
        self.mr = ctrl.pd.reg_mr(self._mem, Access.LOCAL_WRITE | Access.REMOTE_READ
                                 | Access.REMOTE_WRITE)
        view = self.mr.buf
        self.views = [view[i * BUF_SIZE:(i + 1) * BUF_SIZE] for i in range(count)]
        self.addrs = [self.mr.addr + i * BUF_SIZE for i in range(count)]
        self.free = list(range(count - 1, -1, -1))

    def close(self) -> None:
        self.views = []
        try:
            self.mr.close()
        finally:
            try:
                self._mem.close()
            except BufferError:
                pass


class KernelFuse:
    """One mount: the /dev/fuse session of ``fs``, served on its controller's reactor."""

    def __init__(self, fs: VolumeFS, mountpoint: str, fsname: str,
                 buffers: int = DEFAULT_BUFFERS) -> None:
        self.fs = fs
        self.ctrl = fs.ctrl
        self.reactor = fs.ctrl.reactor
        self.mountpoint = mountpoint
        self.fsname = fsname
        self.fd = -1
        self.bufs = _Buffers(self.ctrl, buffers)
        self.nbuf = buffers
        self._lock = threading.Lock()
        self._inflight = 0                      # NVMe commands issued from the fast path
        self._parked: tuple[int, int] | None = None   # (buffer, length) waiting for slots
        self._reading = False
        self.initialized = threading.Event()
        self.done = threading.Event()
        self._stopping = False
        self.kernel_minor = 0
        self._workers = concurrent.futures.ThreadPoolExecutor(
            fs.options.worker_threads(),
            thread_name_prefix="fuse-worker")
        self._ops: dict[int, Callable[[int, int, int, memoryview, int], bool]] = {
            INIT: self._init, LOOKUP: self._lookup, GETATTR: self._getattr,
            SETATTR: self._setattr, OPEN: self._open, READ: self._read, WRITE: self._write,
            STATFS: self._statfs, RELEASE: self._ok, FLUSH: self._ok, RELEASEDIR: self._ok,
            FSYNCDIR: self._ok, ACCESS: self._ok, OPENDIR: self._opendir,
            READDIR: self._readdir, FSYNC: self._fsync, FALLOCATE: self._fallocate,
            DESTROY: self._destroy}

    # -- limits ------------------------------------------------------------------------
    def _limit(self) -> int:
        """Commands the fast path may have in flight: a queue's depth less the workers'
        reserve (at most half of it)."""
        queues = self.ctrl.io_queues
        depth = min((q.depth for q in queues), default=32)
        return max(1, depth - min(WORKER_RESERVE, depth // 2))

    # -- lifecycle -----------------------------------------------------------------------
    def mount(self) -> None:
        opts = self.fs.options
        self.fd = mount_fd(self.mountpoint, self.fsname, read_only=opts.read_only,
                           allow_other=opts.allow_other, extra=opts.extra)
        os.set_blocking(self.fd, False)
        self.reactor.call_sync(self._start_reading)

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Wait for the kernel's INIT, report ready, then serve until unmounted or a
        termination signal (which unmounts)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _TERM_SIGNALS:
                previous[sig] = signal.signal(sig, lambda *_: self.stop())
        try:
            if not self.initialized.wait(INIT_TIMEOUT) and not self.done.is_set():
                raise FuseMountError(f"the kernel sent no INIT within {INIT_TIMEOUT:g} s")
            if self.initialized.is_set() and on_ready is not None:
                on_ready()
            while not self.done.wait(0.5):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def stop(self) -> None:
        """Unmount; the session ends when the kernel says so (ENODEV)."""
        if self._stopping:
            return
        self._stopping = True
        unmount_path(self.mountpoint)
        # A session the kernel never started (no INIT yet) never reports ENODEV by itself
        if not self.initialized.is_set():
            self.done.set()

    def close(self, drain: float = 5.0) -> None:
        """Stop reading, let commands in flight finish (their replies and the RDMA into
        the buffers), then close the descriptor and deregister the buffers."""
        self.done.set()
        try:
            self.reactor.call_sync(self._stop_reading)
        except TimeoutError:
            pass
        self._workers.shutdown(wait=True, cancel_futures=True)
        deadline = time.monotonic() + drain
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._inflight:
            log.warning("%d commands still in flight at unmount", self._inflight)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        self.bufs.close()

    def _start_reading(self) -> None:
        if not self._reading and not self.done.is_set():
            self._reading = True
            self.reactor.add_reader(self.fd, self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.reactor.remove_reader(self.fd, self._on_readable)

    # -- the loop (reactor thread) ---------------------------------------------------------
    def _on_readable(self) -> None:
        bufs = self.bufs
        for _ in range(64):
            if self._parked is not None or not bufs.free:
                self._stop_reading()
                return
            with self._lock:
                index = bufs.free.pop()
            try:
                n = os.readv(self.fd, [bufs.views[index]])
            except BlockingIOError:
                self._release(index)
                return
            except OSError as exc:
                self._release(index)
                if exc.errno in (errno.ENOENT, errno.EINTR):   # interrupted: next one
                    continue
                self._ended(exc)
                return
            if n < IN_SIZE:
                self._release(index)
                continue
            self._dispatch(index, n)

    def _ended(self, exc: OSError) -> None:
        if exc.errno != errno.ENODEV:
            log.error("reading /dev/fuse: %s", exc)
        self._stop_reading()
        self.done.set()

    def _dispatch(self, index: int, n: int) -> None:
        view = self.bufs.views[index]
        _len, opcode, unique, nodeid, _uid, _gid, _pid, _ext, _pad = IN_HDR.unpack_from(view)
        op = self._ops.get(opcode)
        try:
            if op is not None:
                if op(index, unique, nodeid, view, n):
                    return                      # it owns the buffer now
            elif opcode in _NO_REPLY:
                pass
            elif opcode in _READ_ONLY_FS_OPS:
                self._error(unique, errno.EROFS)
            else:
                self._error(unique, errno.ENOSYS)
        except OSError as exc:
            self._error(unique, exc.errno or errno.EIO)
        except Exception:  # noqa: BLE001  (one bad request must not end the mount)
            log.exception("FUSE opcode %d", opcode)
            self._error(unique, errno.EIO)
        self._release(index)

    def _release(self, index: int) -> None:
        with self._lock:
            self.bufs.free.append(index)
        if not self._reading and not self.done.is_set():
            self.reactor.call_soon_threadsafe(self._resume)

    def _resume(self) -> None:
        if self._parked is not None:
            index, n = self._parked
            self._parked = None
            self._dispatch(index, n)
        if self._parked is None and not self.done.is_set():
            self._start_reading()

    # -- replies -------------------------------------------------------------------------
    def _reply(self, unique: int, *parts) -> None:
        size = OUT_HDR.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [OUT_HDR.pack(size, 0, unique), *parts])
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EBADF, errno.ENODEV):
                log.warning("FUSE reply to %d: %s", unique, exc)

    def _error(self, unique: int, code: int) -> None:
        try:
            os.write(self.fd, OUT_HDR.pack(OUT_HDR.size, -code, unique))
        except OSError:
            pass  # the request was interrupted, or the session is over

    def _ok(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        self._reply(unique)
        return False

    # -- names and attributes ------------------------------------------------------------
    def _path(self, nodeid: int) -> str:
        if nodeid == ROOT_ID:
            return "/"
        if nodeid == STATUS_ID:
            return "/" + STATUS_NAME
        name = f"n{nodeid - NS_BASE_ID}"
        if name not in self.fs.files:
            raise OSError(errno.ENOENT, "namespace gone")
        return "/" + name

    @staticmethod
    def _node(name: str) -> int:
        if name == STATUS_NAME:
            return STATUS_ID
        return NS_BASE_ID + int(name[1:])

    def _attr(self, nodeid: int) -> tuple:
        st = self.fs.getattr(self._path(nodeid))
        at, mt, ct = st["st_atime"], st["st_mtime"], st["st_ctime"]
        return (nodeid, st.get("st_size", 0), st.get("st_blocks", 0),
                at // 10**9, mt // 10**9, ct // 10**9, at % 10**9, mt % 10**9, ct % 10**9,
                st["st_mode"], st["st_nlink"], st["st_uid"], st["st_gid"], 0,
                st.get("st_blksize", 4096), 0)

    def _entry(self, unique: int, nodeid: int) -> None:
        sec, nsec = int(ATTR_TIMEOUT), int(ATTR_TIMEOUT % 1 * 1e9)
        self._reply(unique, ENTRY_OUT.pack(nodeid, 0, sec, sec, nsec, nsec,
                                           *self._attr(nodeid)))

    def _attr_reply(self, unique: int, nodeid: int) -> None:
        sec, nsec = int(ATTR_TIMEOUT), int(ATTR_TIMEOUT % 1 * 1e9)
        self._reply(unique, ATTR_OUT.pack(sec, nsec, 0, *self._attr(nodeid)))

    def _init(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        major, minor, readahead, flags = INIT_IN.unpack_from(view, IN_SIZE)
        if major != KERNEL_MAJOR:
            # a newer major: answer with ours and wait for the kernel to retry (fuse.h)
            self._reply(unique, INIT_OUT.pack(KERNEL_MAJOR, OUR_MINOR, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0))
            return False
        self.kernel_minor = minor
        want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_MAX_PAGES
        background = self.nbuf
        self._reply(unique, INIT_OUT.pack(
            KERNEL_MAJOR, min(minor, OUR_MINOR), readahead, flags & want, background,
            background * 3 // 4, MAX_REQUEST, 1, MAX_REQUEST // mmap.PAGESIZE, 0, 0))
        self.initialized.set()
        return False

    def _destroy(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        self._reply(unique)
        self._stop_reading()
        self.done.set()
        return False

    def _lookup(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        name = bytes(view[IN_SIZE:n]).split(b"\0", 1)[0].decode(errors="replace")
        if nodeid != ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        if name != STATUS_NAME and name not in self.fs.files:
            raise OSError(errno.ENOENT, name)
        self._entry(unique, self._node(name))
        return False

    def _getattr(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        self._attr_reply(unique, nodeid)
        return False

    def _setattr(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        fields = SETATTR_IN.unpack_from(view, IN_SIZE)
        valid, size = fields[0], fields[3]
        path = self._path(nodeid)
        if valid & (FATTR_MODE | FATTR_UID | FATTR_GID):
            raise OSError(errno.EPERM, "a volume's owner and mode are fixed")
        if valid & FATTR_SIZE and size != self.fs.getattr(path).get("st_size"):
            # opening with O_TRUNC arrives here too: a volume cannot change size
            raise OSError(errno.EINVAL if path.lstrip("/") in self.fs.files else errno.EROFS,
                          "a volume cannot change size")
        self._attr_reply(unique, nodeid)     # times: accepted, and not kept
        return False

    def _open(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        flags, _ = OPEN_IN.unpack_from(view, IN_SIZE)
        path = self._path(nodeid)
        if nodeid == ROOT_ID:
            raise OSError(errno.EISDIR, "a directory")
        self.fs.check_open(path, flags)
        open_flags = 0
        if nodeid == STATUS_ID:
            open_flags = FOPEN_DIRECT_IO            # regenerated on every read: never cache
        elif self.fs.options.direct_io:
            open_flags = FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES
        self._reply(unique, OPEN_OUT.pack(0, open_flags, 0))
        return False

    def _opendir(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        if nodeid != ROOT_ID:
            raise OSError(errno.ENOTDIR, "not a directory")
        self._reply(unique, OPEN_OUT.pack(0, 0, 0))
        return False

    def _readdir(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        _fh, offset, size, *_ = RW_IN.unpack_from(view, IN_SIZE)
        entries = [(ROOT_ID, ".", stat.S_IFDIR), (ROOT_ID, "..", stat.S_IFDIR)] + \
            [(self._node(name), name, stat.S_IFREG) for name in self.fs.names()]
        out = bytearray()
        for i in range(offset, len(entries)):
            ino, name, mode = entries[i]
            raw = name.encode()
            rec = DIRENT.pack(ino, i + 1, len(raw), mode >> 12) + raw
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        self._reply(unique, bytes(out))
        return False

    def _statfs(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        s = self.fs.statfs()
        self._reply(unique, KSTATFS.pack(s["f_blocks"], s["f_bfree"], s["f_bavail"],
                                         s["f_files"], s["f_ffree"], s["f_bsize"],
                                         s["f_namemax"], s["f_frsize"], 0))
        return False

    # -- data: the fast path (reactor thread, no waiting) -----------------------------------
    def _read(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        _fh, offset, size, *_ = RW_IN.unpack_from(view, IN_SIZE)
        if nodeid == STATUS_ID:
            self._reply(unique, self.fs.status_text()[offset:offset + size])
            return False
        path = self._path(nodeid)
        ns = self.fs.namespace(path)
        end = min(offset + size, ns.size)
        if offset >= end:
            self._reply(unique)
            return False
        bs = ns.block_size
        start = offset - offset % bs
        stop = -(-end // bs) * bs
        if DATA_OFF + stop - start > BUF_SIZE:     # edges of huge blocks: the slow way
            self._blocking(index, unique, lambda: self.fs.read(path, size, offset))
            return True
        self.fs.counters.request(size)
        lo, hi = DATA_OFF + offset - start, DATA_OFF + end - start
        return self._start_io(index, n, unique, ns, IOOpcode.READ, start, stop - start,
                              DATA_OFF, lambda: view[lo:hi],
                              {"reads": 1, "read_bytes": hi - lo})

    def _write(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        _fh, offset, size, *_ = RW_IN.unpack_from(view, IN_SIZE)
        path = self._path(nodeid)
        fs = self.fs
        ns = fs._writable(path)
        if offset + size > ns.size:
            if offset >= ns.size:
                raise OSError(errno.ENOSPC, "past the end of the namespace")
            size = ns.size - offset
        bs = ns.block_size
        if offset % bs or size % bs:                # read-modify-write: a worker's job
            data = bytes(view[WRITE_DATA:WRITE_DATA + size])
            self._release(index)
            self._blocking(-1, unique, lambda: fs.write(path, data, offset),
                           lambda written: WRITE_OUT.pack(written, 0))
            return True
        fs.counters.request(size)
        return self._start_io(index, n, unique, ns, IOOpcode.WRITE, offset, size, WRITE_DATA,
                              lambda: WRITE_OUT.pack(size, 0),
                              {"writes": 1, "write_bytes": size},
                              data_out=view[WRITE_DATA:WRITE_DATA + size])

    def _start_io(self, index: int, n: int, unique: int, ns: Any, opcode: int, offset: int,
                  length: int, data_off: int, reply: Callable[[], Any],
                  counts: dict[str, int], data_out: memoryview | None = None) -> bool:
        """Issue the NVMe command(s) of request buffer ``index`` on its data at
        ``data_off``; on completion, reply ``reply()`` (or the errno), count ``counts`` and
        release the buffer.  Parked instead when the queues have no room.  Owns the buffer
        either way (True)."""
        fs = self.fs

        def done(error: BaseException | None) -> None:
            self._finished(pieces)
            if error is None:
                self._reply(unique, reply())
                fs.counters.add(**counts)
            else:
                fs.counters.add(errors=1)
                self._error(unique, nvme_errno(error))
            self._release(index)

        pieces = self._admit(index, n, -(-length // self.ctrl.max_transfer))
        if pieces:
            self.ctrl.start_io(ns, opcode, offset, length, self.bufs.addrs[index] + data_off,
                               self.bufs.mr.rkey, done, data_out=data_out)
        return True

    def _admit(self, index: int, n: int, pieces: int) -> int:
        """Count ``pieces`` commands in, or park the request (and stop reading) until
        completions make room; 0 when parked."""
        with self._lock:
            if self._inflight and self._inflight + pieces > self._limit():
                self._parked = (index, n)
                parked = True
            else:
                self._inflight += pieces
                parked = False
        if parked:
            self.fs.counters.add(parked=1)
            self._stop_reading()
            return 0
        return pieces

    def _finished(self, pieces: int) -> None:
        with self._lock:
            self._inflight -= pieces
            wake = self._parked is not None
        if wake:
            self.reactor.call_soon_threadsafe(self._resume)

    # -- what must wait: worker threads -----------------------------------------------------
    def _blocking(self, index: int, unique: int, work: Callable[[], Any],
                  encode: Callable[[Any], bytes] = lambda result: result or b"") -> None:
        """Run ``work`` on a worker; reply with ``encode(result)`` or its errno; release
        buffer ``index`` (-1: none) afterwards."""
        def run() -> None:
            try:
                result = work()
            except OSError as exc:
                self._error(unique, exc.errno or errno.EIO)
            except Exception:  # noqa: BLE001
                log.exception("FUSE request %d", unique)
                self._error(unique, errno.EIO)
            else:
                self._reply(unique, encode(result))
            finally:
                if index >= 0:
                    self._release(index)
        self._workers.submit(run)

    def _fsync(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        path = self._path(nodeid)
        self._blocking(-1, unique, lambda: self.fs.fsync(path))
        return False

    def _fallocate(self, index: int, unique: int, nodeid: int, view: memoryview,
                   n: int) -> bool:
        _fh, offset, length, mode, _ = FALLOCATE_IN.unpack_from(view, IN_SIZE)
        path = self._path(nodeid)
        self._blocking(-1, unique, lambda: self.fs.fallocate(path, mode, offset, length))
        return False


def serve(fs: VolumeFS, mountpoint: str, *, fsname: str,
          on_ready: Callable[[], None] | None = None) -> None:
    """Mount ``fs`` at ``mountpoint`` and serve until unmounted or SIGTERM/SIGINT/SIGHUP
    (which unmount).  ``on_ready`` runs once the kernel has sent INIT (the mount is live)."""
    server = KernelFuse(fs, mountpoint, fsname)
    try:
        server.mount()
    except BaseException:
        server.close()
        raise
    started = time.monotonic()
    server.serve(on_ready)
    log.debug("FUSE session of %s ended after %.1f s", mountpoint, time.monotonic() - started)

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
  (one ``write`` of the reply header, packed right before the data, and the data): no copy
  of the data in this process;
* the reply is written from the completion callback, on the reactor;
* what must wait (read-modify-write of unaligned edges, fsync, fallocate) runs on a few
  worker threads that reply themselves, and never holds the reactor.

Flow control: at most ``buffers`` requests are read ahead; at most ``depth - reserve`` NVMe
commands are in flight from here, so a queue always has a free slot for the reactor (it must
never wait for one: it is the thread that frees them) and the workers keep a reserve.

The protocol facts (structure layouts, opcodes, flags: the kernel's UAPI header
``linux/fuse.h``) are in :mod:`.fuse_abi`; mounting (mount(2) as root, or fusermount3 for an
ordinary user) is :mod:`.fuse_mount`; the filesystem's rules (which blocks a read touches,
how far a write may go) are :class:`VolumeFS`'s, and the NVMe side is the host library's
I/O primitive (:meth:`Controller.issue_io`).  What stays here is the session: reading
requests, answering them, and the request buffers' life.  Longer than ~500 lines because
every FUSE operation the mount answers is one short method of :class:`KernelFuse`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import mmap
import os
import signal
import stat
import threading
import time
from typing import Any, Callable

from blockfabric.initiator.fuse_abi import (ACCESS, ATTR_OUT, BATCH_FORGET, CREATE, DESTROY,
                                            DIRENT, ENTRY_OUT, FALLOCATE, FALLOCATE_IN, FATTR_GID,
                                            FATTR_MODE, FATTR_SIZE, FATTR_UID, FLUSH,
                                            FOPEN_DIRECT_IO, FOPEN_PARALLEL_DIRECT_WRITES, FORGET,
                                            FSYNC, FSYNCDIR, FUSE_ASYNC_DIO, FUSE_ASYNC_READ,
                                            FUSE_BIG_WRITES, FUSE_MAX_PAGES, GETATTR, INIT,
                                            INIT_IN, INIT_OUT, INTERRUPT, IN_HDR, IN_SIZE, IO_ARGS,
                                            KERNEL_MAJOR, KSTATFS, LINK, LOOKUP, MAX_REQUEST,
                                            MKDIR, MKNOD, NS_BASE_ID, OPEN, OPENDIR, OPEN_IN,
                                            OPEN_OUT, OUR_MINOR, OUT_HDR, OUT_SIZE, READ, READDIR,
                                            RELEASE, RELEASEDIR, RENAME, RENAME2, RMDIR, ROOT_ID,
                                            RW_IN, SETATTR, SETATTR_IN, STATFS, STATUS_ID, SYMLINK,
                                            TMPFILE, UNLINK, WRITE, WRITE_DATA, WRITE_OUT,
                                            WRITE_REPLY)
from blockfabric.initiator.fuse_mount import (FuseMountError, mount_fd,  # noqa: F401
                                              unmount_path)
from blockfabric.initiator.fusefs import STATUS_NAME, VolumeFS, nvme_errno
from blockfabric.fabric.buffers import BufferPool
from blockfabric.initiator.arena import HOST_ACCESS
from blockfabric.protocol import IOOpcode

log = logging.getLogger(__name__)

DATA_OFF = 4096                 # where a READ's data lands in its buffer (page aligned)
EDGE_ROOM = 64 << 10            # room for unaligned edges (two blocks of up to 32 KiB)
BUF_SIZE = DATA_OFF + MAX_REQUEST + EDGE_ROOM
DEFAULT_BUFFERS = 48
WORKER_RESERVE = 16             # command slots left to the worker threads
ATTR_TIMEOUT = 1.0              # seconds the kernel may cache names and attributes
#: With the reactor spinning (spin_us), a request within this many seconds makes the next
#: one expected: the reactor's spin goes on after a reply (a QD1 reader, fio psync or dd,
#: asks again within microseconds of it) and ends as /dev/fuse turns readable.
EXPECT_WINDOW = 0.002
#: Requests read from /dev/fuse per wake-up, once several wait: half the pipeline's depth
#: (KernelFuse._on_readable), within these bounds.
MIN_INTAKE = 2
MAX_INTAKE = 64
INIT_TIMEOUT = 10.0


_READ, _WRITE = IOOpcode.READ.value, IOOpcode.WRITE.value
_write = os.write
_unpack_in = IN_HDR.unpack_from
_pack_out = OUT_HDR.pack_into
#: what a flat directory of fixed files refuses as read-only, and what gets no reply
_READ_ONLY_FS_OPS = {SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, CREATE, RENAME2,
                     TMPFILE}
_NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
_TERM_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def library_version() -> str:
    return f"kernel FUSE protocol {KERNEL_MAJOR}.{OUR_MINOR}, no library"


# --------------------------------------------------------------------------- the server

class _IoRequest:
    """The NVMe side of one request buffer, made once and reused by every READ or WRITE read
    into that buffer: its commands (one per MDTS piece), how many are still out, and what
    the reply needs.  The parent of its commands (``io_done``); reactor thread only."""

    __slots__ = ("server", "index", "cmds", "unique", "left", "pieces", "error", "read",
                 "lo", "hi", "reply", "reply_lo", "reply_hi", "write_size", "write_data",
                 "write_reply")

    def __init__(self, server: KernelFuse, index: int) -> None:
        self.server = server
        self.index = index
        self.cmds: list = []
        self.unique = self.left = self.pieces = 0
        self.error: BaseException | None = None
        self.read = True
        self.lo = self.hi = 0               # a READ's reply data: view[lo:hi]
        self.reply: memoryview | None = None    # view[lo - 16:hi], kept while lo/hi repeat
        self.reply_lo = self.reply_hi = -1
        self.write_size = -1
        self.write_data: memoryview | None = None   # view[WRITE_DATA:+size], likewise
        self.write_reply = bytearray(WRITE_REPLY.size)

    def io_done(self, _cmd: Any, error: BaseException | None) -> None:
        """One command done (reactor thread); the last one replies, counts and gives the
        buffer back, in this frame (the FUSE reply's chain is the command's ``complete``,
        then this)."""
        if error is not None and self.error is None:
            self.error = error
        left = self.left = self.left - 1
        if left:
            return
        server = self.server
        server._inflight -= self.pieces
        counters = server.fs.counters
        error = self.error
        if error is not None:
            self.error = None
            counters.errors += 1
            server._error(self.unique, nvme_errno(error))
        elif self.read:
            lo, hi = self.lo, self.hi
            view = server.bufs.views[self.index]
            if lo != self.reply_lo or hi != self.reply_hi:
                self.reply = view[lo - OUT_SIZE:hi]
                self.reply_lo, self.reply_hi = lo, hi
            # the reply header goes right before the data, over what the request held
            _pack_out(view, lo - OUT_SIZE, OUT_SIZE + hi - lo, 0, self.unique)
            try:
                _write(server.fd, self.reply)  # type: ignore[arg-type]  # (set for lo/hi)
            except OSError as exc:
                server._send_failed(exc)
            counters.reads += 1
            counters.read_bytes += hi - lo
        else:
            size = self.hi
            WRITE_REPLY.pack_into(self.write_reply, 0, WRITE_REPLY.size, 0, self.unique, size, 0)
            server._send(self.write_reply)
            counters.writes += 1
            counters.write_bytes += size
        # the buffer back (on the reactor: no wake-up, one queued resume at most)
        server.bufs.free.append(self.index)
        if not server._reading and not server._ended_flag and not server._resume_due:
            server._resume_due = True
            server.reactor.call_soon(server._resume)


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
        # the request buffers, registered with the controller's PD: a WRITE's payload is
        # read where the target fetches it, a READ's data lands where the reply goes from
        self.bufs = BufferPool(self.ctrl.pd,  # type: ignore[arg-type]  # (connected: a PD)
                               buffers, BUF_SIZE, HOST_ACCESS)
        self.iovs = [[view] for view in self.bufs.views]    # readv's argument, made once
        self.nbuf = buffers
        self.reqs = [_IoRequest(self, i) for i in range(buffers)]
        # Reactor thread only, all of these: no lock.
        self._inflight = 0                      # NVMe commands issued from the fast path
        self._parked: tuple[int, int] | None = None   # (buffer, length) waiting for slots
        self._reading = False
        self._several = True                    # the last wake-up found several requests
        self._depth = 0                         # requests in the pipeline (_note_depth)
        self._turn = 0
        self._queue: Any = None                 # the I/O queue of this wake-up's commands
        self._resume_due = False                # a _resume is queued on the reactor
        self._limit_of: tuple[Any, int, int] = (None, 0, 1)  # (io_queues, len, limit)
        self._files_seen: Any = None            # fs.files that _node_ns was made from
        self._node_ns: dict[int, Any] = {}
        self._ended_flag = False                # done.is_set(), as a plain field
        self._spins = bool(getattr(self.reactor, "spin_us", 0))   # see EXPECT_WINDOW
        self._request_at = 0.0                  # when the last wake-up found requests
        self.initialized = threading.Event()
        self.done = threading.Event()
        self._stopping = False
        #: False in a FUSE worker process (fuse_workers.py): its session is a clone of the
        #: mount's, which the mount process unmounts; a stop there only stops serving
        self.unmounts = True
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
        reserve (at most half of it).  Worked out again only when the queues change."""
        queues = self.ctrl.io_queues
        seen, count, limit = self._limit_of
        if queues is seen and len(queues) == count:
            return limit
        depth = min((q.depth for q in queues), default=32)
        limit = max(1, depth - min(WORKER_RESERVE, depth // 2))
        if queues:
            self._limit_of = (queues, len(queues), limit)
        return limit

    # -- lifecycle -----------------------------------------------------------------------
    def mount(self) -> None:
        opts = self.fs.options
        self.fd = mount_fd(self.mountpoint, self.fsname, read_only=opts.read_only,
                           allow_other=opts.allow_other, extra=opts.extra)
        os.set_blocking(self.fd, False)
        self.reactor.call_sync(self._start_reading)

    def adopt(self, fd: int) -> None:
        """Serve ``fd``, a clone of a live session's descriptor (FUSE_DEV_IOC_CLONE): the
        kernel's INIT went to the mount's own descriptor, and the mount process unmounts."""
        self.fd = fd
        self.unmounts = False
        self.initialized.set()
        os.set_blocking(fd, False)
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
        if not self.unmounts:
            self._set_done()
            return
        unmount_path(self.mountpoint)
        # A session the kernel never started (no INIT yet) never reports ENODEV by itself
        if not self.initialized.is_set():
            self._set_done()

    def close(self, drain: float = 5.0) -> None:
        """Stop reading, let commands in flight finish (their replies and the RDMA into
        the buffers), then close the descriptor and deregister the buffers."""
        self._set_done()
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
        self.iovs = []
        self.bufs.close()

    def _set_done(self) -> None:
        self._ended_flag = True
        self.done.set()

    def _start_reading(self) -> None:
        if not self._reading and not self._ended_flag:
            self._reading = True
            self.reactor.add_reader(self.fd, self._on_readable)
            if self._spins:
                self.reactor.add_poller(self._expecting, follows=True)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.reactor.remove_reader(self.fd, self._on_readable)
            if self._spins:
                self.reactor.remove_poller(self._expecting)

    def _expecting(self) -> bool | None:
        """The reactor's busy-poll (``Reactor.add_poller``): False (spin on: the reactor's
        epoll sees /dev/fuse turn readable) while a request came within EXPECT_WINDOW,
        None (no point spinning for us) otherwise."""
        return False if time.monotonic() - self._request_at < EXPECT_WINDOW else None

    # -- the loop (reactor thread) ---------------------------------------------------------
    def _on_readable(self) -> None:
        bufs = self.bufs
        free = bufs.free
        iovs = self.iovs
        fd = self.fd
        # A reader that keeps one request in flight (fio psync, dd) wakes us with nothing in
        # hand, and one request is all there is: reading on until EAGAIN would cost a system
        # call and an exception per I/O.  So with nothing in hand, and the last wake-up
        # having found a single request, read one: if more were queued, the descriptor is
        # still readable (level-triggered) and the next pass, with this one in hand, reads
        # the rest in one go.
        # Every command of this wake-up goes on one I/O queue, and the next wake-up's on the
        # same one while it has a free slot: the reactor sends a pass's frames in one
        # sendmsg per connection, so spreading one batch over the queues costs a sendmsg
        # (and a target wake-up) per queue; and the acknowledgement a queue owes for its
        # last response rides on its next command only if that goes on the same queue (at
        # QD1, alternating queues made it wait out the delayed-ACK timer and go alone).
        # (A queue holds the whole fast-path limit: _limit is one queue's depth.)
        queues = self.ctrl.io_queues
        if queues:
            queue = queues[self._turn % len(queues)]
            if not queue.free_slots:
                self._turn += 1
                queue = queues[self._turn % len(queues)]
            self._queue = queue
        if self._spins:
            self._request_at = time.monotonic()
        # Half the pipeline per wake-up: everything read in one pass leaves in one sendmsg
        # at its end, so a pass that took all a reader's requests (fio at depth 16: all 16)
        # would have the target work while this loop waits, then this loop while the
        # target waits.  Taking at most half of the requests in the pipeline (_depth: the
        # requests being served, as the last passes saw them) keeps two batches going, one
        # at each end: at depth 4 to 32, 1.4-1.6x the reads per second for the same CPU.
        got = 0
        if self._several or len(free) < self.nbuf:
            several = True
            cap = (self._depth + 1) >> 1
            if cap < MIN_INTAKE:
                cap = MIN_INTAKE
            elif cap > MAX_INTAKE:
                cap = MAX_INTAKE
        else:
            several = False
            cap = 1
        for _ in range(cap):
            if self._parked is not None or not free:
                self._stop_reading()
                break
            index = free.pop()
            try:
                n = os.readv(fd, iovs[index])
            except BlockingIOError:
                free.append(index)
                self._several = got > 1
                break
            except OSError as exc:
                free.append(index)
                if exc.errno in (errno.ENOENT, errno.EINTR):   # interrupted: next one
                    continue
                self._ended(exc)
                return
            got += 1
            if n < IN_SIZE:
                free.append(index)
                continue
            self._dispatch(index, n)
        if several:
            self._note_depth(got)

    def _note_depth(self, got: int) -> None:
        """After a wake-up that read ``got`` requests (the intake cap, or until none was
        left): the requests being served now (each holds a buffer; a request of several
        MDTS pieces counts once) are the pipeline's depth as far as it could be seen.
        The estimate follows a deeper pipeline at once and a shallower one by an eighth of
        the gap per wake-up (one pass that found the queue half empty is no new depth)."""
        seen = self.nbuf - len(self.bufs.free)
        depth = self._depth
        if seen >= depth:
            self._depth = seen
        else:
            self._depth = depth - ((depth - seen + 7) >> 3)
        if got > self.fs.counters.largest_intake:
            self.fs.counters.largest_intake = got

    def _ended(self, exc: OSError) -> None:
        if exc.errno != errno.ENODEV:
            log.error("reading /dev/fuse: %s", exc)
        self._stop_reading()
        self._set_done()

    def _dispatch(self, index: int, n: int) -> None:
        view = self.bufs.views[index]
        _len, opcode, unique, nodeid, _uid, _gid, _pid, _ext, _pad = _unpack_in(view)
        op: Callable[[int, int, int, memoryview, int], bool] | None
        if opcode == READ:
            op = self._read
        elif opcode == WRITE:
            op = self._write
        else:
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
        """Give buffer ``index`` back, from any thread (a list append needs no lock)."""
        self.bufs.free.append(index)
        if not self._reading and not self._ended_flag:
            self.reactor.call_soon_threadsafe(self._resume)

    def _resume(self) -> None:
        self._resume_due = False
        if self._parked is not None:
            index, n = self._parked
            self._parked = None
            self._dispatch(index, n)
        if self._parked is None and not self._ended_flag:
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

    def _entry_out(self, nodeid: int) -> bytes:
        sec, nsec = int(ATTR_TIMEOUT), int(ATTR_TIMEOUT % 1 * 1e9)
        return ENTRY_OUT.pack(nodeid, 0, sec, sec, nsec, nsec, *self._attr(nodeid))

    def _attr_out(self, nodeid: int) -> bytes:
        sec, nsec = int(ATTR_TIMEOUT), int(ATTR_TIMEOUT % 1 * 1e9)
        return ATTR_OUT.pack(sec, nsec, 0, *self._attr(nodeid))

    def _entry(self, unique: int, nodeid: int) -> None:
        if nodeid == STATUS_ID and self.fs.status_waits:
            self._blocking(-1, unique, lambda: self._entry_out(nodeid))
        else:
            self._reply(unique, self._entry_out(nodeid))

    def _attr_reply(self, unique: int, nodeid: int) -> None:
        if nodeid == STATUS_ID and self.fs.status_waits:
            self._blocking(-1, unique, lambda: self._attr_out(nodeid))
        else:
            self._reply(unique, self._attr_out(nodeid))

    def _init(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        major, minor, readahead, flags = INIT_IN.unpack_from(view, IN_SIZE)
        if major != KERNEL_MAJOR:
            # a newer major: answer with ours and wait for the kernel to retry (fuse.h)
            self._reply(unique, INIT_OUT.pack(KERNEL_MAJOR, OUR_MINOR, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0))
            return False
        self.kernel_minor = minor
        want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | FUSE_MAX_PAGES
        # requests the kernel lets be in flight at once (asynchronous direct I/O): what
        # every serving process can hold (each has its buffers; fuse_workers.py)
        background = min(0xFFFF, self.nbuf * self.fs.options.fuse_workers)
        self._reply(unique, INIT_OUT.pack(
            KERNEL_MAJOR, min(minor, OUR_MINOR), readahead, flags & want, background,
            background * 3 // 4, MAX_REQUEST, 1, MAX_REQUEST // mmap.PAGESIZE, 0, 0))
        self.initialized.set()
        return False

    def _destroy(self, index: int, unique: int, nodeid: int, view: memoryview,
                 n: int) -> bool:
        self._reply(unique)
        self._stop_reading()
        self._set_done()
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
    # A READ or WRITE becomes the NVMe command(s) of the request buffer's _IoRequest, and the
    # last completion replies with one write of memory already laid out for it: no closure,
    # dict, lambda or lock on the way, and nothing allocated while sizes repeat.

    def _ns_of(self, nodeid: int) -> Any:
        """The namespace of file ``nodeid`` (ENOENT once it is gone), without names."""
        files = self.fs.files
        if files is not self._files_seen:       # the file list was replaced (a rescan)
            self._node_ns = {NS_BASE_ID + int(name[1:]): ns for name, ns in files.items()}
            self._files_seen = files
        ns = self._node_ns.get(nodeid)
        if ns is None:
            raise OSError(errno.ENOENT, "namespace gone")
        return ns

    def _read(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        offset, size = IO_ARGS.unpack_from(view, IN_SIZE)
        if nodeid == STATUS_ID:
            if self.fs.status_waits:            # a worker process asks the mount process
                self._blocking(-1, unique, lambda: self.fs.status_text()[offset:offset + size])
            else:
                self._reply(unique, self.fs.status_text()[offset:offset + size])
            return False
        ns = self._node_ns.get(nodeid) if self.fs.files is self._files_seen else None
        if ns is None:
            ns = self._ns_of(nodeid)
        span = self.fs.read_span(ns, offset, size)
        if span is None:
            self._reply(unique)
            return False
        start, stop, end = span
        if DATA_OFF + stop - start > BUF_SIZE:     # edges of huge blocks: the slow way
            path = "/" + f"n{nodeid - NS_BASE_ID}"
            self._blocking(index, unique, lambda: self.fs.read(path, size, offset))
            return True
        counters = self.fs.counters
        if size > counters.largest_request:
            counters.largest_request = size
        req = self.reqs[index]
        req.read = True
        req.lo = DATA_OFF + offset - start
        req.hi = DATA_OFF + end - start
        return self._issue_request(req, n, unique, ns, _READ, start, stop - start, DATA_OFF, None)

    def _write(self, index: int, unique: int, nodeid: int, view: memoryview, n: int) -> bool:
        data: bytes | memoryview | None
        offset, size = IO_ARGS.unpack_from(view, IN_SIZE)
        if nodeid == STATUS_ID:
            raise OSError(errno.EROFS, "read-only")
        fs = self.fs
        ns = self._ns_of(nodeid)
        size = fs.write_span(ns, offset, size)
        bs = ns.block_size
        if offset % bs or size % bs:                # read-modify-write: a worker's job
            path = "/" + f"n{nodeid - NS_BASE_ID}"
            data = bytes(view[WRITE_DATA:WRITE_DATA + size])
            self._release(index)
            self._blocking(-1, unique, lambda: fs.write(path, data,  # type: ignore[arg-type]
                                                        offset),  # (bytes, here)
                           lambda written: WRITE_OUT.pack(written, 0))
            return True
        counters = fs.counters
        if size > counters.largest_request:
            counters.largest_request = size
        req = self.reqs[index]
        req.read = False
        data = None
        if size <= self.ctrl.inline_size:           # it may travel in the capsule
            if size != req.write_size:
                req.write_data = view[WRITE_DATA:WRITE_DATA + size]
                req.write_size = size
            data = req.write_data
        req.hi = size
        return self._issue_request(req, n, unique, ns, _WRITE, offset, size, WRITE_DATA, data)

    def _issue_request(self, req: _IoRequest, n: int, unique: int, ns: Any, opcode: int,
                  offset: int, length: int, data_off: int, data: memoryview | None) -> bool:
        """Issue the NVMe command(s) of request buffer ``req.index`` on its data at
        ``data_off``; the last completion replies (:meth:`_IoRequest.io_done`).  Parked instead
        when the queues have no room.  Owns the buffer either way (True)."""
        ctrl = self.ctrl
        most = ctrl.max_transfer
        pieces = 1 if length <= most else -(-length // most)
        inflight = self._inflight
        queues = ctrl.io_queues
        seen, count, limit = self._limit_of
        if queues is not seen or len(queues) != count:
            limit = self._limit()
        if inflight and inflight + pieces > limit:
            self._parked = (req.index, n)
            self.fs.counters.parked += 1
            self._stop_reading()
            return True
        self._inflight = inflight + pieces
        req.unique = unique
        req.left = req.pieces = pieces
        req.error = None
        queue = self._queue
        if queue is not None and len(queue.free_slots) < pieces:
            queue = None        # the workers' commands filled it: round robin
        index = req.index
        ctrl.issue_io(req.cmds, req, ns, opcode, offset, length,
                      self.bufs.addrs[index] + data_off, self.bufs.mr.rkey, data, queue)
        return True

    def _send(self, reply) -> None:
        """One write of a whole reply (header included)."""
        try:
            _write(self.fd, reply)
        except OSError as exc:
            self._send_failed(exc)

    @staticmethod
    def _send_failed(exc: OSError) -> None:
        # ENOENT: the request was interrupted; EBADF, ENODEV: the session is over
        if exc.errno not in (errno.ENOENT, errno.EBADF, errno.ENODEV):
            log.warning("FUSE reply: %s", exc)

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
    fs.session = server             # the mount's FUSE workers clone its descriptor
    try:
        server.mount()
    except BaseException:
        server.close()
        raise
    started = time.monotonic()
    server.serve(on_ready)
    log.debug("FUSE session of %s ended after %.1f s", mountpoint, time.monotonic() - started)

"""The mounted filesystem, with no FUSE binding in it: files ``n<nsid>`` and ``.status``.

Every operation here takes plain values (path, offset, bytes) and returns plain values or
raises ``OSError`` with an errno, so the two bindings (``fuse_kernel.py``, our own server of
the kernel's protocol, and ``fuse_binding.py``, mfusepy on libfuse) stay translations and
can be swapped.  The rules both apply on their own fast paths (which blocks a read touches,
how far a write may go, what is writable) are public methods here: :meth:`VolumeFS.read_span`,
:meth:`VolumeFS.write_span`, :meth:`VolumeFS.writable`.  Calls arrive on many threads at once
(the binding's worker pool); each one submits to the host library and blocks only on its
own commands, so many NVMe commands are in flight while several FUSE requests are.

Unaligned edges become read-modify-write of whole blocks.  Two RMWs of one block must not
lose each other's bytes, so each edge block is held under a striped lock for the whole
read-patch-write (whole-block writes take no lock: overlapping concurrent writes have no
defined order on a block device either).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from blockfabric.initiator.host import (Controller, ControllerLost, HostNamespace, NvmeError,
                                        QueueDead)
from blockfabric.initiator.multipath import format_path
from blockfabric.protocol import StatusCode

STATUS_NAME = ".status"
SUBTYPE = "blockfabric"          # the mount shows as fuse.blockfabric
DEFAULT_THREADS = 16                # libfuse binding: worker pool
DEFAULT_KERNEL_WORKERS = 4          # kernel binding: threads for requests that must wait
BINDINGS = ("kernel", "libfuse")
DEFAULT_BINDING = "kernel"
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_LOCK_STRIPES = 256

# NVMe statuses that have a natural errno; the rest are EIO (what a disk error is).
_ERRNO_OF_STATUS: dict[int, int] = {
    StatusCode.LBA_OUT_OF_RANGE: errno.ENOSPC,
    StatusCode.CAPACITY_EXCEEDED: errno.ENOSPC,
    StatusCode.NS_WRITE_PROTECTED: errno.EROFS,
    StatusCode.INVALID_OPCODE: errno.EOPNOTSUPP,
    # Another host's reservation does not let this one write (or read): EACCES, a
    # permission, not a media error (the Linux block layer says EBADE; docs/reservations.md).
    StatusCode.RESERVATION_CONFLICT: errno.EACCES,
}


@dataclass
class MountOptions:
    """What ``-o`` may say.  ``direct_io`` bypasses the page cache (the default: a remote
    volume shared with others must not be served stale from a local cache)."""

    read_only: bool = False
    allow_other: bool = False
    direct_io: bool = True
    threads: int | None = None         # worker threads (None: the binding's default)
    #: processes serving the FUSE session (the mount process and fuse_workers - 1 more,
    #: each on a clone of its /dev/fuse descriptor with its own I/O queues; fuse_workers.py)
    fuse_workers: int = 1
    binding: str = DEFAULT_BINDING     # "kernel" (our own /dev/fuse server) or "libfuse"
    extra: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> MountOptions:
        """Parse ``-o ro,allow_other,cache,threads=N,binding=B``; unknown words are
        passed to the kernel (or libfuse) as mount options."""
        opts = cls()
        for word in filter(None, (w.strip() for w in text.split(","))):
            if word == "ro":
                opts.read_only = True
            elif word == "rw":
                opts.read_only = False
            elif word == "allow_other":
                opts.allow_other = True
            elif word == "direct_io":
                opts.direct_io = True
            elif word in ("cache", "page_cache", "no_direct_io"):
                opts.direct_io = False
            elif word.startswith("threads="):
                opts.threads = _positive(word)
            elif word.startswith("fuse_workers="):
                opts.fuse_workers = _positive(word)
            elif word == "single_thread":
                opts.threads = 1
            elif word.startswith("binding="):
                opts.binding = word.partition("=")[2]
                if opts.binding not in BINDINGS:
                    raise ValueError(f"mount option binding: expected one of "
                                     f"{', '.join(BINDINGS)}, got {opts.binding!r}")
            else:
                opts.extra.append(word)
        return opts

    def words(self) -> list[str]:
        return (["ro" if self.read_only else "rw"] + (["allow_other"] if self.allow_other else [])
                + ["direct_io" if self.direct_io else "cache", f"binding={self.binding}"]
                + ([f"threads={self.threads}"] if self.threads is not None else [])
                + ([f"fuse_workers={self.fuse_workers}"] if self.fuse_workers != 1 else [])
                + self.extra)

    def worker_threads(self) -> int:
        """Threads of the binding: libfuse's pool, or the kernel server's waiting-work pool."""
        if self.threads is not None:
            return self.threads
        return DEFAULT_THREADS if self.binding == "libfuse" else DEFAULT_KERNEL_WORKERS


def _positive(word: str) -> int:
    key, _, value = word.partition("=")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"mount option {key}: expected a positive integer, got {value!r}")
    return int(value)


class Counters:
    """What the mount did, in FUSE terms (the NVMe queues keep their own counters).

    Two sets that are summed when read: what :meth:`add` and :meth:`request` count, from any
    thread, under a lock; and plain int fields that only one thread writes (the kernel
    binding's reactor, on its per-I/O path: no lock, no dict, no keyword call)."""

    #: parked: requests held back (kernel binding) because the queues had no slot to spare;
    #: many of them say the queue depth (-Q) is small for this load.  largest_intake: the
    #: most requests the kernel binding read from /dev/fuse in one wake-up (half the
    #: pipeline at most, once it is deep: see KernelFuse._on_readable).
    NAMES = ("reads", "writes", "read_bytes", "write_bytes", "rmw_blocks", "flushes",
             "discards", "write_zeroes", "errors", "largest_request", "parked",
             "largest_intake")
    #: merged across processes by taking the largest, not the sum
    LARGEST = frozenset(("largest_request", "largest_intake"))

    __slots__ = ("_lock", "_locked", "reads", "writes", "read_bytes", "write_bytes", "errors",
                 "largest_request", "parked", "largest_intake")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locked = dict.fromkeys(self.NAMES, 0)
        # the one-writer fields
        self.reads = self.writes = self.read_bytes = self.write_bytes = 0
        self.errors = self.largest_request = self.parked = self.largest_intake = 0

    def add(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._locked[key] += value

    def request(self, size: int) -> None:
        with self._lock:
            if size > self._locked["largest_request"]:
                self._locked["largest_request"] = size

    @property
    def values(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._locked)
        for key in ("reads", "writes", "read_bytes", "write_bytes", "errors", "parked"):
            out[key] += getattr(self, key)
        for key in self.LARGEST:
            out[key] = max(out[key], getattr(self, key))
        return out


def nvme_errno(exc: BaseException) -> int:
    """The errno a file user should see for a failed command."""
    if isinstance(exc, NvmeError):
        return _ERRNO_OF_STATUS.get(exc.status, errno.EIO)
    if isinstance(exc, ControllerLost):     # held through reconnects until ctrl_loss_tmo
        return errno.EIO
    if isinstance(exc, (QueueDead, ConnectionError)):
        return errno.ENOTCONN
    if isinstance(exc, TimeoutError):
        return errno.ETIMEDOUT
    return errno.EIO


def _fail(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code) + (f": {what}" if what else ""))


class VolumeFS:
    """A flat directory: one regular file per namespace, plus ``.status``."""

    #: True where :meth:`status_text` waits (a FUSE worker process asks the mount process
    #: for it): the kernel binding then answers .status on its worker threads
    status_waits = False
    #: the mount's FUSE worker processes (fuse_workers.FuseWorkers), in the mount process
    workers: Any = None
    #: the kernel binding's session (fuse_kernel.KernelFuse) serving this filesystem
    session: Any = None

    def __init__(self, ctrl: Controller, options: MountOptions) -> None:
        self.ctrl = ctrl
        self.options = options
        self.counters = Counters()
        self.started = time.time()
        self.uid = os.getuid()
        self.gid = os.getgid()
        self._stripes = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        self.files: dict[str, HostNamespace] = {}
        self._refresh_files()
        # Namespaces added, removed or resized on the target (a reload) reach the host as an
        # asynchronous event; the host library rescans and tells its listeners.  Sizes need
        # nothing here (the HostNamespace objects are updated in place); the file list does.
        ctrl.namespace_listeners.append(lambda _ctrl, _nsids: self._refresh_files())

    def _refresh_files(self) -> None:
        self.files = {f"n{nsid}": ns for nsid, ns in sorted(self.ctrl.namespaces.items())}

    # -- names and attributes ---------------------------------------------------------
    def namespace(self, path: str) -> HostNamespace:
        ns = self.files.get(path.lstrip("/"))
        if ns is None:
            raise _fail(errno.ENOENT)
        return ns

    def writable(self, ns: HostNamespace) -> bool:
        """May ``ns`` be written through this mount (the namespace and the mount allow it)?"""
        return not (ns.read_only or self.options.read_only)

    # -- the block rules (both bindings) -----------------------------------------------
    @staticmethod
    def read_span(ns: HostNamespace, offset: int, size: int) -> tuple[int, int, int] | None:
        """A read of ``size`` bytes at ``offset``: ``(start, stop, end)``, the whole blocks
        ``[start, stop)`` to read and ``end``, where the bytes asked for end (clamped to the
        namespace's size); None when nothing is there (at or past the end: EOF)."""
        end = offset + size
        nsize = ns.nblocks * ns.block_size
        if end > nsize:
            end = nsize
        if offset >= end:
            return None
        bs = ns.block_size
        return offset - offset % bs, -(-end // bs) * bs, end

    def write_span(self, ns: HostNamespace, offset: int, size: int) -> int:
        """How many of ``size`` bytes at ``offset`` a write writes: all, or up to the end of
        the namespace (a volume cannot grow); EROFS when ``ns`` is not writable here,
        ENOSPC when the write starts at or past the end."""
        if ns.read_only or self.options.read_only:
            raise _fail(errno.EROFS)
        nsize = ns.nblocks * ns.block_size
        if offset + size > nsize:
            if offset >= nsize:
                raise _fail(errno.ENOSPC, "past the end of the namespace")
            return nsize - offset
        return size

    def names(self) -> list[str]:
        return list(self.files) + [STATUS_NAME]

    def getattr(self, path: str) -> dict[str, Any]:
        name = path.lstrip("/")
        born = int(self.started * 1e9)          # nanoseconds, as the binding expects
        base = {"st_uid": self.uid, "st_gid": self.gid, "st_atime": born, "st_mtime": born,
                "st_ctime": born}
        if name == "":
            return dict(base, st_mode=stat.S_IFDIR | 0o755, st_nlink=2)
        if name == STATUS_NAME:
            return dict(base, st_mode=stat.S_IFREG | 0o444, st_nlink=1,
                        st_size=len(self.status_text()), st_mtime=time.time_ns())
        ns = self.namespace(path)
        mode = 0o644 if self.writable(ns) else 0o444
        return dict(base, st_mode=stat.S_IFREG | mode, st_nlink=1, st_size=ns.size,
                    st_blksize=ns.block_size, st_blocks=ns.size // 512)

    def check_open(self, path: str, flags: int) -> None:
        """Refuse what cannot work before any I/O: writing a read-only file is EROFS."""
        name = path.lstrip("/")
        writing = (flags & os.O_ACCMODE) != os.O_RDONLY or flags & os.O_TRUNC
        if name == STATUS_NAME:
            if writing:
                raise _fail(errno.EROFS)
            return
        ns = self.namespace(path)
        if writing and not self.writable(ns):
            raise _fail(errno.EROFS)

    def statfs(self) -> dict[str, int]:
        total = min(sum(ns.size for ns in self.files.values()), (1 << 76) - 1)  # (u64 blocks)
        bsize = 4096
        return {"f_bsize": bsize, "f_frsize": bsize, "f_blocks": total // bsize,
                "f_bfree": 0, "f_bavail": 0, "f_files": len(self.files) + 1, "f_ffree": 0,
                "f_namemax": 255}

    # -- data ------------------------------------------------------------------------
    def read(self, path: str, size: int, offset: int) -> bytes:
        if path.lstrip("/") == STATUS_NAME:
            return self.status_text()[offset:offset + size]
        ns = self.namespace(path)
        span = self.read_span(ns, offset, size)
        if span is None:
            return b""
        start, stop, end = span
        self.counters.request(size)
        data = self._wait(ns.submit_read(start, stop - start))
        self.counters.add(reads=1, read_bytes=end - offset)
        return data[offset - start:end - start] if (start, stop) != (offset, end) else data

    def write(self, path: str, data: bytes, offset: int) -> int:
        if path.lstrip("/") == STATUS_NAME:
            raise _fail(errno.EROFS)
        ns = self.namespace(path)
        size = self.write_span(ns, offset, len(data))
        if size < len(data):
            data = data[:size]
        self.counters.request(len(data))
        self._patch(ns, offset, data)
        self.counters.add(writes=1, write_bytes=len(data))
        return len(data)

    def fsync(self, path: str) -> None:
        if path.lstrip("/") == STATUS_NAME:
            return
        ns = self.namespace(path)
        self._call(ns.flush)
        self.counters.add(flushes=1)

    def fallocate(self, path: str, mode: int, offset: int, length: int) -> None:
        """PUNCH_HOLE -> Dataset Management deallocate, ZERO_RANGE -> Write Zeroes; the
        unaligned edges are zeroed by read-modify-write.  Plain allocation is a no-op: every
        block of a namespace already exists."""
        ns = self.namespace(path)
        if offset < 0 or length <= 0:
            raise _fail(errno.EINVAL)
        known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
        if mode & ~known or (mode & FALLOC_FL_PUNCH_HOLE and not mode & FALLOC_FL_KEEP_SIZE):
            raise _fail(errno.EOPNOTSUPP)
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) and not self.writable(ns):
            raise _fail(errno.EROFS)
        end = min(offset + length, ns.size)
        if not mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
            if offset + length > ns.size:
                raise _fail(errno.EFBIG, "a namespace cannot grow")
            return
        if offset >= end:
            return
        bs = ns.block_size
        first = -(-offset // bs) * bs          # first whole block inside the range
        last = end // bs * bs                  # end of the last whole block inside it
        if last <= first:                      # inside one block (or straddling two)
            self._patch(ns, offset, bytes(end - offset))
            return
        if offset < first:
            self._patch(ns, offset, bytes(first - offset))
        if end > last:
            self._patch(ns, last, bytes(end - last))
        if mode & FALLOC_FL_PUNCH_HOLE and (ns.identify is None or ns.identify.dlfeat & 7 == 1):
            self._call(ns.discard, first, last - first)
            self.counters.add(discards=1)
        else:
            # Deallocate that does not promise zeroes on read-back cannot make a hole: say
            # "write zeroes, and deallocate if you can" instead.
            self._call(ns.write_zeroes, first, last - first,
                       bool(mode & FALLOC_FL_PUNCH_HOLE))
            self.counters.add(write_zeroes=1)

    # -- helpers ---------------------------------------------------------------------
    def _patch(self, ns: HostNamespace, offset: int, data: bytes) -> None:
        """Write ``data`` at any offset: whole blocks as they are, partial edge blocks read,
        patched and written back under their stripe locks, all as one command."""
        bs = ns.block_size
        end = offset + len(data)
        start = offset - offset % bs
        stop = -(-end // bs) * bs
        if start == offset and stop == end:
            self._wait(ns.submit_write(offset, data))
            return
        edges = sorted({start // bs, (stop - bs) // bs})
        stripes = sorted({block % _LOCK_STRIPES for block in edges})
        for i in stripes:
            self._stripes[i].acquire()
        try:
            buf = bytearray(stop - start)
            reads = [(block * bs, ns.submit_read(block * bs, bs)) for block in edges
                     if not (block * bs >= offset and block * bs + bs <= end)]
            for at, fut in reads:
                buf[at - start:at - start + bs] = self._wait(fut)
            buf[offset - start:end - start] = data
            self._wait(ns.submit_write(start, buf))
            self.counters.add(rmw_blocks=len(reads))
        finally:
            for i in reversed(stripes):
                self._stripes[i].release()

    def _wait(self, fut) -> Any:
        try:
            return fut.result()
        except Exception as exc:
            self.counters.add(errors=1)
            raise _fail(nvme_errno(exc), str(exc)) from exc

    def _call(self, func: Callable, *args: Any) -> Any:
        try:
            return func(*args)
        except Exception as exc:
            self.counters.add(errors=1)
            raise _fail(nvme_errno(exc), str(exc)) from exc

    # -- .status ---------------------------------------------------------------------
    def status_text(self) -> bytes:
        """The controller, its paths, queues, keep-alive, state and counters, in words."""
        return status_report(self).encode()


def _same_host(ctrl: Any) -> bool:
    """The controller's I/O queues reach a target on this machine through shared memory
    (the soft provider's same-host connections: docs/rdma.md)."""
    return any(getattr(getattr(q, "qp", None), "shm", False)
               for q in getattr(ctrl, "io_queues", ()))


def status_report(fs: VolumeFS) -> str:
    ctrl = fs.ctrl
    opts = ctrl.opts
    ident = ctrl.identify
    dead = [q.qid for q in ctrl.io_queues if q.dead_reason]
    admin_dead = ctrl.admin is None or ctrl.admin.dead_reason
    state = "live" if not dead and not admin_dead else "degraded" if not admin_dead else "dead"
    rec = ctrl.recovery_stats()
    worker_lines: list[str] = []
    stats: list[dict[str, Any]] = []
    if fs.workers is not None:
        from blockfabric.initiator.fuse_workers import status_lines
        worker_lines, stats = status_lines(fs)
        for key in ("held", "retried", "failed"):   # commands of every process
            rec[key] = int(rec[key]) + sum(st.get(key, 0) for st in stats)
    if rec["state"] != "live":
        state = str(rec["state"])
    paths = ", ".join(ctrl.path_names() if hasattr(ctrl, "path_names")
                      else [format_path(a, p) for a, p in ctrl.paths])
    lines = [
        f"subsystem   {opts.subnqn}",
        f"controller  {ctrl.cntlid} (model {ident.mn.strip()!r}, serial {ident.sn.strip()!r}, "
        f"firmware {ident.fr.strip()!r})" if ident else f"controller  {ctrl.cntlid}",
        (f"path        tcp {rec['path']} (NVMe/TCP" + (", header digest" if opts.hdr_digest
                                                     else "")
         + (", data digest" if opts.data_digest else "") + f"; paths: {paths})"
         if opts.transport == "tcp" else
         f"path        rdma {rec['path']} via the {ctrl.provider.name} provider "
         f"(paths: {paths})" + (", same host: data through shared memory"
                                if _same_host(ctrl) else "")),
        f"host        {ctrl.hostnqn}" + (
            f", authenticated ({ctrl.authenticated[0]})" if ctrl.authenticated else ""),
        f"state       {state}",
        f"reconnect   every {opts.reconnect_delay:g} s, ctrl-loss-tmo {opts.ctrl_loss_tmo:g} s; "
        f"losses {rec['losses']}, attempts {rec['attempts']}, reconnects {rec['reconnects']} "
        f"(failovers {rec['failovers']}), held {rec['held']} (now {rec['held_now']}), "
        f"retried {rec['retried']}, failed {rec['failed']}"
        + (f"; last loss: {rec['last_reason']}" if rec["last_reason"] else ""),
        f"keep-alive  {opts.keep_alive_tmo:g} s timeout, sent every {opts.keep_alive_tmo / 2:g} s",
        f"max transfer {ctrl.max_transfer} bytes, in-capsule data {ctrl.inline_size} bytes",
        f"mount       {','.join(fs.options.words())}, up since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(fs.started))}",
    ]
    if hasattr(ctrl, "paths_lines"):
        lines.append(f"failover    {rec['failovers']} failover(s), {rec['failbacks']} "
                     f"failback(s), {rec['path_errors']} ANA/path status(es) re-routed")
        lines.append("paths (ANA state per namespace; * where I/O goes)")
        lines.extend(f"  {line}" for line in ctrl.paths_lines())
    lines.append("namespaces")
    for name, ns in fs.files.items():
        ro = "read-only" if not fs.writable(ns) else "read-write"
        lines.append(f"  {name}: {ns.size} bytes, {ns.nblocks} blocks of {ns.block_size} "
                     f"bytes, {ro}")
    queue_stats = ctrl.queue_stats()
    counters = fs.counters.values
    if fs.workers is not None:
        from blockfabric.initiator.fuse_workers import counters_sum
        lines.extend(worker_lines)
        for st in stats:
            queue_stats.update({int(q): v for q, v in st.get("queue_stats", {}).items()})
        counters = counters_sum([counters] + [st["counters"] for st in stats
                                              if st.get("counters")])
        queue_stats = dict(sorted(queue_stats.items()))
    lines.append("queues")
    for qid, st in queue_stats.items():
        kind = "admin" if qid % 1000 == 0 else "io"    # path N's queues: N * 1000 + qid
        lines.append(f"  queue {qid} ({kind}): submitted {st['submitted']}, completed "
                     f"{st['completed']}, in flight {st['inflight']}, max in flight "
                     f"{st['max_inflight']}, errors {st['errors']}")
    reactor = getattr(ctrl, "reactor", None)
    spin = getattr(reactor, "spin_stats", None)
    if spin is not None:            # the mount process's loop (a worker's has its own)
        sp = spin()
        lines.append(f"spin        {sp['spin_us']:g} us: hits {sp['hits']}, misses "
                     f"{sp['misses']}, skipped for depth {sp['skips_depth']}, for CPU "
                     f"pressure {sp['skips_pressure']} (limit {sp['load_limit']:g} %)")
    lines.append("counters" + (" (every worker's)" if fs.workers is not None else ""))
    for key, value in counters.items():
        lines.append(f"  {key.replace('_', ' ')}: {value}")
    return "\n".join(lines) + "\n"

"""``backend: rbd``: a namespace whose volume is a Ceph RBD image, through python3-rbd.

Reads and writes use librbd's asynchronous calls (``aio_read``, ``aio_write``,
``aio_write_zeroes``, ``aio_discard``, ``aio_flush``).  Their callbacks run on librbd's own
threads: there, a read's data is copied into the command's registered bounce buffer (which
the command holds until its answer is done: the buffer is never given back while librbd may
still write it) and the completion is handed to the reactor with ``post``
(``Reactor.call_soon_threadsafe``); nothing else is touched from librbd's threads.

librados ignores ``connect(timeout=...)``: the timeouts of the ``rbd`` section are passed as
its own options (``client mount timeout``, ``rados mon op timeout``, ``rados osd op
timeout``), so a cluster that is down fails start-up, or an I/O, within them.

An operation that fails because the cluster did not answer raises :class:`Unavailable`.  The
target then (see :class:`VolumeWatch`) marks the namespace unavailable, tears down the
controllers of its subsystem and answers their Connects with Controller Busy (retry) while
it probes the image every second: hosts hold their I/O and reconnect as after any loss, and
fail it only when their ctrl_loss_tmo runs out.  When the cluster answers again, Connects are
accepted and the held I/O is re-issued.

The image's size is the namespace's; :class:`VolumeWatch` checks it every
``size_poll_interval`` seconds and after every reload, and a changed size is applied as a
resize (a Namespace Attribute Changed event to the hosts).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.sizes import format_size
from blockfabric.target import config as cfg
from blockfabric.target.backends import Backend, Unavailable, _bytes_view

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.target.controller import Controller
    from blockfabric.target.namespace import Namespace, Subsystem

log = logging.getLogger(__name__)

#: librados/librbd errors that mean "the cluster did not answer", not "this I/O is bad".
_UNREACHABLE = {errno.ETIMEDOUT, errno.ESHUTDOWN, errno.ENOTCONN, errno.ECONNREFUSED,
                errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH}
#: Seconds between probes of an unavailable image.
PROBE_INTERVAL = 1.0

Post = Callable[[Callable[[], None]], None]
Done = Callable[[BaseException | None], None]


def _modules() -> tuple[Any, Any]:
    try:
        import rados
        import rbd
    except ImportError as exc:
        raise OSError(errno.ENOPKG, "backend rbd needs python3-rados and python3-rbd (Debian "
                      "packages; the venv must see the system site-packages): "
                      f"{exc}") from None
    return rados, rbd


def _error(ret: int, what: str) -> OSError:
    err = -ret if ret < 0 else errno.EIO
    msg = f"{what}: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    if err in _UNREACHABLE:
        return Unavailable(err, msg)
    return OSError(err, msg)


def caps_hint(err: int | None, pool: str, namespace: str | None) -> str:
    """For a permission error: the caps the Ceph user needs (docs/ceph.md)."""
    if err not in (errno.EPERM, errno.EACCES):
        return ""
    ns = f" namespace={namespace}" if namespace else ""
    return (f" (the Ceph user lacks caps: it needs mon 'profile rbd' osd 'profile rbd "
            f"pool={pool}{ns}', docs/ceph.md)")


def _from_exception(exc: BaseException, what: str, conf: cfg.Rbd | None = None) -> OSError:
    """A rados/rbd exception (they carry a positive errno) as an OSError."""
    err = getattr(exc, "errno", None) or errno.EIO
    if err in _UNREACHABLE:
        return Unavailable(err, f"{what}: {exc}")
    hint = caps_hint(err, conf.pool, conf.namespace) if conf is not None else ""
    return OSError(err, f"{what}: {exc}{hint}")


class RbdBackend(Backend):
    """One RBD image, opened at construction (connect, ioctx, image) within
    ``rbd.connect_timeout``; raises OSError with a message that names the image and what
    failed."""

    aio = True

    def __init__(self, conf: cfg.Rbd, block_size: int = 4096, read_only: bool = False) -> None:
        rados, rbd = _modules()
        self.conf = conf
        self.spec = conf.spec
        self._cluster = self._ioctx = self._image = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closing = False
        self.unavailable: str | None = None
        self.next_size_poll = 0.0
        options = {
            "client_mount_timeout": str(conf.connect_timeout),
            "rados_mon_op_timeout": str(conf.op_timeout),
            "rados_osd_op_timeout": str(conf.op_timeout),
            "rbd_cache": "false",       # completed writes are in the cluster, not in our RAM
            # Identify says deallocated blocks read as zeros (DLFEAT): librbd's default skips
            # the parts of a discard that do not cover whole objects, leaving the old data.
            "rbd_skip_partial_discard": "false",
        }
        if conf.keyring:
            options["keyring"] = conf.keyring
        what = f"rbd image {self.spec} (cluster {conf.ceph_conf}, as {conf.client})"
        t0 = time.monotonic()
        try:
            self._cluster = rados.Rados(conffile=conf.ceph_conf, name=conf.client, conf=options)
            try:
                self._cluster.connect()
            except rados.Error as exc:
                if getattr(exc, "errno", None) == errno.ETIMEDOUT or isinstance(
                        exc, getattr(rados, "TimedOut", ())):
                    raise OSError(errno.ETIMEDOUT, f"{what}: no answer from the Ceph monitors "
                                  f"within {conf.connect_timeout} s (rbd.connect_timeout): is "
                                  "the cluster up and mon host right?") from None
                raise _from_exception(exc, f"{what}: connecting to the cluster", conf
                                      ) from None
            try:
                self._ioctx = self._cluster.open_ioctx(conf.pool)
            except rados.Error as exc:
                raise _from_exception(exc, f"{what}: opening pool {conf.pool!r}", conf
                                      ) from None
            if conf.namespace:
                self._ioctx.set_namespace(conf.namespace)
            try:
                self._image = rbd.Image(self._ioctx, conf.image, read_only=read_only)
            except rbd.Error as exc:
                raise _from_exception(exc, f"{what}: opening the image", conf) from None
            size = self._image.size()
            #: the image has exclusive-lock: fine for one target, refused in a gateway group
            self.exclusive_lock = bool(self._image.features() & rbd.RBD_FEATURE_EXCLUSIVE_LOCK)
        except rados.Error as exc:
            self._teardown()
            raise _from_exception(exc, what, conf) from None
        except BaseException:
            self._teardown()
            raise
        usable = size - size % block_size
        if usable <= 0:
            self._teardown()
            raise OSError(errno.EINVAL, f"{what}: the image is {size} bytes, less than one "
                                        f"block of {block_size}")
        if usable != size:
            log.warning("%s: %d bytes is not a multiple of block_size %d: exporting %s",
                        what, size, block_size, format_size(usable))
        super().__init__(usable, block_size, read_only)
        log.info("%s: opened, %s, in %.2f s", what, format_size(usable), time.monotonic() - t0)

    def __repr__(self) -> str:
        return f"<RbdBackend {self.spec} {format_size(self.size)} bs={self.block_size}>"

    # -- asynchronous operations (the target's per-I/O path) ---------------------------
    def start(self, post: Post, done: Done, op: str, *args: Any) -> None:
        """Start ``op`` (readinto offset buf | write offset data | write_zeroes offset
        length | discard ranges | flush | probe); ``done(exc)`` runs once, through ``post``
        (on the reactor).  Checks fail at once (raised here, nothing started)."""
        image = self._image
        if op == "readinto":
            offset, buf = args
            view = _bytes_view(buf)
            self._check(offset, len(view))
            length = len(view)

            def read_done(comp: Any, data: bytes | None) -> None:
                ret = comp.get_return_value()
                exc = None
                if ret < 0:
                    exc = _error(ret, f"{self.spec}: read {length} bytes at {offset}")
                elif ret != length or data is None or len(data) != length:
                    exc = OSError(errno.EIO, f"{self.spec}: short read at {offset}: {ret} of "
                                             f"{length} bytes (image shrunk behind the target?)")
                else:
                    view[:] = data      # librbd's thread: the command holds this buffer
                self._finish(post, done, exc)
            self._submit(lambda: image.aio_read(offset, length, read_done))
        elif op == "write":
            offset, data = args
            view = _bytes_view(data)
            self._check(offset, len(view), writing=True)
            payload = bytes(view)       # python3-rbd takes bytes only
            self._submit(lambda: image.aio_write(payload, offset, self._completion(
                post, done, f"write {len(payload)} bytes at {offset}")))
        elif op == "write_zeroes":
            offset, length = args
            self._check(offset, length, writing=True)
            self._submit(lambda: image.aio_write_zeroes(offset, length, self._completion(
                post, done, f"write zeroes {length} bytes at {offset}")))
        elif op == "discard":
            ranges = [(o, n) for o, n in args[0] if n]
            for offset, length in ranges:
                self._check(offset, length, writing=True)
            if not ranges:
                post(lambda: done(None))
                return
            left = [len(ranges)]
            failed: list[BaseException] = []
            lock = threading.Lock()

            def one_done(exc: BaseException | None) -> None:
                with lock:      # librbd's threads
                    if exc is not None and not failed:
                        failed.append(exc)
                    left[0] -= 1
                    last = not left[0]
                if last:
                    post(lambda: done(failed[0] if failed else None))
            for offset, length in ranges:
                self._submit(lambda o=offset, n=length: image.aio_discard(
                    o, n, self._completion(lambda f: f(), one_done,
                                           f"discard {n} bytes at {o}")))
        elif op == "flush":
            self._check(0, 0)
            self._submit(lambda: image.aio_flush(self._completion(post, done, "flush")))
        elif op == "probe":
            self._check(0, 0)
            length = min(self.block_size, self.size)

            def probe_done(comp: Any, _data: bytes | None) -> None:
                ret = comp.get_return_value()
                self._finish(post, done, _error(ret, f"{self.spec}: probe read")
                             if ret < 0 else None)
            self._submit(lambda: image.aio_read(0, length, probe_done))
        else:
            raise ValueError(f"unknown rbd operation {op!r}")

    def _submit(self, call: Callable[[], Any]) -> None:
        with self._lock:
            if self._closing:
                raise OSError(errno.EBADF, f"{self!r} is closed")
            self._inflight += 1
        try:
            call()
        except BaseException as exc:
            self._settle()
            if isinstance(exc, OSError):
                raise
            raise _from_exception(exc, f"{self.spec}: submitting an I/O") from None

    def _settle(self) -> None:
        with self._lock:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def _completion(self, post: Post, done: Done, what: str) -> Callable[[Any], None]:
        def completed(comp: Any) -> None:
            ret = comp.get_return_value()
            self._finish(post, done, _error(ret, f"{self.spec}: {what}") if ret < 0 else None)
        return completed

    def _finish(self, post: Post, done: Done, exc: BaseException | None) -> None:
        """On librbd's thread: hand the result to the reactor, then count the op done."""
        try:
            post(lambda: done(exc))
        except Exception as err:  # the reactor is gone (target stopping): nobody waits
            log.debug("%s: completion after the reactor closed: %s", self.spec, err)
        finally:
            self._settle()

    # -- synchronous operations (backend threads: multi-namespace flush, drain) ---------
    def _readinto(self, offset: int, buf: memoryview) -> None:
        try:
            data = self._image.read(offset, len(buf))
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: read") from None
        if len(data) != len(buf):
            raise OSError(errno.EIO, f"{self.spec}: short read at {offset}")
        buf[:] = data

    def _write(self, offset: int, data: memoryview) -> None:
        try:
            self._image.write(bytes(data), offset)
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: write") from None

    def _write_zeroes(self, offset: int, length: int) -> None:
        try:
            self._image.write_zeroes(offset, length)
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: write zeroes") from None

    def _discard(self, offset: int, length: int) -> None:
        try:
            self._image.discard(offset, length)
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: discard") from None

    def _flush(self) -> None:
        try:
            self._image.flush()
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: flush") from None

    def current_size(self) -> int:
        """The image's size now, rounded down to whole blocks (blocking: backend threads)."""
        try:
            size = self._image.size()
        except Exception as exc:
            raise _from_exception(exc, f"{self.spec}: size") from None
        return size - size % self.block_size

    def _resize(self, size: int) -> None:
        pass        # the image was resized in the cluster (rbd resize): take its size

    def _close(self) -> None:
        # Wait for librbd's completions: a callback may still copy into a bounce buffer,
        # which the target frees after closing its volumes.  Bounded by the op timeout.
        deadline = time.monotonic() + self.conf.op_timeout + 5
        with self._lock:
            self._closing = True
            while self._inflight and time.monotonic() < deadline:
                self._idle.wait(0.5)
            left = self._inflight
        if left:
            log.error("%s: %d operations still in librbd at close", self.spec, left)
        self._teardown()

    def _teardown(self) -> None:
        for obj in (self._image, self._ioctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # closing continues
                    log.debug("%s: close: %s", self.spec, exc)
        if self._cluster is not None:
            try:
                self._cluster.shutdown()
            except Exception as exc:
                log.debug("%s: shutdown: %s", self.spec, exc)
        self._image = self._ioctx = self._cluster = None


def open_rbd(ns: cfg.Namespace) -> RbdBackend:
    assert ns.rbd is not None
    return RbdBackend(ns.rbd, ns.block_size, ns.read_only)


class VolumeWatch:
    """The target's side of volumes that live elsewhere (RBD): their availability, and their
    size.  Everything here runs on the reactor.

    ``subsystems``: the target's (the live dict); ``destroy_where(condition, reason)``: end
    the controllers that meet ``condition``; ``run_blocking(work, finish, host)``: the
    backend threads; ``resize(subsystem, namespace, conf)``: apply a new size between
    commands (:class:`~blockfabric.target.nschanges.NamespaceChanges`)."""

    def __init__(self, reactor: Reactor, subsystems: dict[str, Subsystem],
                 destroy_where: Callable[[Callable[[Controller], bool], str], None],
                 run_blocking: Callable[[Callable[[], object],
                                         Callable[[BaseException | None], None], str], None],
                 resize: Callable[[Subsystem, Namespace, cfg.Namespace], None]) -> None:
        self.reactor = reactor
        self.subsystems = subsystems
        self.destroy_where = destroy_where
        self.run_blocking = run_blocking
        self.resize = resize
        self._timer = None
        self.unavailable_events = 0

    # -- availability -------------------------------------------------------------------
    def lost(self, namespaces: list[Namespace], exc: BaseException) -> None:
        """A command on ``namespaces`` failed because the cluster did not answer: mark the
        volume unavailable, end the controllers of its subsystems (the hosts hold their I/O
        and reconnect) and probe until it answers."""
        for ns in namespaces:
            backend = ns.backend
            # (a Flush of every namespace names them all: only RBD volumes can be away)
            if not isinstance(backend, RbdBackend) or backend.unavailable is not None \
                    or backend.closed:
                continue
            backend.unavailable = str(exc)
            self.unavailable_events += 1
            subs = [s for s in self.subsystems.values() if s.namespaces.get(ns.nsid) is ns]
            log.error("namespace unavailable: %s nsid=%d: %s; disconnecting its hosts, who "
                      "reconnect (Controller Busy until it answers) within their ctrl_loss_tmo",
                      ",".join(s.nqn for s in subs) or "-", ns.nsid, exc)
            for sub in subs:
                self.destroy_where(lambda c, s=sub: c.subsystem is s,
                                   f"namespace {ns.nsid} unavailable")
            self.reactor.call_later(PROBE_INTERVAL, lambda n=ns: self._probe(n))

    def _probe(self, ns: Namespace) -> None:
        backend = ns.backend
        if backend.closed or backend.unavailable is None:
            return

        def probed(exc: BaseException | None) -> None:
            if backend.closed:
                return
            if exc is None:
                log.warning("namespace available again: nsid=%d %s", ns.nsid, backend.spec)
                backend.unavailable = None
            else:
                backend.unavailable = str(exc)
                self.reactor.call_later(PROBE_INTERVAL, lambda: self._probe(ns))
        try:
            backend.start(self.reactor.call_soon_threadsafe, probed, "probe")
        except OSError as exc:
            probed(exc)

    def check_connect(self, subsystem: Subsystem) -> None:
        """Raise Controller Busy (may retry) for a Connect to a subsystem with a volume that
        does not answer."""
        from blockfabric.protocol import StatusCode
        from blockfabric.protocol.errors import ProtocolError
        for ns in subsystem.namespaces.values():
            why = getattr(ns.backend, "unavailable", None)
            if why is not None:
                raise ProtocolError(f"namespace {ns.nsid} is unavailable ({why}): retry later",
                                    StatusCode.CONNECT_CTRL_BUSY, dnr=False)

    # -- size -------------------------------------------------------------------------
    def start(self) -> None:
        if self._timer is None:
            self._timer = self.reactor.call_later(1.0, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        try:
            self.poll_sizes(force=False)
        finally:
            self.start()

    def poll_sizes(self, force: bool = True) -> None:
        """Check the size of every RBD volume that is due (all of them: ``force``, after a
        reload) on the backend threads; a changed size is applied as a resize."""
        now = time.monotonic()
        for sub in list(self.subsystems.values()):
            for ns in list(sub.namespaces.values()):
                backend = ns.backend
                if not isinstance(backend, RbdBackend) or backend.closed \
                        or backend.unavailable is not None or ns.paused:
                    continue
                interval = backend.conf.size_poll_interval
                if not force and (not interval or now < backend.next_size_poll):
                    continue
                backend.next_size_poll = now + (interval or 0)
                result: list[int] = []

                def work(b: RbdBackend = backend) -> None:
                    result.append(b.current_size())

                def finish(exc: BaseException | None, s: Subsystem = sub, n: Namespace = ns,
                           r: list[int] = result) -> None:
                    if exc is not None:
                        log.warning("nsid %d: checking the image size: %s", n.nsid, exc)
                    elif r and r[0] != n.size and not n.backend.closed and not n.paused \
                            and self.subsystems.get(s.nqn) is s:
                        log.info("rbd image %s: size %s -> %s", n.backend.spec,
                                 format_size(n.size), format_size(r[0]))
                        self.resize(s, n, dataclasses.replace(n.conf, size=r[0]))
                self.run_blocking(work, finish, "(rbd size check)")

"""Where a namespace's reservation state lives (see :mod:`target.reservations`).

* :class:`MemoryStore`: a ramdisk or null volume, or a block device: in the daemon's memory
  only; PTPL is not offered (RESCAP bit 0 clear; CPTPL 3 is Invalid Field).
* :class:`FileStore`: a file volume: a sidecar ``<volume>.resv`` (JSON) beside it, replaced
  by write-to-temp, fsync and rename under an exclusive ``flock`` of ``<volume>.resv.lock``,
  so two processes serving the same file (two targets on one host, a restart racing the
  old process) change it one at a time, and a crash leaves the old or the new state.
* :class:`RadosStore` (target.rbdvolume's cluster): one object per image,
  ``blockfabric.resv.<pool>.<image>``, written only by a compare-and-write on its
  ``version`` xattr, and every gateway told through watch/notify.

A store either returns the state or raises :class:`StoreError`; the controller then answers
an error status, never a guess.  Every method may block: they run on the backend threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
from typing import Any, Callable

from blockfabric.fileutil import atomic_write
from blockfabric.protocol.resv import LogType
from blockfabric.protocol.status import StatusCode
from blockfabric.target.reservations import Notice, Outcome, State

log = logging.getLogger(__name__)


class StoreError(OSError):
    """The state could not be read or written: the command fails, the I/O waits."""


class Store:
    """Read-modify-write of one namespace's state, atomic against every other writer."""

    ptpl_capable = False
    kind = "memory"

    def load(self, fresh_start: bool = False) -> State:
        """The current state.  ``fresh_start``: the daemon has just started, so a state not
        persisted through power loss (PTPL clear) is dropped, as a power cycle drops it."""
        raise NotImplementedError

    def update(self, change: Callable[[State], Outcome]) -> Outcome:
        """Apply ``change`` to the current state and store the result if it succeeded."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryStore(Store):
    def __init__(self) -> None:
        self._state = State()
        self._lock = threading.Lock()

    def load(self, fresh_start: bool = False) -> State:
        return self._state

    def update(self, change: Callable[[State], Outcome]) -> Outcome:
        with self._lock:
            out = change(self._state)
            if out.ok and out.state != self._state:
                out.state = State(**{**out.state.__dict__,
                                     "version": self._state.version + 1})
                self._state = out.state
            return out


class FileStore(Store):
    """The sidecar of a file volume; persists through a restart when PTPL is set."""

    ptpl_capable = True
    kind = "file"

    def __init__(self, volume: str) -> None:
        self.path = volume + ".resv"
        self.lock_path = volume + ".resv.lock"
        self._mutex = threading.Lock()      # flock does not serialize threads of one process

    def _locked(self, work: Callable[[], object]) -> object:
        with self._mutex:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise StoreError(exc.errno, f"reservation lock {self.lock_path}: "
                                 f"{exc.strerror}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                return work()
            finally:
                os.close(fd)            # releases the flock

    def _read(self) -> State:
        try:
            with open(self.path, "rb") as f:
                text = f.read(1 << 20)
        except FileNotFoundError:
            return State()
        except OSError as exc:
            raise StoreError(exc.errno, f"reservation state {self.path}: {exc.strerror}"
                             ) from exc
        try:
            return State.from_json(text)
        except ValueError as exc:
            raise StoreError(errno.EBADMSG, f"reservation state {self.path}: {exc}") from exc

    def _write(self, st: State) -> None:
        try:
            atomic_write(self.path, st.to_json() + "\n")
        except OSError as exc:
            raise StoreError(exc.errno, f"reservation state {self.path}: {exc.strerror}"
                             ) from exc

    def load(self, fresh_start: bool = False) -> State:
        def work() -> State:
            st = self._read()
            if fresh_start and not st.ptpl and (st.regs or st.rtype):
                st = State(gen=st.gen, version=st.version + 1)   # "power loss" without PTPL
                self._write(st)
            return st
        return self._locked(work)  # type: ignore[return-value]

    def update(self, change: Callable[[State], Outcome]) -> Outcome:
        def work() -> Outcome:
            current = self._read()
            out = change(current)
            if out.ok and out.state != current:
                out.state = State(**{**out.state.__dict__, "version": current.version + 1})
                self._write(out.state)
            return out
        return self._locked(work)  # type: ignore[return-value]


def store_for(conf) -> Store:
    """The store of a namespace's volume (a cfg.Namespace)."""
    if conf.backend == "file" and conf.path and os.path.isfile(conf.path):
        return FileStore(conf.path)
    if conf.backend == "rbd":
        return RadosStore(conf.rbd)
    return MemoryStore()


#: Compare-and-write attempts before a command gives up (another gateway kept winning).
RADOS_RETRIES = 16
NOTIFY_TIMEOUT_MS = 5000


class RadosStore(Store):
    """The state of an RBD namespace: object ``blockfabric.resv.<image>`` in the image's
    pool (and RADOS namespace), shared by every gateway that exports the image.

    An update reads the object and its version, applies the command, and writes the result
    with ``assert_version`` (or an exclusive create): a gateway that changed it meanwhile
    makes the write fail with ERANGE, and the command is applied again to the new state.
    Then a notify on the object carries the new state (and the hosts a Preempt and Abort
    fenced) to every gateway's watch; it returns once each has applied it and drained the
    fenced hosts' commands (:meth:`watch`), so the command completes only when no gateway
    still admits what the new state forbids.  A watch that breaks makes the namespace's
    state unknown (I/O waits with "namespace not ready") until it is set up again.

    The state is in RADOS whatever PTPL says: a gateway group has no power cycle that would
    drop it (PTPL is recorded and reported, and ``clear`` removes everything).
    """

    ptpl_capable = True
    kind = "rados"

    def __init__(self, conf) -> None:
        import rados
        self._rados = rados
        self.conf = conf
        self.obj = f"blockfabric.resv.{conf.image}"
        self.origin = os.urandom(8).hex()   # this store's notifies: its notices are sent
        options = {"client_mount_timeout": str(conf.connect_timeout),
                   "rados_mon_op_timeout": str(conf.op_timeout),
                   "rados_osd_op_timeout": str(conf.op_timeout)}
        if conf.keyring:
            options["keyring"] = conf.keyring
        self._cluster = rados.Rados(conffile=conf.ceph_conf, name=conf.client, conf=options)
        self._io: Any = None    # a rados.Ioctx once connected (python3-rados is untyped)
        self._watch = None
        self._lock = threading.Lock()
        try:
            self._cluster.connect()
            self._io = self._cluster.open_ioctx(conf.pool)
            if conf.namespace:
                self._io.set_namespace(conf.namespace)
        except rados.Error as exc:
            self.close()
            raise StoreError(errno.EIO, f"reservation state of {conf.spec}: {exc}") from exc

    def _read(self) -> tuple[State, int | None]:
        """(state, object version); version None: no object yet."""
        rados = self._rados
        try:
            data = self._io.read(self.obj, 1 << 20)
        except rados.ObjectNotFound:
            return State(), None
        except rados.Error as exc:
            raise StoreError(errno.EIO, f"reservation state {self.obj}: {exc}") from exc
        version = self._io.get_last_version()
        if not data:
            return State(), version
        try:
            return State.from_json(data), version
        except ValueError as exc:
            raise StoreError(errno.EBADMSG, f"reservation state {self.obj}: {exc}") from exc

    def load(self, fresh_start: bool = False) -> State:
        with self._lock:
            return self._read()[0]

    def update(self, change: Callable[[State], Outcome]) -> Outcome:
        rados = self._rados
        with self._lock:
            for _ in range(RADOS_RETRIES):
                current, version = self._read()
                out = change(current)
                if not out.ok or out.state == current:
                    return out
                out.state = State(**{**out.state.__dict__, "version": current.version + 1})
                op = self._io.create_write_op()
                try:
                    if version is None:
                        op.new(rados.LIBRADOS_CREATE_EXCLUSIVE)
                    else:
                        op.assert_version(version)
                    op.write_full(out.state.to_json().encode())
                    self._io.operate_write_op(op, self.obj)
                except (rados.ObjectExists, rados.OutOfRange):
                    continue                    # another gateway changed it first: again
                except rados.Error as exc:
                    if getattr(exc, "errno", None) in (errno.ERANGE, errno.EEXIST):
                        continue
                    raise StoreError(errno.EIO, f"reservation state {self.obj}: {exc}"
                                     ) from exc
                finally:
                    self._io.release_write_op(op)
                self._tell(out)
                return out
        raise StoreError(errno.EAGAIN, f"reservation state {self.obj}: changed by other "
                                       f"gateways {RADOS_RETRIES} times in a row")

    def _tell(self, out: Outcome) -> None:
        msg = json.dumps({"state": out.state.to_json(), "origin": self.origin,
                          "fenced": [h.hex() for h in out.fenced],
                          "notices": [[n.hostid.hex(), int(n.log_type)]
                                      for n in out.notices]})
        try:
            self._io.notify(self.obj, msg, NOTIFY_TIMEOUT_MS)
        except self._rados.Error as exc:
            # Stored; a gateway that did not answer in time has lost its watch (it then
            # refuses I/O until it reads the state again) or is gone.
            log.warning(
                "reservation state %s: not every gateway answered the notify: %s",
                self.obj, exc)

    def watch(self, apply: Callable[[Outcome], None], lost: Callable[[], None]) -> None:
        """Call ``apply(outcome)`` (it blocks until done) for every notify: the new state,
        the hosts fenced and, unless this store sent it (and told its own controllers),
        the notices; ``lost()`` when the watch breaks."""
        def notified(_notify_id: int, _notifier: str, _watch_id: int, data: bytes) -> None:
            try:
                d = json.loads(data)
                mine = d["origin"] == self.origin
                apply(Outcome(StatusCode.SUCCESS, State.from_json(d["state"]),
                              [] if mine else [Notice(bytes.fromhex(h), LogType(t))
                                               for h, t in d["notices"]],
                              [bytes.fromhex(h) for h in d["fenced"]]))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("reservation notify on %s: %s", self.obj, exc)
                lost()

        def broken(_err: int) -> None:
            lost()

        rados = self._rados
        with self._lock:
            op = self._io.create_write_op()
            try:                            # a watch needs the object: an empty one is
                op.new(rados.LIBRADOS_CREATE_EXCLUSIVE)          # "no state yet"
                self._io.operate_write_op(op, self.obj)
            except rados.ObjectExists:
                pass
            finally:
                self._io.release_write_op(op)
            if self._watch is not None:
                try:
                    self._watch.close()
                except self._rados.Error:
                    pass
            self._watch = self._io.watch(self.obj, notified, broken)

    @property
    def closed(self) -> bool:
        return self._io is None

    def close(self) -> None:
        """The watch, the pool context, the cluster handle: each ended once, whatever the
        previous one said (teardown goes on)."""
        handles = ((self._watch, "close"), (self._io, "close"), (self._cluster, "shutdown"))
        self._watch = self._io = self._cluster = None
        for handle, end in handles:
            if handle is not None:
                with contextlib.suppress(Exception):
                    getattr(handle, end)()

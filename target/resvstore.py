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

import errno
import fcntl
import os
import threading
from typing import Callable

from blockfabric.fileutil import atomic_write
from blockfabric.target.reservations import Outcome, State


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


def store_for(backend_name: str, path: str | None) -> Store:
    """The store of a namespace's volume (the RADOS one is made by target.rbdvolume)."""
    if backend_name == "file" and path and os.path.isfile(path):
        return FileStore(path)
    return MemoryStore()

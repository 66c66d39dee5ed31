"""The soft device ("soft0"): key tables, and the progress engine over an epoll of its sockets.

:meth:`SoftContext.progress` is the whole engine: it reads frames into registered memory,
answers requests, retires acknowledged work and fires timers.  Whatever goes wrong while
handling one connection (a bug included: the peer's bytes are validated before use) ends
that connection and nothing else: it never reaches another connection's handling, nor the
caller of ``CQ.poll`` whose call happened to run the engine.  It is driven either by a
daemon thread (``progress="thread"``) or by the CQ owner through :meth:`CQ.poll`
(``progress="poll"``), so a reactor can run the provider without thread hand-offs.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import TYPE_CHECKING

from blockfabric.rdma.base import Context
from blockfabric.rdma.soft.cq import SoftCQ
from blockfabric.rdma.soft.memory import KeyAllocator, SoftMR, SoftPD

if TYPE_CHECKING:
    from blockfabric.rdma.soft.qp import SoftQP

_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_READ_EVENTS = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
SWEEP_INTERVAL = 0.05   # how often transport (ack) timeouts are checked


class SoftContext(Context):
    def __init__(self, progress: str = "thread") -> None:
        if progress not in ("thread", "poll"):
            raise ValueError(f"progress must be 'thread' or 'poll', not {progress!r}")
        self.name = "soft0"
        self.poll_mode = progress == "poll"
        self.lkeys: dict[int, SoftMR] = {}
        self.rkeys: dict[int, SoftMR] = {}
        self._keys = KeyAllocator()
        self._qp_nums = 0x11
        self._ep = select.epoll()
        self._fds: dict[int, "SoftQP"] = {}
        self._qps: set["SoftQP"] = set()
        self.rnr_waiters: set["SoftQP"] = set()
        self._plock = threading.Lock()
        self._klock = threading.Lock()
        self._next_sweep = 0.0
        # readable while a timer is pending, so a poll-mode owner keeps calling progress()
        self._kick = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ep.register(self._kick, _IN)
        self._kicked = False
        self._thread: threading.Thread | None = None
        self.closed = False

    # ------------------------------------------------------------------ resources
    def alloc_pd(self) -> SoftPD:
        return SoftPD(self)

    def create_cq(self, depth: int = 256) -> SoftCQ:
        return SoftCQ(self, depth)

    def new_keys(self) -> tuple[int, int]:
        with self._klock:
            return self._keys.pair()

    def new_qp_num(self) -> int:
        with self._klock:
            self._qp_nums += 1
            return self._qp_nums & 0xFFFFFF

    def fileno(self) -> int:
        return self._ep.fileno()

    def watch_fd(self, fd: int) -> None:
        self._ep.register(fd, _IN)

    def unwatch_fd(self, fd: int) -> None:
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ sockets
    def register(self, qp: "SoftQP") -> None:
        fd = qp.sock.fileno()
        self._fds[fd] = qp
        self._qps.add(qp)
        self._ep.register(fd, _IN)
        if not self.poll_mode and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="soft0-progress", daemon=True)
            self._thread.start()

    def unregister(self, qp: "SoftQP", fd: int) -> None:
        self._qps.discard(qp)
        self.rnr_waiters.discard(qp)
        if self._fds.get(fd) is qp:
            del self._fds[fd]
            self.unwatch_fd(fd)

    def want_write(self, fd: int, on: bool) -> None:
        try:
            self._ep.modify(fd, _IN | _OUT if on else _IN)
        except (OSError, ValueError):
            pass

    def timer_pending(self) -> None:
        """A QP armed a timer: make sure someone calls progress() soon."""
        if self.poll_mode:
            os.eventfd_write(self._kick, 1)
            self._kicked = True     # after the write: progress() reads it only when set

    # ------------------------------------------------------------------ the engine
    def progress(self, timeout: float = 0.0) -> int:
        """Do all pending network work, waiting up to ``timeout`` s for some; return the
        number of ready sockets handled.  Re-entrant calls from other threads return 0."""
        if not self._plock.acquire(blocking=False):
            return 0
        try:
            if self.rnr_waiters:
                timeout = min(timeout, self._fire_rnr(time.monotonic()))
            try:
                events = self._ep.poll(timeout)
            except InterruptedError:
                events = []
            fds = self._fds
            for fd, ev in events:
                qp = fds.get(fd)
                if qp is None:
                    continue
                try:
                    if ev & _OUT:
                        qp.on_writable()
                    if ev & _READ_EVENTS:
                        qp.on_readable()
                except Exception as exc:  # noqa: BLE001  one connection's, and only its
                    qp.fail(exc)
            now = time.monotonic()
            if self.rnr_waiters:
                self._fire_rnr(now)
            elif self._kicked:      # (poll mode) a system call only when there is a kick
                self._kicked = False
                try:
                    os.eventfd_read(self._kick)
                except BlockingIOError:
                    pass
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_INTERVAL
                for qp in list(self._qps):
                    try:
                        qp.check_timeout(now)
                    except Exception as exc:  # noqa: BLE001
                        qp.fail(exc)
            return len(events)
        finally:
            self._plock.release()

    def _fire_rnr(self, now: float) -> float:
        """Replay QPs whose RNR timer expired; return seconds until the next one."""
        wait = SWEEP_INTERVAL
        for qp in list(self.rnr_waiters):
            left = qp.rnr_deadline - now
            if left <= 0:
                self.rnr_waiters.discard(qp)
                try:
                    qp.rnr_replay()
                except Exception as exc:  # noqa: BLE001
                    qp.fail(exc)
            else:
                wait = min(wait, left)
        return wait

    def _run(self) -> None:
        while not self.closed:
            try:
                self.progress(SWEEP_INTERVAL)
            except Exception:  # noqa: BLE001  (the engine must outlive one bad QP)
                import logging
                logging.getLogger(__name__).exception("soft progress engine")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for qp in list(self._qps):
            qp.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        self._ep.close()
        os.close(self._kick)

"""Completion queues of the soft provider, with completion-channel semantics.

Thread progress: the fd is an eventfd written when a completion arrives on an armed CQ.
Poll progress: the fd is the device's epoll fd (readable when its sockets have work, or when
an armed CQ got a completion from another thread), and :meth:`poll` drives the engine.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import TYPE_CHECKING

from blockfabric.rdma.base import CQ, WC

if TYPE_CHECKING:
    from blockfabric.rdma.soft.device import SoftContext


class SoftCQ(CQ):
    def __init__(self, ctx: "SoftContext", depth: int) -> None:
        self.ctx = ctx
        self.depth = depth
        self._q: deque[WC] = deque()
        self._armed = False
        self._signalled = False
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll_mode = ctx.poll_mode
        self.closed = False
        if self._poll_mode:
            ctx.watch_fd(self._efd)

    def push(self, wc: WC) -> None:
        """Add a completion (engine side).  Append before reading the arm flag: no lost wake-up."""
        self._q.append(wc)
        if self._armed:
            self._armed = False
            self._signal()

    def _signal(self) -> None:
        os.eventfd_write(self._efd, 1)
        self._signalled = True      # after the write: ack_events reads only when set

    def poll(self, max_entries: int = 16) -> list[WC]:
        q = self._q
        if self._poll_mode:
            self.ctx.progress(0)
        elif not q:
            # a caller spinning on an empty CQ would hold the GIL from the progress thread
            # for a whole switch interval (5 ms): let it run
            time.sleep(0)
        out = []
        while q and len(out) < max_entries:
            out.append(q.popleft())
        return out

    def fileno(self) -> int:
        return self.ctx.fileno() if self._poll_mode else self._efd

    def req_notify(self, solicited_only: bool = False) -> None:
        self._armed = True
        if self._q:  # already waiting: make the fd readable now (a permitted spurious wake-up)
            self._armed = False
            self._signal()

    def ack_events(self) -> int:
        n = 0
        if self._signalled:         # a system call (and an exception) only when signalled
            self._signalled = False
            try:
                n = os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
        if self._poll_mode:
            self.ctx.progress(0)
        return n

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._poll_mode:
            self.ctx.unwatch_fd(self._efd)
        os.close(self._efd)

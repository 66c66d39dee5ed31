"""Completion queues of the soft provider, with completion-channel semantics.

Thread progress: the fd is an eventfd written when a completion arrives on an armed CQ.
Poll progress, a CQ on its own: the fd is the device's epoll fd (readable when its sockets
have work, or when an armed CQ got a completion from another thread), and :meth:`poll`
drives the engine.  Poll progress, a CQ attached to a reactor (:meth:`attach_reactor`): the
reactor's one registration for this device (a :class:`~blockfabric.rdma.soft.device.Group`)
runs the engine once per wake-up and calls back the owner of each CQ that got completions;
such a CQ needs no arming, and :meth:`poll` only hands out what is queued.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.rdma.base import CQ, WC

if TYPE_CHECKING:
    from blockfabric.rdma.base import RawWC
    from blockfabric.rdma.soft.device import Group, SoftContext


def drain_eventfd(fd: int) -> int:
    """Read (reset) an eventfd that was signalled; 0 if it was not readable after all."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


class SoftCQ(CQ):
    def __init__(self, ctx: "SoftContext", depth: int) -> None:
        self.ctx = ctx
        self.depth = depth
        self._q: deque[WC | RawWC] = deque()     # RawWC tuples once set_raw
        self._armed = False
        self._signalled = False
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll_mode = ctx.poll_mode
        self.closed = False
        #: attached: the reactor group that services this CQ, and the owner it calls
        self.group: "Group | None" = None
        self.owner: Callable[[], None] | None = None
        self.listed = False         # on the group's ready list
        #: (opt-in, :meth:`set_raw`) entries are (wr_id, status, byte_len) tuples, not WCs
        self.raw = False
        if self._poll_mode:
            ctx.watch_fd(self._efd)

    def set_raw(self) -> None:
        """From now on :meth:`poll` hands out ``(wr_id, status, byte_len)`` tuples, not
        :class:`WC` objects (no opcode, flags, immediate data nor invalidated rkey): the
        fast path of an owner that needs no more, with no object made per completion."""
        self.raw = True

    def push(self, wc: WC) -> None:
        """Add a completion (engine side).  Append before reading the arm flag or listing
        the CQ: no lost wake-up."""
        self._q.append((wc.wr_id, wc.status, wc.byte_len) if self.raw else wc)
        if not self.listed:
            self.note()

    def note(self) -> None:
        """After an entry was appended to ``_q`` (by :meth:`push`, or inline by the engine's
        per-I/O paths, which append a raw tuple or a WC as :attr:`raw` says and call this
        unless the CQ is ``listed`` already): list the CQ for its group, or signal it."""
        group = self.group
        if group is not None:
            if not self.listed:
                self.listed = True
                group.ready.append(self)
                if not group.active:
                    group.wake()
        elif self._armed:
            self._armed = False
            self._signal()

    def _signal(self) -> None:
        os.eventfd_write(self._efd, 1)
        self._signalled = True      # after the write: ack_events reads only when set

    def poll(self, max_entries: int = 16) -> list[WC]:
        q = self._q
        if self.group is None:
            if self._poll_mode:
                self.ctx.progress(0)
            elif not q:
                # a caller spinning on an empty CQ would hold the GIL from the progress
                # thread for a whole switch interval (5 ms): let it run
                time.sleep(0)
        n = len(q)
        if not n:
            return []
        popleft = q.popleft     # one consumer; producers only append
        out: list[Any] = []     # (a loop in this frame: a comprehension is a call in 3.11)
        for _ in range(n if n < max_entries else max_entries):
            out.append(popleft())
        return out

    def fileno(self) -> int:
        return self.ctx.fileno() if self._poll_mode else self._efd

    def req_notify(self, solicited_only: bool = False) -> None:
        if self.group is not None:
            return                  # the group sees every completion
        self._armed = True
        if self._q:  # already waiting: make the fd readable now (a permitted spurious wake-up)
            self._armed = False
            self._signal()

    def ack_events(self) -> int:
        if self.group is not None:
            return 0
        n = 0
        if self._signalled:         # a system call (and an exception) only when signalled
            self._signalled = False
            n = drain_eventfd(self._efd)
        if self._poll_mode:
            self.ctx.progress(0)
        return n

    # -- reactor attachment (see Reactor.add_cq) -----------------------------------------
    def attach_reactor(self, reactor, callback: Callable[[], None]) -> bool:
        """Poll mode: be serviced by ``reactor`` through the device's group for it (True);
        thread mode: False (the reactor waits on this CQ's eventfd)."""
        if not self._poll_mode or self.closed:
            return False
        if self.group is not None:
            raise RuntimeError("this CQ is already attached to a reactor")
        self.ctx.unwatch_fd(self._efd)      # no arming from now on
        self._armed = False
        if self._signalled:
            self._signalled = False
            drain_eventfd(self._efd)
        self.owner = callback
        group = self.ctx.group(reactor)
        group.add(self)
        self.group = group
        if self._q and not self.listed:
            self.listed = True
            group.ready.append(self)
            group.wake()
        return True

    def detach_reactor(self, reactor, callback: Callable[[], None]) -> bool:
        """Undo :meth:`attach_reactor`: True if it had attached through a group; False
        otherwise (the reactor then removes its reader of this CQ's fd)."""
        group = self.group
        if group is None or group.reactor is not reactor:
            return False
        self._detach()
        return True

    def _detach(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        self.owner = None
        self.listed = False
        group.remove(self)
        if self._poll_mode and not self.closed:
            self.ctx.watch_fd(self._efd)

    def close(self) -> None:
        if self.closed:
            return
        self._detach()
        self.closed = True
        if self._poll_mode:
            self.ctx.unwatch_fd(self._efd)
        os.close(self._efd)

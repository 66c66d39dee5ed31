"""Fair shares of the target's shared pools: bounce buffers and backend I/O threads.

Every host (host NQN; before Fabrics Connect a queue does no I/O) that wants a unit of a
shared pool gets one at once while it holds fewer than its share; otherwise its request waits
in its own FIFO, and when a unit comes back the waiting hosts are served round-robin, each
only while under its share.  The share is the whole pool while one host is active, and
``max(floor, size // active hosts)`` when several are, a host counting as active while it
holds or waits for a unit, or did within ``ACTIVE_WINDOW`` seconds (so a host between two of
its commands keeps its share instead of finding the pool taken when it comes back).

A unit the share keeps free for an active host is not lent to a host over its share: a
hoarder cannot take back what another host needs, only what nobody else wants.

The share is counted again only when the number of active hosts may have changed (a host
starts asking, gives its last unit back, or its window ends), so a request or a unit back
costs O(1) integer work however many hosts share the pool.  Everything here runs on the
target's reactor thread, without locks.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from time import monotonic
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.fabric.buffers import BufferPool
from blockfabric.rdma import SGE

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.fabric.target_side import Command

log = logging.getLogger(__name__)

#: Seconds a host still counts as wanting a pool after its last request.
ACTIVE_WINDOW = 1.0


class HostShare:
    """One host's use of one pool: units held, requests waiting, when it last asked."""

    __slots__ = ("key", "held", "waiting", "last", "in_ring")

    def __init__(self, key: str) -> None:
        self.key = key
        self.held = 0
        self.waiting: deque[tuple] = deque()
        self.last = 0.0
        self.in_ring = False


class FairShare:
    """``size`` units shared round-robin by hosts; subclasses say what granting one means."""

    #: Whether units nobody under its share waits for are lent to hosts over their share
    #: (only where a unit always comes back soon by itself: not for buffers a host holds).
    LEND = False

    def __init__(self, size: int, floor: int) -> None:
        self.size = size
        self.floor = max(1, min(floor, size))
        self.used = 0
        self.hosts: dict[str, HostShare] = {}
        self.ring: deque[HostShare] = deque()       # hosts with requests waiting
        self._dispatching = False
        # share() counted once and kept until the count of active hosts may change: a host
        # starts (request) or may stop being active (its last unit back, or its window
        # over), so that a request costs O(1) however many hosts there are.
        self._share = size
        self._share_until = -1.0

    def share(self, now: float) -> int:
        """What one host may hold now: all of it for a lone host, else an even split."""
        if now < self._share_until:
            return self._share
        hosts = self.hosts
        if len(hosts) == 1:
            self._share, self._share_until = self.size, float("inf")
            return self.size
        active = 0
        stale = None
        until = float("inf")
        for h in hosts.values():
            if h.held or h.waiting:
                active += 1
            elif now - h.last < ACTIVE_WINDOW:
                active += 1
                until = min(until, h.last + ACTIVE_WINDOW)
            else:
                stale = stale or []
                stale.append(h.key)
        if stale:                                   # a host that left costs nothing
            for key in stale:
                del hosts[key]
        self._share = max(self.floor, self.size // max(active, 1))
        self._share_until = until
        return self._share

    def _may_go_idle(self, h: HostShare) -> None:
        """``h`` holds and waits for nothing: it stops counting once its window is over."""
        if not h.held and not h.waiting:
            self._share_until = min(self._share_until, h.last + ACTIVE_WINDOW)

    def request(self, key: str, item: tuple) -> None:
        """Grant ``item`` now if the host is under its share, else queue it (its FIFO)."""
        h = self.hosts.get(key)
        if h is None:
            h = self.hosts[key] = HostShare(key)
        now = monotonic()
        if not h.held and not h.waiting and now - h.last >= ACTIVE_WINDOW:
            self._share_until = -1.0                # one more active host
        h.last = now
        if not h.waiting and self.used < self.size and (
                h.held < self.share(now) or (self.LEND and not self.ring)):
            self.used += 1
            h.held += 1
            self._grant(h, item)
            return
        h.waiting.append(item)
        if not h.in_ring:
            h.in_ring = True
            self.ring.append(h)

    def done(self, h: HostShare) -> None:
        """One unit of ``h`` came back: serve whoever waits."""
        h.held -= 1
        self.used -= 1
        if not h.held:
            self._may_go_idle(h)
        if self.ring and not self._dispatching:
            self._dispatch()

    def _dispatch(self) -> None:
        """Round-robin over the hosts that wait, each under its share, while units are free
        (then, with LEND, over the others too)."""
        self._dispatching = True
        try:
            ring = self.ring
            lending = False
            while ring and self.used < self.size:
                cap = self.size if lending else self.share(monotonic())
                served = False
                for _ in range(len(ring)):
                    if self.used >= self.size:
                        break
                    h = ring.popleft()
                    if h.held < cap:
                        item = h.waiting.popleft()
                        if self.wanted(item):
                            self.used += 1
                            h.held += 1
                            self._grant(h, item)
                        else:
                            self._may_go_idle(h)
                        served = True
                    if h.waiting:
                        ring.append(h)
                    else:
                        h.in_ring = False
                if not served:
                    if lending or not self.LEND:
                        break
                    lending = True
        finally:
            self._dispatching = False

    def drop_unwanted(self) -> None:
        """Forget the waiting requests that no longer want a unit (their queue closed)."""
        for h in list(self.ring):
            h.waiting = deque(item for item in h.waiting if self.wanted(item))
            if not h.waiting:
                h.in_ring = False
                self.ring.remove(h)
                self._may_go_idle(h)

    @property
    def waiting(self) -> int:
        return sum(len(h.waiting) for h in self.ring)

    def wanted(self, item: tuple) -> bool:
        """Whether a waiting request still wants its unit (else it is dropped)."""
        return True

    def _grant(self, h: HostShare, item: tuple) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class Lease:
    """One bounce buffer slot while a command holds it.  ``since`` is when its current wait
    on the host began: the RDMA READ of the host's data (from the grant), or the answer's
    RDMA WRITE and SEND (stamped by :meth:`on_wire` once the backend is done)."""

    __slots__ = ("pool", "index", "cmd", "owner", "since", "release")

    def __init__(self, pool: BouncePool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.cmd: Command | None = None
        self.owner: HostShare | None = None
        self.since = 0.0
        #: ``cmd.on_released``: bound once here, not per I/O
        self.release: Callable[[Command], None] = self._release

    def on_wire(self) -> None:
        self.since = monotonic()

    def waiting_on_host(self) -> bool:
        """Its command waits for the host (RDMA READ posted, or answer not yet acknowledged),
        not for the backend."""
        cmd = self.cmd
        return cmd is not None and (cmd.on_fetched is not None or cmd.responded)

    def _release(self, _cmd: Command) -> None:
        owner, self.owner, self.cmd = self.owner, None, None
        if owner is None:       # released already
            return
        pool = self.pool
        pool.buffers.put(self.index)
        pool.done(owner)


class BouncePool(FairShare):
    """The registered bounce buffers of one PD (file-backed I/O), shared fairly by hosts.

    A request is ``(cmd, length, use)``; a grant calls ``use(view, sge, lease)`` and the
    command gives the buffer back through ``lease.release`` (its ``on_released``), which the
    transport calls only once no work request references the buffer any more: after the
    answer's SEND completed, or after the queue's QP was destroyed."""

    def __init__(self, buffers: BufferPool, floor: int,
                 abort: Callable[[Command], None]) -> None:
        super().__init__(buffers.count, floor)
        self.buffers = buffers
        self.abort = abort
        self.leases = [Lease(self, i) for i in range(buffers.count)]

    def wanted(self, item: tuple) -> bool:
        cmd = item[0]
        if cmd.queue.closed:        # its host went away while it waited
            self.abort(cmd)
            return False
        return True

    def _grant(self, h: HostShare, item: tuple) -> None:
        cmd, length, use = item
        buffers = self.buffers
        index = buffers.get()
        assert index is not None        # granted only while a buffer is free
        lease = self.leases[index]
        lease.cmd = cmd
        lease.owner = h
        lease.since = monotonic()
        use(buffers.views[index], SGE(buffers.addrs[index], length, buffers.lkey), lease)

    def overdue(self, now: float, bound: float) -> list[Lease]:
        """Leases whose command has waited on its host for more than ``bound`` seconds."""
        return [x for x in self.leases
                if x.cmd is not None and now - x.since > bound and x.waiting_on_host()]

    def close(self) -> None:
        self.buffers.close()


class FairExecutor(FairShare):
    """The backend I/O threads, shared fairly by hosts: a host's blocking calls (file reads
    and writes, flushes, write zeroes, discards) wait in its own FIFO, so one host's burst
    of slow calls cannot queue every other host's behind it.  Idle threads are lent to a
    host over its share: a call ends by itself, and a host that wants its share back gets
    the next thread that frees."""

    LEND = True

    def __init__(self, reactor: Reactor, workers: int, floor: int = 1) -> None:
        super().__init__(workers, floor)
        self.reactor = reactor
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "backend-io")

    def submit(self, key: str, work: Callable[[], object],
               finish: Callable[[BaseException | None], None]) -> None:
        """Run ``work`` on a thread (when ``key``'s turn comes); ``finish(exc)`` runs back on
        the reactor."""
        self.request(key, (work, finish))

    def _grant(self, h: HostShare, item: tuple) -> None:
        work, finish = item
        call = self.reactor.call_soon_threadsafe

        def done(fut: concurrent.futures.Future) -> None:
            exc = fut.exception()
            call(lambda: self._finished(h, finish, exc))
        self.pool.submit(work).add_done_callback(done)

    def _finished(self, h: HostShare, finish: Callable[[BaseException | None], None],
                  exc: BaseException | None) -> None:
        try:
            finish(exc)
        finally:
            self.done(h)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    def describe(self) -> dict[str, Any]:
        return {"running": self.used, "waiting": self.waiting}

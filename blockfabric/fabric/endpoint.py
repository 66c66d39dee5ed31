"""One end of one NVMe-oF RDMA queue: an RC QP, its CQ, and its registered slots.

Both the target and the host keep, per queue, a set of posted receive slots (command
capsules at the target, response capsules at the host) and a set of send slots (the other
way round).  A work request's ``wr_id`` carries what it was for (its *kind*) and the slot
or command it belongs to, so a completion finds its owner without a lookup table.

The endpoint is driven from one reactor thread: :meth:`Endpoint.service` drains the CQ and
hands every completion to :meth:`Endpoint.on_completion`, which each side overrides.  What
goes wrong there (a CQ that fails to poll, a completion whose handling raises) breaks this
queue, through :meth:`Endpoint.on_fault`, and nothing else.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

from blockfabric.fabric.buffers import BufferPool
from blockfabric.fabric.reactor import Reactor
from blockfabric.rdma import CQ, PD, QP, WC, Access, CMId, QPCap, QPState, RecvWR, SendWR

_WR = TypeVar("_WR", RecvWR, SendWR)

log = logging.getLogger(__name__)

# wr_id = kind << 32 | index
KIND_RECV = 1      # a posted receive slot (index: the slot)
KIND_SEND = 2      # a capsule SEND (index: the send slot / command context)
KIND_READ = 3      # an RDMA READ of host data (index: the command context)
KIND_WRITE = 4     # an RDMA WRITE of data to the host (normally unsignaled)
KIND_SHIFT = 32
INDEX_MASK = (1 << KIND_SHIFT) - 1


def wr_id(kind: int, index: int) -> int:
    return kind << KIND_SHIFT | index


class Endpoint:
    """QP + CQ + receive slots + send slots of one queue.

    ``recv_now``: how many of the ``recv_count`` receive slots to register at once (all by
    default); :meth:`post_more_receives` adds the rest.  The target keeps a queue cheap
    until its peer has proved to be a host (a Fabrics Connect that succeeded)."""

    #: Completions one :meth:`service` call takes at most (0: drain the CQ).
    pass_limit = 0
    #: the provider calls :meth:`service` for every completion (Reactor.add_cq): no arming,
    #: and a batch smaller than asked for means the CQ is drained
    _attached = False
    #: a side that takes completions as (wr_id, status, byte_len) tuples in
    #: :meth:`handle_raw`: a CQ that can hand them out (the soft provider's, attached to
    #: the reactor) is asked to (no WC object per completion); others give WCs to handle
    raw_completions = False
    _raw = False

    def __init__(self, cmid: CMId, pd: PD, *, recv_count: int, recv_size: int,
                 send_count: int, send_size: int, max_send_wr: int,
                 max_send_sge: int = 4, name: str = "queue", recv_now: int | None = None
                 ) -> None:
        self.cmid = cmid
        self.name = name
        self.pd = pd
        self.closed = False
        self.recv_count = recv_count
        self.recv_size = recv_size
        self.cq: CQ = cmid.context.create_cq(max_send_wr + recv_count + 16)
        # released again should a later step fail (no fd leaks)
        made: list[CQ | BufferPool] = [self.cq]
        try:
            first = BufferPool(pd, recv_count if recv_now is None else recv_now, recv_size,
                               Access.LOCAL_WRITE)
            made.append(first)
            self.send_pool = BufferPool(pd, send_count, send_size, Access.LOCAL_WRITE)
            made.append(self.send_pool)
            self.qp: QP = cmid.create_qp(pd, self.cq, self.cq,
                                         QPCap(max_send_wr=max_send_wr, max_recv_wr=recv_count,
                                               max_send_sge=max_send_sge, max_recv_sge=1))
        except BaseException:
            for thing in reversed(made):
                thing.close()
            raise
        self.recv_pools = [first]
        #: the work requests posted again and again, whose resolved notes (the provider's
        #: views of the pools) go before the pools close: opt_in()
        self._noted: list[RecvWR | SendWR] = []
        #: the receive slots' buffers, by slot index (across every pool)
        self.recv_views: list[memoryview] = list(first.views)
        self._recv_wrs = [self.opt_in(RecvWR(wr_id(KIND_RECV, i), [first.sge(i)]))
                          for i in range(first.count)]
        self.reactor: Reactor | None = None
        self.on_cm_event: Callable[[], None] | None = None
        self._again = False

    # -- receive slots ---------------------------------------------------------------
    def post_all_receives(self) -> None:
        """Post every receive slot registered so far (before accepting or connecting, so
        no SEND meets RNR)."""
        self.qp.post_recv(self._recv_wrs)

    def post_more_receives(self) -> None:
        """Register and post the receive slots ``recv_now`` held back (once)."""
        more = self.recv_count - len(self._recv_wrs)
        if more <= 0 or self.closed:
            return
        pool = BufferPool(self.pd, more, self.recv_size, Access.LOCAL_WRITE)
        self.recv_pools.append(pool)
        base = len(self._recv_wrs)
        wrs = [self.opt_in(RecvWR(wr_id(KIND_RECV, base + i), [pool.sge(i)]))
               for i in range(more)]
        self.recv_views.extend(pool.views)
        self._recv_wrs.extend(wrs)
        self.qp.post_recv(wrs)

    def opt_in(self, wr: _WR) -> _WR:
        """``wr``, which this queue posts again and again as it is (only a SEND's length
        changes), opted in to the provider's note of what it resolved to (RecvWR.resolved,
        SendWR.resolved), dropped when the queue closes."""
        wr.resolved = False
        self._noted.append(wr)
        return wr

    def repost(self, index: int) -> None:
        if not self.closed:
            self.qp.post_recv(self._recv_wrs[index])

    # -- completions -----------------------------------------------------------------
    def attach(self, reactor: Reactor) -> None:
        """Have ``reactor`` service this endpoint's completions (and CM events, through
        ``on_cm_event`` when the side defines it) from now on."""
        def register() -> None:
            self._attached = reactor.add_cq(self.cq, self.service) is True
            if self._attached and self.raw_completions and hasattr(self.cq, "set_raw"):
                self.cq.set_raw()       # completions as (wr_id, status, byte_len) tuples
                self._raw = True
            if self.on_cm_event is not None:
                reactor.add_reader(self.cmid.fileno(), self.on_cm_event)
        self.arm()
        reactor.call_sync(register)
        self.reactor = reactor

    def _detach(self) -> None:
        reactor, self.reactor = self.reactor, None
        if reactor is None:
            return

        def unregister() -> None:
            self._attached = False
            reactor.remove_cq(self.cq, self.service)
            if self.on_cm_event is not None:
                reactor.remove_reader(self.cmid.fileno(), self.on_cm_event)
        try:
            reactor.call_sync(unregister)
        except TimeoutError as exc:
            log.warning("%s: %s", self.name, exc)

    def fileno(self) -> int:
        return self.cq.fileno()

    def arm(self) -> None:
        self.cq.req_notify()

    def service(self, budget: int = 64) -> int:
        """Drain the CQ (re-arming it race-free) and dispatch each completion; with a
        ``pass_limit``, take at most that many and come back in the reactor's next pass."""
        if self.closed:
            return 0
        done = 0
        limit = self.pass_limit
        cq = self.cq
        attached = self._attached
        try:
            if not attached:
                cq.ack_events()
            while not self.closed:
                if limit:
                    if done >= limit:
                        # The other queues of this reactor get their turn first (a host that
                        # keeps this CQ full cannot hold the loop); the CQ stays unarmed
                        # until then.
                        if self.reactor is not None and not self._again:
                            self._again = True
                            self.reactor.call_soon(self._service_again)
                        break
                    budget = min(budget, limit - done)
                wcs = cq.poll(budget)
                if not wcs:
                    if attached:
                        break
                    cq.req_notify()
                    wcs = cq.poll(budget)
                    if not wcs:
                        break
                done += self.handle_raw(wcs) if self._raw else self.handle(wcs)
                if attached and len(wcs) < budget:
                    break               # drained; what arrived since calls us again
        except Exception as exc:      # the CQ itself failed (ibv_poll_cq, the provider)
            self.on_fault(f"completion queue failed: {type(exc).__name__}: {exc}")
        return done

    def handle(self, wcs: list[WC]) -> int:
        """Hand each completion of a batch to :meth:`on_completion` (a side may override
        this to take a batch at once); returns how many it handled."""
        done = 0
        on_completion = self.on_completion
        for wc in wcs:
            if self.closed:
                break
            done += 1
            try:
                on_completion(wc)
            except Exception as exc:
                self.completion_failed(wc.wr_id, exc)
        return done

    def handle_raw(self, entries: list[Any]) -> int:  # pragma: no cover - see raw_completions
        """A batch of ``(wr_id, status, byte_len)`` completions (:attr:`raw_completions`):
        :class:`~blockfabric.rdma.base.RawWC` tuples, from a CQ whose ``poll`` is typed for
        WCs (a side's override takes ``list[RawWC]``)."""
        raise NotImplementedError

    def completion_failed(self, wr_id: int, exc: Exception) -> None:
        """A bug, or a completion that makes no sense: this queue's state can no longer be
        trusted, and only this queue's."""
        log.error("%s: completion %#x failed", self.name, wr_id, exc_info=exc)
        self.on_fault(f"completion {wr_id:#x} failed: {type(exc).__name__}: {exc}")

    def _service_again(self) -> None:
        self._again = False
        self.service()

    def on_completion(self, wc: WC) -> None:  # pragma: no cover - overridden by each side
        raise NotImplementedError

    def on_fault(self, reason: str) -> None:  # pragma: no cover - overridden by each side
        """This queue cannot go on (see :meth:`service`): tear it down."""
        raise NotImplementedError

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        self.qp.post_send(wrs)

    @property
    def broken(self) -> bool:
        return self.closed or self.qp.state == QPState.ERR

    def close(self) -> None:
        """Disconnect and release in order: QP (via the CM id), CQ, then the pools."""
        if self.closed:
            return
        self._detach()      # before any fd closes: a reused fd number must not be shadowed
        self.closed = True
        for wr in self._noted:
            wr.resolved = False     # the provider's views of the pools: gone before they close
        for step in (self.cmid.disconnect, self.cmid.close, self.cq.close,
                     *(pool.close for pool in self.recv_pools), self.send_pool.close):
            try:
                step()
            except Exception as exc:  # teardown goes on; a half-dead peer is normal here
                log.debug("%s: teardown step %s: %s", self.name, step.__name__, exc)

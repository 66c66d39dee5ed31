"""The controller registry: the target's controllers by cntlid and its open queue sessions,
cntlid allocation, tearing queues and controllers down (a lost queue, a hoarded buffer, a
reload that no longer allows them), each host's share of a reactor pass, and the discovery
log page.

Teardown of a queue happens here and only here (:meth:`ControllerRegistry.close_queue`):
what its commands still hold (bounce and control buffers, a namespace's in-flight count) is
let go once its QP is destroyed, never while a work request may still reference it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable

from blockfabric.protocol import StatusCode
from blockfabric.protocol import logpages
from blockfabric.protocol.errors import ProtocolError
from blockfabric.target import config as cfg
from blockfabric.target.broker import BufferBroker, abort_command
from blockfabric.target.controller import Controller
from blockfabric.target.namespace import Subsystem
from blockfabric.target.sessions import ADMIN_MAX_DEPTH, auth_policy, exposed, peer_of

if TYPE_CHECKING:
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.target.sessions import QueueSession

log = logging.getLogger(__name__)

#: Completions all the queues of one host take in one reactor pass (split evenly between
#: them, at least PASS_FLOOR each), so that a host with many queues cannot fill the pass.
HOST_PASS = 128
PASS_FLOOR = 16
MAX_CNTLID = 0xFFEF


def close_queue(queue: AnyTargetQueue) -> None:
    """Close a queue and let go of everything its commands still hold."""
    queue.close()
    # Answered commands whose response SEND will now never complete still hold a
    # bounce buffer or a namespace's memory: let go of them.
    for cmd in queue.commands:
        if cmd.responded and cmd.on_released is not None:
            release, cmd.on_released = cmd.on_released, None
            release(cmd)
    # Commands whose RDMA READ of the host's data will now never complete: undo
    # what they hold (in-flight counts, bounce or control buffers).
    for cmd in queue.commands:
        if cmd.on_fetched is not None:
            cmd.on_fetched = None
            abort_command(cmd)


class ControllerRegistry:
    """Controllers and queue sessions of one target.  ``cntlid_range()``: the controller ids
    this target may hand out (a gateway's range, else all)."""

    def __init__(self, broker: BufferBroker,
                 cntlid_range: Callable[[], tuple[int, int]]) -> None:
        self.broker = broker
        self.cntlid_range = cntlid_range
        self.controllers: dict[int, Controller] = {}
        self.sessions: set[QueueSession] = set()
        self._next_cntlid = 1
        self.hold_disconnects = 0               # controllers ended for holding a bounce buffer

    def alloc_cntlid(self) -> int:
        lo, hi = self.cntlid_range()
        for _ in range(hi - lo + 1):
            cntlid = self._next_cntlid if lo <= self._next_cntlid <= hi else lo
            self._next_cntlid = cntlid + 1 if cntlid < hi else lo
            if cntlid not in self.controllers:
                return cntlid
        raise ProtocolError("no controller id free", StatusCode.CONNECT_CTRL_BUSY)

    def share_passes(self, hostnqn: str) -> None:
        """Split HOST_PASS between the queues of ``hostnqn`` (on a Connect or a loss; the
        per-completion path only reads the result)."""
        queues = [q for c in self.controllers.values() if c.hostnqn == hostnqn
                  for q in c.queues.values()]
        for q in queues:
            q.pass_limit = max(PASS_FLOOR, HOST_PASS // len(queues))

    # -- queues ----------------------------------------------------------------------------
    def queue_broken(self, session: QueueSession, queue: AnyTargetQueue, reason: str) -> None:
        """A queue died (peer gone, RDMA error): release it; the admin queue takes its
        controller with it."""
        if queue.closed:
            return
        ctrl = session.controller
        level = logging.INFO if "disconnect" in reason or "flushed" in reason \
            else logging.WARNING
        log.log(level, "%s qid=%d: %s", ctrl.name if ctrl else queue.name, queue.qid, reason)
        self.close_queue(session)
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            ctrl.auth.pop(queue.qid, None)
            ctrl.state = ctrl.state.disconnect(queue.qid)
            if queue.qid == 0:
                self.destroy_controller(ctrl, f"admin queue lost: {reason}")
            else:
                self.share_passes(ctrl.hostnqn)

    def end_queue(self, queue: AnyTargetQueue, reason: str) -> None:
        """Disconnect one queue of a controller (as if its host had gone)."""
        for session in self.sessions:
            if session.queue is queue:
                self.queue_broken(session, queue, reason)
                return

    def close_queue(self, session: QueueSession) -> None:
        """Close a session's queue and let go of everything its commands still hold."""
        queue = session.queue
        self.sessions.discard(session)
        if session.connect_timer is not None:
            session.connect_timer.cancel()
            session.connect_timer = None
        if queue is not None and not queue.closed:
            close_queue(queue)
            # Commands still waiting for a bounce buffer will never need it.
            self.broker.drop_unwanted_waiters()

    def hoarding(self, queue: AnyTargetQueue, held: float, bound: float) -> None:
        """A queue's host kept a bounce buffer waiting on it (an RDMA READ it does not
        answer, an answer it does not acknowledge) past the bound: disconnect it and tear
        its controller down.  The buffers come back as the queue closes, after its QP is
        destroyed, never while a work request may still reference them."""
        session: QueueSession = queue.handler  # type: ignore[assignment]  # (the target's)
        ctrl = session.controller
        self.hold_expired(ctrl, queue.qid, peer_of(queue), held, bound)
        self.close_queue(session)
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            self.destroy_controller(ctrl, f"qid {queue.qid} over limits.buffer_hold_timeout")

    def hold_expired(self, ctrl: Controller | None, qid: int, peer: str, held: float,
                     bound: float, where: str = "") -> None:
        """Count and log a controller ended for holding a bounce buffer (here, or in the
        poll group ``where`` names)."""
        self.hold_disconnects += 1
        log.warning("ctrl %s hostnqn=%r qid=%d peer=%r: held a bounce buffer for %.1f s "
                    "(limits.buffer_hold_timeout is %g s%s): disconnecting it",
                    ctrl.cntlid if ctrl else "-", ctrl.hostnqn if ctrl else None, qid,
                    peer, held, bound, where)

    # -- controllers -------------------------------------------------------------------------
    def destroy_controller(self, ctrl: Controller, reason: str) -> None:
        if ctrl.dead:
            return
        ctrl.dead = True
        if ctrl.kato_timer is not None:
            ctrl.kato_timer.cancel()
        for timer in ctrl.auth_timers.values():
            timer.cancel()
        self.controllers.pop(ctrl.cntlid, None)
        for session in [s for s in self.sessions if s.controller is ctrl]:
            self.close_queue(session)
        ctrl.queues.clear()
        self.share_passes(ctrl.hostnqn)
        log.info("%s: destroyed (%s)", ctrl.name, reason)

    def destroy_where(self, condition: Callable[[Controller], bool], reason: str) -> None:
        for ctrl in [c for c in self.controllers.values() if condition(c)]:
            self.destroy_controller(ctrl, reason)

    def close(self) -> None:
        """Every controller destroyed, every queue closed (the target is stopping)."""
        for ctrl in list(self.controllers.values()):
            self.destroy_controller(ctrl, "target stopping")
        for session in list(self.sessions):
            self.close_queue(session)


def may_stay(ctrl: Controller, config: cfg.TargetConfig,
             subsystems: dict[str, Subsystem]) -> bool:
    """After a reload: still allowed, still exposed, and authenticated with what the
    configuration now says (a changed or revoked secret disconnects the host)."""
    sub: Subsystem = ctrl.subsystem  # type: ignore[assignment]  # (asked of I/O controllers)
    return (subsystems.get(sub.nqn) is sub and sub.allows(ctrl.hostnqn)
            and exposed(config, sub, ctrl.listener)
            and ctrl.auth_policy == auth_policy(sub.conf, ctrl.hostnqn))


def discovery_log(ctrl: Controller, config: cfg.TargetConfig,
                  subsystems: Iterable[Subsystem],
                  listeners: Iterable[tuple[cfg.Listener, str, object]],
                  genctr: int) -> bytes:
    """The discovery log page for this host: subsystems it may use, once per transport
    and address: every NVMe/TCP listener, and the RDMA listeners of the provider it came
    in on (any, when it came in over TCP)."""
    listeners = list(listeners)
    entries = []
    for sub in subsystems:
        if not sub.allows(ctrl.hostnqn):
            continue
        for lconf, provider, _listener in listeners:
            tcp = lconf.transport == "tcp"
            if lconf not in config.listeners_for(sub.conf) or not (
                    tcp or ctrl.provider in (provider, "tcp")):
                continue
            entries.append(logpages.DiscoveryLogEntry(
                trtype=logpages.TransportType.TCP if tcp else logpages.TransportType.RDMA,
                adrfam=logpages.AddressFamily.IPV6 if ":" in lconf.address
                else logpages.AddressFamily.IPV4,
                # TCP: no secure channel (TREQ 1:0 = 0, so no host asks for TLS), SQ flow
                # control may be disabled (bit 2, as nvmet: reads then skip CapsuleResp)
                subtype=logpages.SubsystemType.NVM, treq=logpages.TREQ_SQFLOW_DISABLE if tcp else 0,
                portid=config.listeners.index(lconf) + 1,
                cntlid=0xFFFF, asqsz=ADMIN_MAX_DEPTH,
                trsvcid=str(lconf.port), subnqn=sub.nqn, traddr=lconf.address,
                tsas=logpages.TCP_TSAS if tcp else logpages.RdmaTsas()))
    return bytes(logpages.pack_discovery_log(genctr, entries))

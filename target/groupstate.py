"""What poll groups share besides queues and reservations (see docs/scaling.md): RBD volumes
(which subsystems keep their I/O queues in the coordinator, a volume a worker lost, an image's
new size), a gateway's ANA state, a hoarder in a worker, and the activity of a worker's
queues for keep-alive.

Coordinator side: :func:`install` (at PollGroups' start), :func:`init_extra` (what a worker
gets with its configuration), :func:`handle` (a worker's messages of these kinds),
:func:`served_remotely` (a controller with a queue in a worker), :func:`take_activity`.
Worker side: :func:`apply_extra`, :func:`worker_message`, :func:`hoarding`,
:func:`volume_lost`, :func:`activity`.

Kept apart from target.pollgroups and target.worker (the channel and the queues' hand-over)
so that each concern is a few lines there.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.target.backends import Unavailable
from blockfabric.target.sessions import peer_of

if TYPE_CHECKING:
    from blockfabric.target.controller import Controller
    from blockfabric.target.namespace import Namespace
    from blockfabric.target.pollgroups import Group, PollGroups
    from blockfabric.target.server import Target
    from blockfabric.target.worker import Worker

log = logging.getLogger("blockfabric.target.pollgroups")

#: How late a worker's report of a queue's activity may reach the coordinator: its stats
#: go every STATS_INTERVAL (0.5 s), and one may be late behind a busy pass.  A controller
#: served in a worker gets this much more before its keep-alive expires.
ACTIVITY_LAG = 1.0


# -- coordinator side -----------------------------------------------------------------------
def local_subsystems(target: Target) -> dict[str, str]:
    """The subsystems whose I/O queues stay in the coordinator, and why: those with an RBD
    image that has the exclusive-lock feature.  librbd's lock is per client, and every
    worker would be a client of its own: each write from another process than the lock's
    holder asks for the lock, and the holder hands it over, so the lock would pass back and
    forth between the groups on every write.  One client (the coordinator) keeps it."""
    out = {}
    for sub in target.subsystems.values():
        for ns in sub.namespaces.values():
            if getattr(ns.backend, "exclusive_lock", False):
                name = ns.conf.rbd_image
                out[sub.nqn] = (f"rbd image {name} (nsid {ns.nsid}) has the exclusive-lock "
                                "feature, which one client holds at a time; to spread its "
                                f"queues: rbd feature disable {name} fast-diff object-map "
                                "exclusive-lock")
                break
    return out


def install(groups: PollGroups) -> None:
    """At start: say which subsystems stay in the coordinator, and have every change of
    ANA state and every RBD image's new size reach the workers."""
    t = groups.target
    for nqn, why in groups.local.items():
        log.warning("poll groups: subsystem %s keeps its I/O queues in the coordinator: %s",
                    nqn, why)
    if t.ana is not None:
        t.ana.on_refresh = lambda: push_ana(groups)
    resize = t.volumes.resize

    def resized(sub: Any, ns: Namespace, conf: Any) -> None:
        resize(sub, ns, conf)
        for g in groups.groups:
            g.send(("resize", sub.nqn, ns.nsid, conf.size))
    t.volumes.resize = resized


def ana_states(target: Target) -> dict[tuple[str, int], tuple[int, int]]:
    """Every namespace's ANA group and path status (0: this path serves I/O)."""
    return {(sub.nqn, ns.nsid): (ns.ana_group, ns.ana_status)
            for sub in target.subsystems.values() for ns in sub.namespaces.values()}


def push_ana(groups: PollGroups) -> None:
    """The coordinator's ANA state changed (a group taken or given up, a lease that ran
    out, a reload): every worker answers I/O with the new status from its next command."""
    states = ana_states(groups.target)
    for g in groups.groups:
        g.send(("ana", states))


def init_extra(groups: PollGroups) -> dict[str, Any]:
    """What a worker needs besides its configuration before it opens its volumes."""
    return {"local": sorted(groups.local), "ana": ana_states(groups.target)}


def served_remotely(ctrl: Controller) -> None:
    """``ctrl`` has a queue in a worker: its keep-alive allows for the workers' reports."""
    ctrl.activity_lag = ACTIVITY_LAG


def refresh_activity(groups: PollGroups, ctrl: Controller, then: Callable[[], None]) -> None:
    """Before ``ctrl``'s keep-alive ends it: each group serving one of its queues sends its
    stats now (take_activity), then acknowledges; ``then()`` once all did, or after a KATO
    (a group that cannot answer in that time does not keep the controller alive)."""
    live = [g for g in groups.groups
            if g.alive and any(cntlid == ctrl.cntlid for cntlid, _qid in g.queues)]
    if not live:
        then()
        return
    req = groups._next_req
    groups._next_req += 1
    waiting = {g.index for g in live}
    entry: list[Any] = [waiting, then, None]
    groups._acks[req] = entry
    for g in live:
        if not g.send(("activity?", req)):
            waiting.discard(g.index)

    def late() -> None:
        if groups._acks.pop(req, None) is not None:
            then()
    entry[2] = groups.target.reactor.call_later(max(ctrl.kato_ms / 1000, 1.0), late)
    if not waiting:
        groups._acked(req)


def take_activity(groups: PollGroups, stats: dict) -> None:
    """A worker's stats: the last command time of each controller it serves (monotonic,
    the same clock in every process) counts as activity for its keep-alive."""
    controllers = groups.target.registry.controllers
    for cntlid, when in stats.get("active", {}).items():
        ctrl = controllers.get(cntlid)
        if ctrl is not None and when > ctrl.last_activity:
            ctrl.last_activity = when


def handle(groups: PollGroups, g: Group, msg: tuple) -> None:
    """A worker's message of the kinds here."""
    kind = msg[0]
    if kind == "hoarding":
        _, cntlid, qid, held, bound = msg
        registry = groups.target.registry
        ctrl = registry.controllers.get(cntlid)
        if ctrl is None or ctrl.dead:       # ended already (its other queues' groups)
            return
        remote: Any = g.queues.get((cntlid, qid))     # its cmid has the peer's address
        registry.hold_expired(ctrl, qid, peer_of(remote), held, bound, f", poll group {g.index}")
        registry.destroy_controller(ctrl, f"qid {qid} over limits.buffer_hold_timeout")
    elif kind == "volume_lost":
        _, nqn, nsid, err, text = msg
        ns = groups._namespace(nqn, nsid)
        if ns is not None:
            groups.target.volumes.lost([ns], Unavailable(err, f"poll group {g.index}: {text}"))


# -- worker side -------------------------------------------------------------------------------
def apply_extra(worker: Worker, extra: dict[str, Any]) -> None:
    set_ana(worker, extra.get("ana", {}))


def set_ana(worker: Worker, states: dict[tuple[str, int], tuple[int, int]]) -> None:
    for (nqn, nsid), (group, status) in states.items():
        sub = worker.subsystems.get(nqn)
        ns = sub.namespaces.get(nsid) if sub is not None else None
        if ns is not None:
            ns.ana_group, ns.ana_status = group, status


def worker_message(worker: Worker, msg: tuple) -> None:
    """A coordinator's message of the kinds here."""
    kind = msg[0]
    if kind == "activity?":             # refresh_activity: the stats now, then the answer
        worker.send_stats()
        worker.send(("ack", msg[1]))
    elif kind == "ana":
        set_ana(worker, msg[1])
    elif kind == "resize":
        _, nqn, nsid, size = msg
        sub = worker.subsystems.get(nqn)
        ns = sub.namespaces.get(nsid) if sub is not None else None
        if ns is None or ns.size == size:
            return
        try:
            ns.resize(dataclasses.replace(ns.conf, size=size))
        except (OSError, BufferError) as exc:
            log.error("group %d: resize of %s nsid %d to %d bytes: %s", worker.index, nqn,
                      nsid, size, exc)


def hoarding(worker: Worker, cntlid: int, qid: int, held: float, bound: float) -> None:
    """A queue here held a bounce buffer past limits.buffer_hold_timeout: the coordinator
    counts it, logs it once and ends the controller (every group's queues of it)."""
    log.debug("group %d ctrl %d qid=%d: over limits.buffer_hold_timeout", worker.index,
              cntlid, qid)
    worker.send(("hoarding", cntlid, qid, held, bound))


def volume_lost(worker: Worker, nss: list[Namespace], exc: BaseException) -> None:
    """A command here found its volume gone (the cluster did not answer): the coordinator
    marks it unavailable, ends its subsystem's controllers and probes it (VolumeWatch).
    The subsystem's queues here end at once, before the command is answered, as the
    coordinator's own do: the host then re-issues its commands after it reconnects
    (Controller Busy until the volume answers) instead of getting them failed."""
    for nqn, sub in worker.subsystems.items():
        lost = [ns for ns in nss if sub.namespaces.get(ns.nsid) is ns]
        for ns in lost:
            worker.send(("volume_lost", nqn, ns.nsid,
                         getattr(exc, "errno", None) or errno.EIO, str(exc)))
        if lost:
            for session in list(worker.sessions.values()):
                if session.ctrl.subsystem is sub:
                    worker.queue_lost(session, f"namespace {lost[0].nsid} unavailable", True)


def activity(worker: Worker) -> dict[int, float]:
    """Each controller's last command here (for its keep-alive in the coordinator)."""
    return {c: ctrl.last_activity for c, ctrl in worker.controllers.items()}

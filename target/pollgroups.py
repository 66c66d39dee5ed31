"""Poll groups: the coordinator's side of ``reactors: N`` (see docs/scaling.md).

Group 0 is the coordinator itself (the main process: listeners, admin and discovery queues,
keep-alive, AENs, reload, drain, the control socket, the controller registry, reservations;
and the I/O queues it keeps).  Groups 1..N-1 are worker processes (target.worker), each with
its own reactor, protection domain, registered memory and backend threads.

An NVMe/TCP I/O queue goes to the least-loaded group (fewest I/O queues) at its Connect:
the coordinator has done the ICReq/ICResp and read the Connect, checked it against the
controller registry (the controller exists, is this host's, is enabled; the host needs no
DH-HMAC-CHAP on its queues: those stay here), then passes the socket (SCM_RIGHTS) with the
connection's state and the bytes read past the Connect; the worker answers the Connect and
serves the queue.  An RDMA I/O queue goes earlier, at its CM request (whose private data
names the qid): the worker accepts it (soft: with the socket; verbs: its own QP, while the
rdma_cm id stays here), and sends its Connect back here to be checked.
Here the queue is a :class:`RemoteQueue`: the controller's registry entry (limits, status,
teardown), never on the I/O path.

Longer than ~500 lines because it is one protocol, both ends of which must change together:
the hand-over of three kinds of queue (an NVMe/TCP socket, a soft-RDMA socket, a verbs QP
whose rdma_cm id stays in the coordinator) and every message of the channel; what the
groups share besides queues and reservations is in target.groupstate.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.errors import ConnectionAbandoned, RdmaError
from blockfabric.fabric.handoff import Channel, ChannelClosed
from blockfabric.fabric.tcp_target import PeerInfo, TcpTargetQueue
from blockfabric.target import groupstate
from blockfabric.rdma.base import CMEventType
from blockfabric.target import reservations
from blockfabric.target import resvctl
from blockfabric.target import status
from blockfabric.target.backends import RamdiskBackend
from blockfabric.target.metrics import IoStats

if TYPE_CHECKING:
    from blockfabric.target.controller import Controller
    from blockfabric.target.namespace import Namespace
    from blockfabric.target.server import QueueSession, Target

#: How a worker learns the coordinator's NUMA placement (JSON), to take its share of it.
PLACEMENT_ENV = "BLOCKFABRIC_WORKER_PLACEMENT"
log = logging.getLogger(__name__)

#: How long a reservation change waits for the groups' acknowledgements.
ACK_TIMEOUT = 10.0


def prepare(reactors: int) -> None:
    """Before any namespace opens: with poll groups, ramdisks live in shared memory."""
    RamdiskBackend.shared = reactors > 1


class RemoteQueue:
    """An I/O queue served by a worker, as the coordinator's registry holds it."""

    pass_limit = 64
    outstanding = 0
    commands: list = []

    def __init__(self, group: Group, cntlid: int, qid: int, depth: int, peer: tuple,
                 name: str, hid: int = 0) -> None:
        self.group = group
        self.cntlid, self.qid, self.depth = cntlid, qid, depth
        self.cmid = PeerInfo(peer)
        self.name = name
        self.closed = False
        #: a soft-RDMA queue handed over at its CM request: its hand-over id (its Connect
        #: is still to come while ``cntlid`` is 0)
        self.hid = hid
        #: the worker ended the queue itself (and said so): closing it here is only the
        #: registry's part, nothing to send back
        self.gone = False

    def controller_ready(self, ready: bool) -> None:
        """Its controller was enabled (CC.EN with CSTS.RDY) or reset, shut down or failed:
        the worker's I/O on it runs, or is refused, as the controller's would be."""
        if not self.closed and self.cntlid:
            self.group.send(("ready", self.cntlid, ready))

    def close(self) -> None:
        """End the queue (its controller is destroyed, the host is disconnected)."""
        if self.closed:
            return
        self.closed = True
        if self.gone:
            return
        if not self.cntlid:
            self.group.pending.pop(self.hid, None)
            self.group.send(("close_pending", self.hid))
            return
        self.group.queues.pop((self.cntlid, self.qid), None)
        self.group.send(("close", self.cntlid, self.qid))


class Group:
    """One worker process, as the coordinator sees it."""

    def __init__(self, groups: PollGroups, index: int) -> None:
        self.groups = groups
        self.index = index
        self.queues: dict[tuple[int, int], RemoteQueue] = {}
        #: soft-RDMA queues handed over before their Connect: hand-over id -> session
        self.pending: dict[int, Any] = {}
        #: verbs queues served here: hand-over id -> the rdma_cm id (it stays in the
        #: coordinator; the worker has the QP)
        self.cmids: dict[int, Any] = {}
        self.stats: dict[str, Any] = {}
        #: the counters of this group's earlier processes (a worker that died and came
        #: back), per namespace, and their CPU time
        self.history: dict[tuple[str, int], IoStats] = {}
        self.history_cpu = 0.0
        self.ready = False
        #: pyverbs imported and the devices open there (verbs queues go only to such)
        self.verbs_ready = False
        self.drained = False
        self.alive = False
        self.proc: subprocess.Popen | None = None
        self.chan: Channel | None = None
        self.pid = 0

    def start(self, config: Any, memfds: dict, states: dict, placement: Any = None,
              count: int = 1, extra: dict | None = None) -> None:
        chan, theirs = Channel.pair()
        fds = [theirs.fileno(), *memfds.values()]
        try:
            level = logging.getLogger("blockfabric").getEffectiveLevel()
            env = dict(os.environ, BLOCKFABRIC_WORKER_LOG=logging.getLevelName(level))
            if placement is not None and placement.placed:
                # the coordinator's placement, for this worker's share of it (worker.py)
                env[PLACEMENT_ENV] = json.dumps(
                    {"cpus": sorted(placement.cpus) if placement.cpus is not None else None,
                     "node": placement.node, "policy": placement.policy,
                     "reason": placement.reason, "count": count})
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "blockfabric.target.worker", str(theirs.fileno()),
                 str(self.index)], pass_fds=fds, close_fds=True, env=env)
        finally:
            theirs.close()
        self.chan = chan
        self.pid = self.proc.pid
        self.alive = True
        self.ready = self.verbs_ready = False
        chan.send(("init", config, memfds, states, extra or {}))

    def send(self, msg: tuple, fds: tuple[int, ...] = ()) -> bool:
        if not self.alive or self.chan is None:
            return False
        try:
            self.chan.send(msg, fds)
            return True
        except ChannelClosed:
            return False

    @property
    def load(self) -> int:
        return len(self.queues) + len(self.pending)


class PollGroups:
    """The coordinator's poll groups (``reactors`` - 1 workers, and itself as group 0)."""

    def __init__(self, target: Target, count: int) -> None:
        self.target = target
        self.count = count
        self.groups = [Group(self, i) for i in range(1, count)]
        self._acks: dict[int, list] = {}
        self._next_req = 1
        self.started = False
        self.respawn = True
        #: subsystems whose I/O queues stay here, and why (groupstate.local_subsystems)
        self.local = groupstate.local_subsystems(target)

    # -- lifecycle ----------------------------------------------------------------------
    def _memfds(self) -> dict[tuple[str, int], int]:
        return {(sub.nqn, ns.nsid): ns.backend.memfd  # type: ignore[attr-defined]  # (below)
                for sub in self.target.subsystems.values() for ns in sub.namespaces.values()
                if getattr(ns.backend, "memfd", None) is not None}

    def _states(self) -> dict[tuple[str, int], reservations.State | None]:
        return {(sub.nqn, ns.nsid): ns.resv_state
                for sub in self.target.subsystems.values() for ns in sub.namespaces.values()}

    def start(self) -> None:
        """Start every worker and wait until each has opened its volumes."""
        groupstate.install(self)
        timeout = self.target.config.limits.worker_start_timeout
        for g in self.groups:
            try:
                self._spawn(g)
            except (OSError, ChannelClosed) as exc:     # it ended before taking its config
                g.alive = False
                raise OSError(f"poll group {g.index} did not start: {self._why(g, timeout)}"
                              f" ({exc}; see its log lines)") from exc
        deadline = time.monotonic() + timeout
        for g in self.groups:
            while not g.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not g.alive:
                    raise OSError(f"poll group {g.index} did not start: {self._why(g, timeout)}"
                                  " (see its log lines)")
                try:    # (spawned: a channel)
                    got = (g.chan.recv(block=True)  # type: ignore[union-attr]
                           if _readable(g.chan, left) else None)  # type: ignore[arg-type]
                except (OSError, ChannelClosed):
                    g.alive, got = False, None
                if got is not None:
                    self._handle(g, *got)
        for g in self.groups:       # (spawned: a channel; the lambdas bind their group)
            g.chan.serve(self.target.reactor,  # type: ignore[union-attr]
                         lambda m, f, g=g: self._handle(g, m, f),  # type: ignore[misc]
                         lambda reason, g=g: self._lost(g, reason))  # type: ignore[misc]
        self.started = True
        log.info("poll groups: %d (the coordinator and %d worker%s: pids %s)", self.count,
                 len(self.groups), "" if len(self.groups) == 1 else "s",
                 ", ".join(str(g.pid) for g in self.groups))

    @staticmethod
    def _why(g: Group, timeout: int) -> str:
        code = None
        if g.proc is not None:
            try:
                code = g.proc.wait(0 if g.alive else 2)   # a closed channel: it is ending
            except subprocess.TimeoutExpired:
                code = None
        if code is not None:
            return f"its process (pid {g.pid}) exited with status {code}"
        if not g.alive:
            return "its control channel closed"
        return (f"not ready within {timeout} s (limits.worker_start_timeout; pid {g.pid} "
                "is still starting)")

    def _spawn(self, g: Group) -> None:
        g.start(self.target.config, self._memfds(), self._states(),
                getattr(self.target, "placement", None), self.count,
                groupstate.init_extra(self))

    def close(self) -> None:
        self.respawn = False
        for g in self.groups:
            g.send(("stop",))
        for g in self.groups:
            g.alive = False
            if g.proc is not None:
                try:
                    g.proc.wait(5)
                except subprocess.TimeoutExpired:
                    g.proc.kill()
                    g.proc.wait()
            if g.chan is not None:
                g.chan.close(self.target.reactor if self.started else None)
            for hid in list(g.cmids):
                self._verbs_close(g, hid)

    # -- where a queue goes ---------------------------------------------------------------
    def _own_load(self, placing: Any = None) -> int:
        """The I/O queues the coordinator serves (but ``placing``, the one being placed)."""
        return sum(1 for s in self.target.registry.sessions
                   if s.qid and s.controller is not None and s is not placing
                   and not isinstance(s.queue, RemoteQueue))

    def pick(self, placing: Any = None, verbs: bool = False) -> Group | None:
        """The least-loaded group (None: the coordinator's own, group 0); on a tie a
        worker, whose reactor has nothing else to do (the coordinator's also runs every
        admin queue, keep-alive and the control socket).  ``verbs``: among the workers
        that have their RDMA devices open."""
        live = [g for g in self.groups if g.alive and g.ready and (g.verbs_ready or not verbs)]
        best = min(live, key=lambda g: g.load, default=None)
        if best is None or self._own_load(placing) < best.load:
            return None
        return best

    def handoff(self, session: QueueSession, cmd: Any, ctrl: Controller, result: int) -> bool:
        """At an I/O queue's Connect (checked, the controller's registry updated): pass the
        queue to the least-loaded group; False when it stays here (group 0, an RDMA queue, a
        host that authenticates its queues)."""
        queue = session.queue
        if not isinstance(queue, TcpTargetQueue) or not session.qid \
                or ctrl.auth_policy is not None or self.target.draining \
                or ctrl.subnqn in self.local:
            return False
        group = self.pick(session)
        if group is None:
            return False
        queue._paused = True            # nothing more is read here
        release, cmd.on_released = cmd.on_released, None
        if release is not None:
            release(cmd)
        # After this pass (the Connect was decoded inside the queue's read): what it read
        # past the Connect is in its staging buffer then.
        self.target.reactor.call_soon(lambda: self._pass(session, queue, cmd.cid, ctrl,
                                                         group, result))
        return True

    def _pass(self, session: QueueSession, queue: TcpTargetQueue, cid: int, ctrl: Controller,
              group: Group, result: int) -> None:
        t = self.target
        if queue.closed or ctrl.dead or session not in t.registry.sessions:
            return
        if queue._out:          # cannot happen before the Connect's answer; be safe
            t.registry.queue_broken(session, queue, "unsent data at the hand-over")
            return
        peer = queue.cmid.peer_address
        meta = {"cntlid": ctrl.cntlid, "qid": session.qid, "depth": queue.depth,
                "subnqn": ctrl.subnqn, "hostnqn": ctrl.hostnqn, "hostid": ctrl.hostid,
                "peer": f"{peer[0]}:{peer[1]}", "group": group.index, "cid": cid,
                "result": result, "inline_size": queue.inline_size, "cpda": queue.cpda,
                "hdgst": queue.hdgst, "ddgst": queue.ddgst, "tx_align": queue.tx_align,
                "limits": queue.limits, "r2t_max": queue.r2t_max,
                "max_unsent": queue.max_unsent, "sq_flow": queue.sq_flow,
                "sqhd": queue.sqhd, "rest": bytes(queue._staging[:queue._filled])}
        fd = queue.sock.fileno()
        remote = RemoteQueue(group, ctrl.cntlid, session.qid, queue.depth, peer,
                             f"{queue.name} g{group.index}")
        # Out of this reactor (its reader and its busy-poll, which would otherwise count
        # the Connect's slot as in flight here for good), then over: the socket is the
        # worker's from here.
        queue.release_reactor()
        if not group.send(("queue", meta), (fd,)):
            queue.reactor = t.reactor
            t.registry.queue_broken(session, queue, f"poll group {group.index} is gone")
            return
        queue.closed = True
        queue.sock.close()          # this process's copy: the connection lives on there
        # (from here the worker's queue: a RemoteQueue stands in for it, in the session and
        # the controller the coordinator keeps)
        session.queue = remote  # type: ignore[assignment]
        group.queues[ctrl.cntlid, session.qid] = remote
        groupstate.served_remotely(ctrl)
        if ctrl.queues.get(session.qid) is queue:
            ctrl.queues[session.qid] = remote  # type: ignore[assignment]
        log.debug("%s qid=%d: to poll group %d", ctrl.name, session.qid, group.index)

    def handoff_rdma(self, lconf: Any, provider: str, cmid: Any, req: Any) -> bool:
        """An RDMA connection request for an I/O queue (its private data names the qid;
        the limits were checked): to the least-loaded group before the CM accept.  Soft
        provider: the connection's socket and the request's private data.  Verbs: the
        rdma_cm id stays here (it cannot move), the worker gets the QP attributes of INIT,
        RTR and RTS (rdma_init_qp_attr) and creates the QP, and this process accepts with
        its qp_num (:meth:`_verbs`, blockfabric.rdma.verbs.remote).  Either way the
        Connect that follows comes back here to be checked (:meth:`_connect`).  False: it
        stays here (the admin queue, group 0, a listener whose hosts authenticate, a
        subsystem kept local)."""
        if not req.qid or self.target.draining or _authenticates(self.target.config, lconf) \
                or any(s.nqn in self.local for s in self.target.config.subsystems
                       if lconf in self.target.config.listeners_for(s)):
            return False
        sock = getattr(cmid, "_sock", None) if provider == "soft" else None
        if sock is None and not (provider == "verbs" and hasattr(cmid, "remote_qp_attrs")):
            return False
        group = self.pick(verbs=sock is None)
        if group is None:
            return False
        t = self.target
        limits = t.config.limits
        depth = req.hsqsize + 1
        self._next_req += 1
        hid = self._next_req
        peer = cmid.peer_address
        meta = {"hid": hid, "qid": req.qid, "depth": depth,
                "inline_size": limits.inline_data_size,
                "max_unsent": limits.unsent_limit(depth, limits.inline_data_size),
                "private_data": bytes(cmid.private_data), "peer": f"{peer[0]}:{peer[1]}"}
        if sock is None:
            meta.update(attrs=cmid.remote_qp_attrs(), device=cmid.context.name,
                        peer_addr=tuple(peer), local_addr=tuple(cmid.local_address))
            if not group.send(("verbs_queue", meta)):
                return False
            group.cmids[hid] = cmid
            t.reactor.add_reader(cmid.fileno(), lambda: self._verbs_events(group, hid))
        else:
            if not group.send(("rdma_queue", meta), (sock.fileno(),)):
                return False
            cmid._sock = None
            sock.close()                # this process's copy: the connection lives on there
            cmid.close()
        session = t._new_session(lconf, provider, req)
        session.queue = RemoteQueue(  # type: ignore[assignment]  # (as in handoff)
            group, 0, req.qid, depth, peer,
                                    f"{peer[0]} q{req.qid} g{group.index}", hid)
        group.pending[hid] = session
        t.registry.sessions.add(session)
        timeout = limits.connect_timeout
        session.connect_timer = t.reactor.call_later(
            timeout, lambda: t.listening._connect_timed_out(session, timeout))
        log.debug("%s qid %d depth %d: to poll group %d", peer, req.qid, depth, group.index)
        return True

    def _connect(self, g: Group, hid: int, connect: Any, data: bytes) -> None:
        """A handed-over queue's Fabrics Connect, decoded and bounded by its worker: checked
        against the registry as any queue's; the worker answers it with the verdict."""
        from blockfabric.protocol.errors import ProtocolError  # noqa: PLC0415
        from blockfabric.protocol.fabrics import ConnectData  # noqa: PLC0415
        session = g.pending.get(hid)
        if session is None:
            g.send(("connected", hid, False, (0x6, True, 0)))      # internal error
            return
        t = self.target
        remote = session.queue
        try:
            ctrl = t.connector.connect(session, connect, ConnectData.unpack_from(memoryview(data)))
        except ProtocolError as exc:
            log.info("connect refused: qid=%d peer=%s (poll group %d): %s (status %#x)",
                     session.qid, "%s:%s" % tuple(remote.cmid.peer_address[:2]), g.index,
                     exc, exc.status)
            g.send(("connected", hid, False, (exc.status, exc.dnr, exc.result or 0)))
            return
        del g.pending[hid]
        session.controller = ctrl
        ctrl.last_activity = time.monotonic()      # a command of the host, as any
        if session.connect_timer is not None:
            session.connect_timer.cancel()
            session.connect_timer = None
        remote.cntlid = ctrl.cntlid
        g.queues[ctrl.cntlid, session.qid] = remote
        groupstate.served_remotely(ctrl)
        peer = remote.cmid.peer_address
        from blockfabric.protocol.auth import CONNECT_AUTHREQ_ATR  # noqa: PLC0415
        g.send(("connected", hid, True, {
            "cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "hostid": ctrl.hostid,
            "subnqn": ctrl.subnqn, "peer": f"{peer[0]}:{peer[1]}", "group": g.index,
            "depth": remote.depth, "auth_policy": ctrl.auth_policy,
            "result": ctrl.cntlid | (CONNECT_AUTHREQ_ATR if ctrl.auth_policy else 0)}))
        log.debug("%s qid=%d: connected in poll group %d", ctrl.name, session.qid, g.index)

    def _pending_lost(self, g: Group, hid: int, reason: str) -> None:
        """A handed-over queue ended before its worker heard the Connect's verdict.  The
        worker may have sent the Connect just before: then this process has bound the
        queue to its controller already (and its "connected" crosses this message), and
        the qid must be freed here, or every later Connect of it is refused as already
        connected (a host that reconnects its queues would never get it back)."""
        session = g.pending.pop(hid, None)
        if session is not None:
            session.queue.gone = True
            self.target.registry.queue_broken(session, session.queue, reason)
        else:
            bound = [key for key, remote in g.queues.items() if remote.hid == hid]
            for cntlid, qid in bound:
                self._queue_lost(g, cntlid, qid, reason)
        self._verbs_close(g, hid)

    # -- verbs queues: the rdma_cm id here, the QP in the worker ----------------------------
    def _verbs_events(self, g: Group, hid: int) -> None:
        """Events of a handed-over verbs queue's rdma_cm id (a disconnect, an error): to
        its worker, which moves its QP to ERR and ends the queue as on one process."""
        cmid = g.cmids.get(hid)
        while cmid is not None:
            event = cmid.get_event(0)
            if event is None:
                return
            if not g.send(("verbs_event", hid, int(event.type), event.status)):
                self._verbs_close(g, hid)
                return

    def _verbs(self, g: Group, hid: int, op: str, *args: Any) -> None:
        """A worker's CM operation on the rdma_cm id of its verbs queue ``hid``."""
        cmid = g.cmids.get(hid)
        if cmid is None:
            return
        try:
            if op == "accept":
                qp_num, private_data = args
                cmid.accept_remote(int(qp_num), bytes(private_data))
                cmid.remote_accepted = True
            elif op == "reject":
                cmid.reject(bytes(args[0]))
            elif op == "disconnect":
                cmid.disconnect()
            elif op == "close":
                self._verbs_close(g, hid)
        except RdmaError as exc:
            if isinstance(exc, ConnectionAbandoned):
                self.target.listening.abandoned += 1
            log.info("poll group %d: %s of %s failed: %s", g.index, op,
                     "%s:%s" % tuple(cmid.peer_address[:2]), exc)
            g.send(("verbs_event", hid, int(CMEventType.DISCONNECTED), 0))  # the worker ends it

    def _verbs_close(self, g: Group, hid: int) -> None:
        """Destroy the rdma_cm id of verbs queue ``hid`` (its worker closed the QP, or the
        worker is gone: then the peer is disconnected, or refused if not accepted yet)."""
        cmid = g.cmids.pop(hid, None)
        if cmid is None:
            return
        self.target.reactor.remove_reader(cmid.fileno())
        from blockfabric.protocol.cm import CMReject, CMRejectStatus  # noqa: PLC0415
        try:
            if getattr(cmid, "remote_accepted", False):
                cmid.disconnect()
            else:
                cmid.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
        except Exception as exc:  # noqa: BLE001  (gone already: closing is what is left)
            log.debug("poll group %d: verbs queue %d: %s", g.index, hid, exc)
        cmid.close()

    def _auth_failed(self, g: Group, cntlid: int, qid: int, reason: str,
                     explanation: int) -> None:
        ctrl = self.target.registry.controllers.get(cntlid)
        remote = g.queues.get((cntlid, qid))
        if ctrl is None or remote is None:
            return

        class _Failed:          # what Target.auth_failed reads of the exchange
            reason: str
            explanation: int
        failed = _Failed()
        failed.reason, failed.explanation = reason, explanation
        self.target.connector.auth_failed(ctrl, remote, failed)  # type: ignore[arg-type]

    # -- messages from the workers ----------------------------------------------------------
    def _handle(self, g: Group, msg: tuple, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        kind = msg[0]
        if kind == "ready":
            g.ready = True
        elif kind == "verbs_ready":
            g.verbs_ready = True
        elif kind == "stats":
            g.stats = msg[1]
            groupstate.take_activity(self, msg[1])
        elif kind == "lost":
            self._queue_lost(g, msg[1], msg[2], msg[3])
        elif kind == "connect":
            self._connect(g, *msg[1:])
        elif kind == "lost_pending":
            self._pending_lost(g, msg[1], msg[2])
        elif kind == "verbs":
            self._verbs(g, *msg[1:])
        elif kind == "auth_failed":
            self._auth_failed(g, *msg[1:])
        elif kind == "destroy":
            ctrl = self.target.registry.controllers.get(msg[1])
            if ctrl is not None:
                self.target.registry.destroy_controller(ctrl, f"poll group {g.index}: {msg[2]}")
        elif kind == "ack":
            self._acked(msg[1], g)
        elif kind == "drained":
            g.drained = True
        elif kind == "resv_get":
            ns = self._namespace(msg[2], msg[3])
            g.send(("answer", msg[1], ns.resv_state if ns is not None else
                    OSError("no such namespace")))
        elif kind == "resv_put":
            self._resv_put(g, *msg[1:])
        else:
            groupstate.handle(self, g, msg)

    def _queue_lost(self, g: Group, cntlid: int, qid: int, reason: str) -> None:
        remote = g.queues.pop((cntlid, qid), None)
        if remote is None:
            return
        remote.gone = True          # the worker closed it already: no "close" back
        t = self.target
        for session in list(t.registry.sessions):
            if session.queue is remote:
                t.registry.queue_broken(session, remote, reason)  # type: ignore[arg-type]
                return

    def _lost(self, g: Group, reason: str) -> None:
        """A worker exited: its queues fail (the hosts reconnect); a new worker takes its
        place for new queues."""
        if not g.alive:
            return
        g.alive = g.ready = g.verbs_ready = False
        code = g.proc.poll() if g.proc is not None else None
        if g.proc is not None and code is None:
            try:
                code = g.proc.wait(1)
            except subprocess.TimeoutExpired:
                code = None
        if g.stats:
            for key, io in g.stats.get("namespaces", {}).items():
                g.history.setdefault(key, IoStats()).add(io)
            g.history_cpu += g.stats.get("cpu_s", 0.0)
            g.stats = {}
        if not self.respawn or self.target.draining:
            return
        log.error("poll group %d (pid %d) exited (%s, status %s): failing its %d queue(s); "
                  "starting it again", g.index, g.pid, reason, code, len(g.queues))
        for (cntlid, qid) in list(g.queues):
            self._queue_lost(g, cntlid, qid, f"poll group {g.index} exited")
        for hid in list(g.pending):
            self._pending_lost(g, hid, f"poll group {g.index} exited")
        for hid in list(g.cmids):
            self._verbs_close(g, hid)
        for req in list(self._acks):
            self._acked(req, g)
        try:
            self._spawn(g)
        except OSError as exc:
            log.error("poll group %d: cannot start again: %s", g.index, exc)
            return
        g.chan.serve(self.target.reactor,  # type: ignore[union-attr]  # (spawned)
                     lambda m, f, g=g: self._handle(g, m, f),  # type: ignore[misc]
                     lambda r, g=g: self._lost(g, r))  # type: ignore[misc]

    # -- reservations ----------------------------------------------------------------------
    def _namespace(self, nqn: str, nsid: int) -> Namespace | None:
        sub = self.target.subsystems.get(nqn)
        return sub.namespaces.get(nsid) if sub is not None else None

    def publish_resv(self, ns: Namespace, state: reservations.State, fenced: list[bytes],
                     then: Callable[[], None]) -> None:
        """A namespace's new reservation state: to every group; ``then()`` once each has it
        and none still runs a command of a ``fenced`` host (or ACK_TIMEOUT passed)."""
        nqn = next((s.nqn for s in self.target.subsystems.values()
                    if s.namespaces.get(ns.nsid) is ns), None)
        live = [g for g in self.groups if g.alive]
        if nqn is None or not live:
            then()
            return
        req = self._next_req
        self._next_req += 1
        waiting = {g.index for g in live}
        entry = [waiting, then, None]
        self._acks[req] = entry
        for g in live:
            if not g.send(("resv", nqn, ns.nsid, state, list(fenced), req)):
                waiting.discard(g.index)
        entry[2] = self.target.reactor.call_later(ACK_TIMEOUT, lambda: self._ack_timeout(req))
        if not waiting:
            self._acked(req)

    def refresh_activity(self, ctrl: Any, then: Callable[[], None]) -> None:
        """The keep-alive's question before it ends ``ctrl`` (groupstate.refresh_activity)."""
        groupstate.refresh_activity(self, ctrl, then)

    def _ack_timeout(self, req: int) -> None:
        entry = self._acks.get(req)
        if entry is None:
            return
        log.error("reservation change: poll group(s) %s did not acknowledge in %.0f s: "
                  "stopping them", sorted(entry[0]), ACK_TIMEOUT)
        for g in self.groups:
            if g.index in entry[0] and g.proc is not None:
                g.proc.kill()       # no group may go on with the old state
        self._acks.pop(req, None)
        entry[1]()

    def _acked(self, req: int, g: Group | None = None) -> None:
        entry = self._acks.get(req)
        if entry is None:
            return
        if g is not None:
            entry[0].discard(g.index)
        if not entry[0]:
            self._acks.pop(req, None)
            if entry[2] is not None:
                entry[2].cancel()
            entry[1]()

    def _resv_put(self, g: Group, req: int, nqn: str, nsid: int, base: int,
                  state: reservations.State, notices: list, fenced: list[bytes]) -> None:
        """A worker's reservation command: store ``state`` if the stored one is still
        version ``base``, then as a change made here (notices, every group, fence), and
        answer the stored state (None: it changed meanwhile, the worker tries again)."""
        ns = self._namespace(nqn, nsid)
        if ns is None:
            g.send(("answer", req, OSError("no such namespace")))
            return
        box: list = []

        def change(cur: reservations.State) -> reservations.Outcome:
            if cur.version != base:
                return reservations.Outcome(reservations.CONFLICT, cur)
            return reservations.Outcome(reservations.OK, state, list(notices), list(fenced))

        def work() -> None:
            box.append(ns.resv_store.update(change))

        def finish(exc: BaseException | None) -> None:
            if exc is not None:
                g.send(("answer", req, OSError(f"reservation state not stored: {exc}")))
                return
            out = box[0]
            if not out.ok:
                g.send(("answer", req, None))
                return
            resvctl.set_state(ns, out.state)
            resvctl._notify(self.target.registry.controllers, ns, out.notices)

            def answered() -> None:
                g.send(("answer", req, out.state))
            hosts = set(out.fenced)
            self.publish_resv(ns, out.state, out.fenced, lambda: resvctl._drained(
                self.target.registry.controllers, self.target.reactor, hosts, answered))

        self.target.broker.run_blocking(work, finish, "poll-groups")

    # -- drain, reload, status -----------------------------------------------------------------
    def drain(self, timeout: float) -> None:
        for g in self.groups:
            g.drained = not g.send(("drain", timeout))

    def draining_left(self) -> int:
        """Workers that have not finished their drain."""
        return sum(1 for g in self.groups if g.alive and not g.drained)

    def push_config(self, config: Any) -> None:
        for g in self.groups:
            g.send(("config", config))

    def snapshot(self, target_snapshot: dict) -> None:
        """Fold the workers' counters into a status snapshot (controllers, subsystems,
        namespaces) and add one entry per group: the totals are the sums of the groups."""
        by_ctrl = {c["cntlid"]: c for c in target_snapshot["controllers"]}
        by_ns = {(s["nqn"], n["nsid"]): n for s in target_snapshot["subsystems"]
                 for n in s["namespaces"]}
        by_sub = {s["nqn"]: s for s in target_snapshot["subsystems"]}
        t = os.times()
        own = IoStats()             # what this process served: its namespaces' counts
        for n in by_ns.values():
            own.add(n["io"])
        groups = [{"index": 0, "pid": os.getpid(), "role": "coordinator",
                   "queues": self._own_load(), "cpu_s": round(t.user + t.system, 3),
                   "io": own.copy(),
                   "resources": copy.deepcopy(target_snapshot["resources"])}]
        for g in self.groups:
            st = g.stats
            io = IoStats()
            for cntlid, cio in st.get("controllers", {}).items():
                entry = by_ctrl.get(cntlid)
                if entry is not None:
                    entry["io"].add(cio)
                    entry["io"].inflight += cio.inflight
            per_ns = {key: h.copy() for key, h in g.history.items()}
            for key, nio in st.get("namespaces", {}).items():
                per_ns.setdefault(key, IoStats()).add(nio)
                per_ns[key].inflight = nio.inflight
            for key, nio in per_ns.items():
                io.add(nio)
                io.inflight += nio.inflight
                n = by_ns.get(key)
                if n is not None:
                    n["io"].add(nio)
                    n["io"].inflight += nio.inflight
                    sub = by_sub.get(key[0])
                    if sub is not None:
                        sub["io"].add(nio)
                        sub["io"].inflight += nio.inflight
            held = st.get("resources")
            if held is not None and g.alive:
                status.add_resources(target_snapshot["resources"], held)
            groups.append({"index": g.index, "pid": g.pid, "role": "worker",
                           "alive": g.alive and g.ready, "queues": g.load,
                           "cpu_s": round(g.history_cpu + st.get("cpu_s", 0.0), 3),
                           "io": io, "resources": held})
        target_snapshot["groups"] = groups
        where = {key: g.index for g in self.groups for key in g.queues}
        for c in target_snapshot["controllers"]:
            for q in c["queues"]:
                q["group"] = where.get((c["cntlid"], q["qid"]), 0)


def _authenticates(config: Any, lconf: Any) -> bool:
    """Whether a host may have to authenticate its queues through ``lconf`` (DH-HMAC-CHAP
    runs in the coordinator, which has the secrets; at the CM request the host is not
    known yet, so such a listener's RDMA queues stay there)."""
    return any(h.dhchap_secret is not None for sub in config.subsystems
               if lconf in config.listeners_for(sub) for h in sub.hosts)


def _readable(chan: Channel, timeout: float) -> bool:
    import select  # noqa: PLC0415
    r, _w, _x = select.select([chan.fileno()], [], [], timeout)
    return bool(r)


def reload_refusal(old: Any, new: Any) -> str | None:
    """Why a reload cannot apply ``new`` to a target with poll groups (None: it can)."""
    if new.reactors != old.reactors:
        return (f"reactors: {old.reactors} -> {new.reactors}: cannot change on reload "
                "(restart the target to change it)")
    if old.reactor_count > 1 and new.subsystems != old.subsystems:
        return ("subsystems: with reactors > 1 a reload cannot change subsystems or "
                "namespaces yet (the workers keep their volumes open): restart the target")
    return None

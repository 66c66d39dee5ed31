"""A poll-group worker: one process, one reactor, serving the I/O queues its coordinator
hands it (see target.pollgroups and docs/scaling.md).

It is started by the coordinator as ``python -m blockfabric.target.worker CHANNEL_FD INDEX``
(the channel and the shared ramdisks' memfds inherited), gets its configuration as the
first message, opens its own view of every namespace (a ramdisk: the coordinator's memfd,
mapped MAP_SHARED and registered here; a file: opened again, flags as the coordinator's;
null: its own), its own protection domain, buffers and backend threads.

What it runs: the I/O commands of the queues it was given, with the controller logic of
:mod:`target.ctrl_io` (a :class:`WorkerController` per controller, holding only what I/O
needs).  What it does not: admin commands, keep-alive, AENs, authentication, reload, the
listeners; the coordinator owns those and the reservation state, which it pushes here (and
waits for the acknowledgement) before it answers the command that changed it.

Longer than ~500 lines because it is one protocol, both ends of which must change together:
the hand-over of three kinds of queue (an NVMe/TCP socket, a soft-RDMA socket, a verbs QP
whose rdma_cm id stays in the coordinator) and every message of the channel; what the
groups share besides queues and reservations is in target.groupstate.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

if __name__ == "__main__":
    # Stopping is the coordinator's: it drains this group's queues and then closes the
    # channel, which ends this process.  A signal sent to every process at once (systemd's
    # KillMode=control-group, Ctrl-C in a terminal) must not end the worker first, its
    # hosts' commands unanswered and its queues failed.  Ignored before the imports below
    # (slow on a loaded machine); a worker whose coordinator is gone still ends (the channel).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

from blockfabric import numa
from blockfabric.errors import BlockfabricError
from blockfabric.fabric.handoff import Channel, ChannelClosed
from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.target_side import TargetQueue
from blockfabric.fabric.tcp_target import TcpTargetQueue
from blockfabric.protocol.cm import CMAccept
from blockfabric.rdma import get_provider
from blockfabric.protocol.controller import Phase, QueueState, admit
from blockfabric.target import config as cfg
from blockfabric.target import groupstate
from blockfabric.target import resvctl
from blockfabric.target import status
from blockfabric.target import reservations
from blockfabric.target.backends import RamdiskBackend, open_backend
from blockfabric.target.controller import Controller
from blockfabric.target.metrics import IoStats
from blockfabric.target.namespace import Namespace
from blockfabric.target.pollgroups import PLACEMENT_ENV
from blockfabric.target.broker import BufferBroker
from blockfabric.target.drain import flush_subsystem
from blockfabric.target.registry import close_queue
from blockfabric.target.sessions import QueueSession, connection_end
from blockfabric.target.services import Owner, Resources

log = logging.getLogger("blockfabric.target.worker")

#: Seconds between the counters a worker sends its coordinator (status, metrics, keep-alive
#: activity); $BLOCKFABRIC_POLL_STATS_INTERVAL overrides it (a diagnostic: with it long,
#: status lags and the keep-alive relies on asking the groups, docs/scaling.md).
STATS_INTERVAL = float(os.environ.get("BLOCKFABRIC_POLL_STATS_INTERVAL") or 0.5)
#: How long a reservation change forwarded to the coordinator may take.
RESV_TIMEOUT = 10.0


def apply_placement(index: int) -> None:
    """Where worker ``index`` runs and where its memory lives: its share of the
    coordinator's NUMA placement (blockfabric.numa.place_worker: a slice of the CPU set, the
    same memory node), passed in $BLOCKFABRIC_WORKER_PLACEMENT.  Called in the worker before
    it opens or registers any memory.  Unplaced coordinator: nothing to do (a worker also
    inherits the coordinator's affinity and memory policy)."""
    raw = os.environ.get(PLACEMENT_ENV)
    if not raw:
        return
    try:
        got = json.loads(raw)
        placement = numa.Placement(
            cpus=frozenset(got["cpus"]) if got.get("cpus") is not None else None,
            node=got.get("node"), policy=got.get("policy", "preferred"),
            reason=got.get("reason", "the coordinator's"))
        numa.place_worker(placement, index, int(got.get("count", 1)))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("worker %d: placement not applied (%s): the coordinator's is inherited",
                    index, exc)


class _IoState:
    """What a worker's controller needs of the protocol's controller table: whether it is
    ready (a queue is handed over only after CC.EN; the coordinator says when a reset or
    a shutdown changes that), and the admission rules of an I/O queue."""

    phase = Phase.READY
    ready = True

    def admit(self, sqe: Any, qid: int) -> None:
        admit(sqe, QueueState.IO, self)     # type: ignore[arg-type]


class WorkerController(Controller):
    """The I/O side of one controller, in a worker: its counters and the command logic of
    ctrl_io (Read/Write, Flush, Write Zeroes, DSM, reservations)."""

    def set_ready(self, ready: bool) -> None:
        """As the coordinator's controller is: its I/O runs only while it is ready (else
        Command Sequence Error, as nvmet's), after a reset or a shutdown there."""
        self._state.ready = ready  # type: ignore[misc]  # (an _IoState here: settable)
        self.is_ready = ready

    def __init__(self, res: Resources, owner: Owner, meta: dict, subsystem: Any) -> None:
        # Not Controller.__init__: no admin state, keep-alive or AERs live here.
        self.res = res
        self.owner = owner
        self.cntlid = meta["cntlid"]
        self.subsystem = subsystem
        self.hostnqn = meta["hostnqn"]
        self.hostid = meta["hostid"]
        self.provider = "tcp"
        self.is_discovery = False
        self.kato_ms = 0
        self.queue_size = meta["depth"]
        self.mdts_bytes = res.limits.mdts
        self.state = _IoState()             # type: ignore[assignment]
        self.aec = 0
        self.queues = {}
        self.aers = []
        self.pending_events = []
        self.changed_nsids = set()
        self.resv = resvctl.CtrlResv()
        self.error_count = 0
        self.created = time.time()
        self.last_activity = time.monotonic()
        self.kato_timer = None
        self.dead = False
        self.listener = None  # type: ignore[assignment]  # (a worker's: no listener here)
        self.auth_policy = None
        self.auth = {}
        self.auth_timers = {}
        self._auth_reported = set()
        self.auth_failures = 0
        self.peer = meta["peer"]
        self._name = f"ctrl {self.cntlid} (group {meta['group']})"
        self.io = IoStats()
        self.admin_errors = 0
        self._unpin_cmd = self._unpin_rw
        self._write_fetched = self._written


class _Session:
    """A handed-over queue's handler (what TcpTargetQueue calls back)."""

    def __init__(self, worker: Worker, ctrl: WorkerController, qid: int) -> None:
        self.worker = worker
        self.ctrl = ctrl
        self.qid = qid
        self.queue: TcpTargetQueue | None = None

    def handle(self, cmd: Any) -> None:
        self.ctrl.handle(cmd)

    def queue_broken(self, queue: TcpTargetQueue, reason: str) -> None:
        self.worker.queue_lost(self, reason, tell=True)


class _RdmaSession(QueueSession):
    """An RDMA I/O queue handed over at its CM request: its Fabrics Connect arrives
    here, is decoded and bounded as in the coordinator, and is checked by the coordinator
    (the registry is there) before it is answered."""

    def __init__(self, worker: Worker, hid: int, qid: int, provider: str = "soft") -> None:
        # the worker is what QueueSession asks of its daemon before the Connect:
        # control_buffer (the Connect's check is the coordinator's, see _connect)
        super().__init__(worker, None, provider, None)   # type: ignore[arg-type]
        self.worker = worker
        self.hid = hid
        self.qid = qid
        self.ctrl: WorkerController | None = None

    def _connect(self, cmd: Any, connect: Any, view: memoryview) -> None:
        data = bytes(view[:len(view)])
        self.worker.pending[self.hid] = (self, cmd, connect)
        self.worker.send(("connect", self.hid, connect, data))

    def queue_broken(self, queue: Any, reason: str) -> None:
        self.worker.rdma_lost(self, reason)


class ForwardStore:
    """A worker's reservation store: reads and compare-and-write go to the coordinator,
    which owns the state (its own store), pushes every change to all groups and answers
    only once they have it."""

    kind = "coordinator"

    def __init__(self, worker: Worker, nqn: str, nsid: int, ptpl_capable: bool) -> None:
        self.worker, self.nqn, self.nsid = worker, nqn, nsid
        self.ptpl_capable = ptpl_capable

    def load(self, fresh_start: bool = False) -> reservations.State:
        return self.worker.ask(("resv_get", self.nqn, self.nsid))

    def update(self, change: Callable[[reservations.State], reservations.Outcome]
               ) -> reservations.Outcome:
        """Run on a backend thread: the change on the coordinator's current state, stored
        there only if nobody changed it meanwhile (else again, on the newer one)."""
        for _ in range(100):
            current = self.load()
            out = change(current)
            if not out.ok or out.state == current:
                return out
            stored = self.worker.ask(("resv_put", self.nqn, self.nsid, current.version,
                                      out.state, out.notices, out.fenced))
            if stored is not None:
                out.state = stored
                return out
        raise OSError("reservation state changed 100 times under one command")

    def close(self) -> None:
        pass


class Worker:
    """One poll group's process."""

    def __init__(self, index: int, chan: Channel, config: cfg.TargetConfig,
                 memfds: dict[tuple[str, int], int], local: tuple[str, ...] = ()) -> None:
        self.index = index
        self.chan = chan
        self.config = config
        self.reactor = Reactor(f"group{index}")
        #: registered memory per protection domain and the backend threads, as the
        #: coordinator's (the same broker: hold watching included)
        self.broker = BufferBroker(self.reactor, lambda: self.config, self._hoarding)
        self.pd = self.broker.tcp_pd()
        #: what a QueueSession asks of its connector before the Connect (see _RdmaSession)
        self.control_buffer = self.broker.control_buffer
        self.controllers: dict[int, WorkerController] = {}
        self.sessions: dict[tuple[int, int], _Session] = {}
        self.subsystems: dict[str, Any] = {}
        self._answers: dict[int, list] = {}
        #: handed-over RDMA queues whose Connect the coordinator is checking (or that
        #: have not sent one yet): hand-over id -> session (and the Connect, once sent)
        self.pending: dict[int, Any] = {}
        self.rdma_sessions: dict[int, _RdmaSession] = {}
        #: verbs: this process's context of each device its queues are on (shared by them)
        self.verbs_contexts: dict[str, Any] = {}
        self._answer_lock = threading.Lock()
        self._stats_due = False
        self._next_req = 1
        self.resources = Resources(
            reactor=self.reactor, control_buffer=self.broker.control_buffer,
            zeros=self.broker.zeros, with_bounce=self.broker.with_bounce,
            run_blocking=self.broker.run_blocking,
            volume_lost=lambda nss, exc: groupstate.volume_lost(self, nss, exc),
            config=lambda: self.config)
        self.owner = Owner(
            destroy_controller=self.destroy_controller, end_queue=self.end_queue,
            flush_subsystem=flush_subsystem, auth_failed=self.auth_failed,
            discovery_log=lambda c: b"", controllers=self.controllers, ana=None,
            discovery_nqn="", discovery_serial="", firmware_revision="")
        for sub in config.subsystems:
            # a subsystem whose queues stay in the coordinator: not opened here
            self.subsystems[sub.nqn] = _WorkerSubsystem(self, sub, memfds,
                                                        sub.nqn not in local)

    def _open_verbs(self, config: cfg.TargetConfig) -> None:
        """With a verbs (or auto) listener: import pyverbs and open every RDMA device once
        ``ready`` is sent (the coordinator's start does not wait for it), then say
        ``verbs_ready``: only then does the coordinator hand this group verbs queues.
        Imported at the first queue instead, it took ~3 s under the lab's emulated CPU,
        and the Linux host's controller whose first I/O queue waited that long was torn
        down by its 5 s keep-alive (the host sends keep-alives only once all its queues
        are connected)."""
        if not any(x.transport == "rdma" and x.provider != "soft" for x in config.listeners):
            return
        try:
            from blockfabric.rdma.verbs.resources import VerbsContext  # noqa: PLC0415
            provider = get_provider("verbs")
            for name in provider._names:                      # type: ignore[attr-defined]
                self.verbs_contexts[name] = VerbsContext(
                    provider._device(name))                   # type: ignore[attr-defined]
        except (OSError, BlockfabricError) as exc:
            log.info("group %d: no verbs provider here (%s)", self.index, exc)
            return
        log.info("group %d: RDMA devices open (%s): taking verbs queues", self.index,
                 ", ".join(self.verbs_contexts) or "none")
        self.send(("verbs_ready",))

    # -- what controllers use -----------------------------------------------------------
    def _hoarding(self, queue: Any, held: float, bound: float) -> None:
        """A queue's host kept a bounce buffer waiting past limits.buffer_hold_timeout: as
        the coordinator does (registry.hoarding), cut the queue and have its controller
        ended (by the coordinator, which owns it)."""
        ctrl = getattr(queue.handler, "controller", None) or getattr(queue.handler, "ctrl", None)
        reason = f"qid {queue.qid} over limits.buffer_hold_timeout"
        if ctrl is not None:        # first: counted, logged and ended there
            groupstate.hoarding(self, ctrl.cntlid, queue.qid, held, bound)
        self.end_queue(queue, reason)
        for rdma in list(self.rdma_sessions.values()):
            if rdma.queue is queue:
                self.rdma_lost(rdma, reason)

    def auth_failed(self, ctrl: Any, queue: Any, auth: Any) -> None:
        """Counted and the peer's back-off: the coordinator's (it has the registry)."""
        self.send(("auth_failed", ctrl.cntlid, queue.qid, str(auth.reason),
                   int(auth.explanation)))

    def destroy_controller(self, ctrl: Any, reason: str) -> None:
        """The worker cannot end a controller: it asks the coordinator to."""
        self.send(("destroy", ctrl.cntlid, reason))

    def end_queue(self, queue: Any, reason: str) -> None:
        for session in list(self.sessions.values()):
            if session.queue is queue:
                self.queue_lost(session, reason, tell=True)

    # -- the channel --------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        try:
            self.chan.send(msg)
        except ChannelClosed:
            self.reactor.call_soon_threadsafe(self.reactor.stop)

    def ask(self, msg: tuple) -> Any:
        """From a backend thread: send ``msg`` with a request id and wait for the answer."""
        box: list = []
        done = threading.Event()
        with self._answer_lock:
            req = self._next_req
            self._next_req += 1
            self._answers[req] = [box, done]
        self.send((msg[0], req, *msg[1:]))
        if not done.wait(RESV_TIMEOUT):
            with self._answer_lock:
                self._answers.pop(req, None)
            raise OSError(f"the coordinator did not answer {msg[0]} in {RESV_TIMEOUT} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def on_message(self, msg: tuple, fds: list[int]) -> None:
        kind = msg[0]
        if kind == "verbs_queue":
            self.take_verbs_queue(msg[1])
        elif kind == "verbs_event":
            rdma = self.rdma_sessions.get(msg[1])
            if rdma is not None and rdma.queue is not None:
                rdma.queue.cmid.deliver(msg[2], msg[3])  # type: ignore[union-attr]  # (remote)
        if kind in ("verbs_queue", "verbs_event"):
            for fd in fds:
                os.close(fd)
            return
        if kind in ("queue", "rdma_queue"):
            (self.take_queue if kind == "queue" else self.take_rdma_queue)(msg[1], fds[0])
            for fd in fds[1:]:
                os.close(fd)
            return
        for fd in fds:
            os.close(fd)
        if kind == "close":
            session = self.sessions.get((msg[1], msg[2]))
            if session is not None:
                self.queue_lost(session, "closed by the coordinator", tell=False)
        elif kind == "connected":
            self.connected(*msg[1:])
        elif kind == "close_pending":
            pending = self.rdma_sessions.get(msg[1])
            if pending is not None:
                self.rdma_lost(pending, "closed by the coordinator", tell=False)
        elif kind == "answer":
            with self._answer_lock:
                entry = self._answers.pop(msg[1], None)
            if entry is not None:
                entry[0].append(msg[2])
                entry[1].set()
        elif kind == "resv":
            self.resv_changed(*msg[1:])
        elif kind == "ready":               # the coordinator's controller: enabled or not
            ctrl = self.controllers.get(msg[1])
            if ctrl is not None:
                ctrl.set_ready(bool(msg[2]))
        elif kind == "config":
            self.config = msg[1]
        elif kind == "drain":
            self.drain(msg[1])
        elif kind == "stop":
            self.reactor.stop()
        else:
            groupstate.worker_message(self, msg)

    def lost_coordinator(self, reason: str) -> None:
        log.warning("group %d: coordinator gone (%s): stopping", self.index, reason)
        self.reactor.stop()

    # -- queues -------------------------------------------------------------------------
    def _controller(self, meta: dict) -> WorkerController | None:
        """The controller here that ``meta`` (a handed-over queue's) belongs to, if any: the
        same cntlid, host (NQN and host id) and subsystem.  A controller kept here after
        its last queue went (commands still in flight) may meet a new one whose cntlid
        wrapped around to it: that one must not inherit its subsystem, and with it another
        subsystem's namespaces."""
        ctrl = self.controllers.get(meta["cntlid"])
        if ctrl is None or ctrl.dead or ctrl.hostid != meta["hostid"] \
                or ctrl.hostnqn != meta["hostnqn"] \
                or ctrl.subsystem is not self.subsystems.get(meta["subnqn"]):
            return None
        return ctrl

    def take_queue(self, meta: dict, fd: int) -> None:
        """A connected NVMe/TCP I/O queue from the coordinator: its socket, the state of
        its connection (ICReq done, Connect read and checked), the bytes read past the
        Connect; answer the Connect and serve it."""
        sock = socket.socket(fileno=fd)
        sub = self.subsystems.get(meta["subnqn"])
        ctrl = self._controller(meta)
        if ctrl is None:
            ctrl = WorkerController(self.resources, self.owner, meta, sub)
            self.controllers[ctrl.cntlid] = ctrl
        qid = meta["qid"]
        session = _Session(self, ctrl, qid)
        depth = meta["depth"]
        try:
            queue = TcpTargetQueue(sock, self.pd, handler=session,
                                   inline_size=meta["inline_size"],
                                   max_depth=lambda q: depth,
                                   name=f"{meta['peer']} tcp q{qid} g{self.index}",
                                   cpda=meta["cpda"])
        except OSError as exc:          # the host went away meanwhile
            sock.close()
            self.send(("lost", meta["cntlid"], qid, f"handover failed: {exc}"))
            return
        session.queue = queue
        # what ICReq/ICResp settled in the coordinator, as negotiated() takes it there (it
        # also turns on the receive path's inline check of the data path's plain headers)
        limits = meta["limits"]
        queue.negotiated(meta["hdgst"], meta["ddgst"], limits.max_capsule_data,
                         limits.max_data, meta["cpda"], meta["tx_align"] // 4 - 1)
        queue.limits = limits
        queue.r2t_max = meta["r2t_max"]
        queue.qid, queue.depth = qid, depth
        queue.max_unsent = meta["max_unsent"]
        queue.data_timeout = lambda: float(self.config.limits.buffer_hold_timeout)
        queue.post_more_receives()
        queue.sq_flow = meta["sq_flow"]
        queue.sqhd = meta["sqhd"]
        queue.dispatch = ctrl.handle
        ctrl.queues[qid] = queue
        self.sessions[ctrl.cntlid, qid] = session
        rest = meta["rest"]
        if rest:
            queue._grow(len(rest), 0, 0) if len(rest) > len(queue._staging) else None
            queue._staging[:len(rest)] = rest
            queue._filled = len(rest)
        queue.attach(self.reactor)
        # The Connect's answer, from here: the host sends nothing else before it.
        cmd = queue.commands[queue._free.pop()]
        cmd.responded = False
        cmd.on_fetched = cmd.on_released = cmd.user = None
        cmd.sgl_type = None
        cmd.cid = meta["cid"]
        queue.respond(cmd, result=meta["result"])
        if rest:
            self.reactor.call_soon(lambda: _parse_rest(queue))
        log.debug("group %d: %s qid %d taken (depth %d)", self.index, ctrl.name, qid, depth)

    def take_rdma_queue(self, meta: dict, fd: int) -> None:
        """A soft-RDMA connection request for an I/O queue (its private data checked by the
        coordinator): accept it here; its Connect comes next (see _RdmaSession)."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        try:
            from blockfabric.rdma.soft.cm import SoftCMId  # noqa: PLC0415
            cmid = SoftCMId(get_provider("soft"),  # type: ignore[arg-type]  # (a SoftProvider)
                            sock, meta["private_data"])
        except OSError as exc:
            sock.close()
            self.send(("lost_pending", meta["hid"], f"hand-over failed: {exc}"))
            return
        self._accept_rdma(meta, cmid, _RdmaSession(self, meta["hid"], meta["qid"]))

    def take_verbs_queue(self, meta: dict) -> None:
        """A verbs connection request for an I/O queue: its rdma_cm id stays in the
        coordinator; the QP is made here, on this process's context of the same device,
        moved INIT/RTR/RTS with the attributes the coordinator read from the id, and the
        coordinator accepts with its qp_num (blockfabric.rdma.verbs.remote)."""
        hid = meta["hid"]
        try:
            from blockfabric.rdma.verbs.remote import RemoteCMId  # noqa: PLC0415
            context = self.verbs_contexts.get(meta["device"])
            if context is None:
                from blockfabric.rdma.verbs.resources import VerbsContext  # noqa: PLC0415
                provider = get_provider("verbs")
                context = VerbsContext(provider._device(meta["device"]))  # type: ignore[attr-defined]
                self.verbs_contexts[meta["device"]] = context
            cmid = RemoteCMId(context, meta["attrs"], meta["private_data"],
                              tuple(meta["peer_addr"]), tuple(meta["local_addr"]),
                              lambda m: self.send(("verbs", hid, *m)))
        except (OSError, BlockfabricError) as exc:
            self.send(("lost_pending", hid, f"hand-over failed: {exc}"))
            return
        self._accept_rdma(meta, cmid, _RdmaSession(self, hid, meta["qid"], "verbs"))

    def _accept_rdma(self, meta: dict, cmid: Any, session: _RdmaSession) -> None:
        """The queue of a handed-over RDMA connection request, accepted here."""
        hid, qid, depth = meta["hid"], meta["qid"], meta["depth"]
        try:
            pd = self.broker.pd_for(cmid)
            queue = TargetQueue(cmid, pd, qid=qid, depth=depth,
                                inline_size=meta["inline_size"], handler=session,
                                name=f"{meta['peer']} q{qid} g{self.index}", recv_now=1)
        except (OSError, BlockfabricError) as exc:
            cmid.close()
            self.send(("lost_pending", hid, f"hand-over failed: {exc}"))
            return
        session.queue = queue
        queue.qp.max_unsent = meta["max_unsent"]
        queue.on_cm_event = lambda: self._on_cm_event(session)
        try:
            queue.post_all_receives()
            queue.attach(self.reactor)
            cmid.accept(CMAccept(crqsize=depth).pack())
        except Exception as exc:  # noqa: BLE001  (this connection only)
            queue.close()
            self.send(("lost_pending", hid, f"accept failed: {exc}"))
            return
        self.rdma_sessions[hid] = session

    def _on_cm_event(self, session: _RdmaSession) -> None:
        if connection_end(session.queue) is not None:
            self.rdma_lost(session, "peer disconnected")

    def connected(self, hid: int, ok: bool, info: Any) -> None:
        """The coordinator's verdict on a handed-over RDMA queue's Connect."""
        entry = self.pending.pop(hid, None)
        if entry is None:
            return
        session, cmd, connect = entry
        queue = session.queue
        if queue is None or queue.closed:
            return
        if not ok:
            code, dnr, result = info
            cmd.respond(code, dnr=dnr, result=result)
            return
        ctrl = self._controller(info)
        if ctrl is None:
            ctrl = WorkerController(self.resources, self.owner, info,
                                    self.subsystems.get(info["subnqn"]))
            self.controllers[ctrl.cntlid] = ctrl
        ctrl.auth_policy = info["auth_policy"]
        session.controller = session.ctrl = ctrl
        ctrl.queues[session.qid] = queue
        self.sessions[ctrl.cntlid, session.qid] = session
        session.handler = ctrl.queue_handler(session.qid)
        queue.dispatch = session.handler
        queue.sq_flow = not connect.sq_flow_control_disabled
        queue.post_more_receives()
        cmd.respond(result=info["result"])

    def rdma_lost(self, session: _RdmaSession, reason: str, tell: bool = True) -> None:
        if session.ctrl is not None:
            self.queue_lost(session, reason, tell)      # type: ignore[arg-type]
        self.rdma_sessions.pop(session.hid, None)
        self.pending.pop(session.hid, None)
        queue = session.queue
        if queue is not None and not queue.closed:
            close_queue(queue)
            self.broker.drop_unwanted_waiters()
        if tell and session.ctrl is None:
            self.send(("lost_pending", session.hid, reason))

    def queue_lost(self, session: _Session, reason: str, tell: bool) -> None:
        ctrl, qid = session.ctrl, session.qid
        self.rdma_sessions.pop(getattr(session, "hid", None), None)  # type: ignore[arg-type]
        if self.sessions.pop((ctrl.cntlid, qid), None) is None:
            return
        queue = session.queue
        ctrl.queues.pop(qid, None)
        if queue is not None and not queue.closed:
            close_queue(queue)
            self.broker.drop_unwanted_waiters()
        if not ctrl.queues and not ctrl.io.inflight:
            self.controllers.pop(ctrl.cntlid, None)
            ctrl.dead = True
        if tell:
            self.send(("lost", ctrl.cntlid, qid, reason))
        self._stats_soon()          # status shows what the queue held given back promptly

    def _stats_soon(self) -> None:
        """Send the counters at the end of this reactor pass (once, however many queues
        ended in it), not only at the next tick."""
        if not self._stats_due:
            self._stats_due = True
            self.reactor.call_soon(self.send_stats)

    def send_stats(self) -> None:
        self._stats_due = False
        self.send(("stats", self.stats()))

    # -- reservations -------------------------------------------------------------------
    def resv_changed(self, nqn: str, nsid: int, state: reservations.State, fenced: list[bytes],
                     req: int) -> None:
        """The coordinator's new reservation state: take it, and acknowledge once no
        command of a preempted (fenced) host is in flight here."""
        sub = self.subsystems.get(nqn)
        ns = sub.namespaces.get(nsid) if sub is not None else None
        if ns is not None:
            resvctl.set_state(ns, state)
        hosts = set(fenced)
        resvctl._drained(self.controllers, self.reactor, hosts,
                         lambda: self.send(("ack", req)))

    # -- counters and drain -------------------------------------------------------------
    def stats(self) -> dict:
        t = os.times()
        per_ns = {}
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                per_ns[sub.nqn, ns.nsid] = ns.stats.copy()
        inflight = sum(c.io.inflight for c in self.controllers.values())
        return {"index": self.index, "pid": os.getpid(), "cpu_s": t.user + t.system,
                "queues": len(self.sessions),
                "controllers": {c: ctrl.io.copy() for c, ctrl in self.controllers.items()},
                "namespaces": per_ns, "active": groupstate.activity(self),
                "inflight": inflight,
                # what the hosts hold here (status' resources; at rest once a host is gone)
                "resources": status.resources(self.broker, len(self.sessions), inflight)}

    def _tick(self) -> None:
        self.send_stats()
        self.reactor.call_later(STATS_INTERVAL, self._tick)

    def drain(self, timeout: float) -> None:
        """Stop running new commands, let those in flight finish, flush, report."""
        self.owner.draining = True
        deadline = time.monotonic() + timeout

        def check() -> None:
            busy = sum(c.io.inflight for c in self.controllers.values())
            if busy and time.monotonic() < deadline:
                self.reactor.call_later(0.005, check)
                return
            for sub in self.subsystems.values():
                flush_subsystem(sub)
            self.send(("stats", self.stats()))
            self.send(("drained",))
        check()

    def run(self) -> None:
        self.chan.serve(self.reactor, self.on_message, self.lost_coordinator)
        self.reactor.call_later(STATS_INTERVAL, self._tick)
        self.send(("ready", os.getpid()))
        self.reactor.call_soon(lambda: self._open_verbs(self.config))
        try:
            self.reactor.run_forever()
        finally:
            self.close()

    def close(self) -> None:
        for session in list(self.sessions.values()):
            self.queue_lost(session, "worker stopping", tell=False)
        for rdma in list(self.rdma_sessions.values()):
            self.rdma_lost(rdma, "worker stopping", tell=False)
        self.broker.stop()
        for sub in self.subsystems.values():
            flush_subsystem(sub)
            for ns in sub.namespaces.values():
                ns.close()
        self.broker.close()
        for context in self.verbs_contexts.values():
            context.close()
        self.chan.close()


def _parse_rest(queue: TcpTargetQueue) -> None:
    """The bytes the coordinator read past the Connect: PDUs of this queue."""
    if queue.closed:
        return
    from blockfabric.protocol import tcp_pdu as tp  # noqa: PLC0415
    try:
        queue._parse()
    except tp.PduError as exc:
        queue.terminate(exc)
        return
    if queue._out and not queue.closed:
        queue.flush()


class _WorkerSubsystem:
    """A subsystem as a worker sees it: its namespaces (own views), nothing of its hosts."""

    def __init__(self, worker: Worker, conf: cfg.Subsystem,
                 memfds: dict[tuple[str, int], int], open_volumes: bool = True) -> None:
        self.conf = conf
        self.nqn = conf.nqn
        self.namespaces: dict[int, Namespace] = {}
        for nc in conf.namespaces if open_volumes else ():
            fd = memfds.get((conf.nqn, nc.nsid))
            backend = (RamdiskBackend(nc.size,  # type: ignore[arg-type]  # (a memfd: a ramdisk's)
                                      nc.block_size, nc.read_only, fd=fd)
                       if fd is not None else open_backend(nc))
            ns = Namespace(nc, backend=backend, resv=False)
            ns.resv_store = ForwardStore(  # type: ignore[assignment]  # (a Store's methods)
                worker, conf.nqn, nc.nsid,
                                         nc.backend == "file")
            self.namespaces[nc.nsid] = ns

    def allows(self, hostnqn: str) -> bool:
        return True         # the coordinator checked it at Connect


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd, index = int(argv[0]), int(argv[1])
    # as the coordinator's lines (stderr, the journal adds the time), tagged with the group
    logging.basicConfig(level=os.environ.get("BLOCKFABRIC_WORKER_LOG", "INFO"),
                        format=f"%(levelname)s %(name)s[group {index}]: %(message)s")
    chan = Channel.from_fd(fd)
    apply_placement(index)
    try:
        got = chan.recv(block=True)
    except ChannelClosed:
        return 1
    msg, _fds = got  # type: ignore[misc]  # (block=True: a message)
    _kind, config, memfds, states, *rest = msg
    extra = rest[0] if rest else {}
    worker = Worker(index, chan, config, memfds, tuple(extra.get("local", ())))
    groupstate.apply_extra(worker, extra)
    for (nqn, nsid), st in states.items():
        ns = worker.subsystems[nqn].namespaces.get(nsid)
        if ns is not None and st is not None:
            resvctl.set_state(ns, st)
        elif ns is not None:
            ns.resv_state, ns.resv_open = None, False
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

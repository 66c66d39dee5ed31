"""The target: listeners, connection set-up, controllers, discovery, and the reactor.

A connection arrives as an rdma_cm connect request carrying the NVMe-oF private data
(qid, queue sizes).  It is checked, a :class:`~blockfabric.fabric.target_side.TargetQueue`
is made with one posted receive per SQ entry, and the connection is accepted.  The first
command on the queue must be a Fabrics Connect: on the admin queue it creates a controller
(or a discovery controller), on an I/O queue it joins the existing controller it names.

Teardown happens in one ordered place (:meth:`Target.close`); signal handlers only ask for it
(:meth:`Target.request_stop`, :meth:`Target.request_reload` wake the reactor, and the drain or
the reload runs there, between commands, like everything else).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from blockfabric import __version__
from blockfabric.errors import BlockfabricError
from blockfabric.logutil import printable
from blockfabric.sdnotify import sd_notify
from blockfabric.fabric.buffers import BufferPool
from blockfabric.fabric.reactor import Reactor, Timer
from blockfabric.fabric.target_side import Command, TargetQueue
from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_target import TcpTargetQueue
from blockfabric.protocol import StatusCode
from blockfabric.protocol import logpages as lp
from blockfabric.protocol.auth import CONNECT_AUTHREQ_ATR, AuthPolicy, TargetAuth
from blockfabric.protocol.cm import CMAccept, CMConnectRequest, CMReject, CMRejectStatus
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.controller import ControllerState, QueueState, admit
from blockfabric.protocol.fabrics import (CONNECT_DATA_SIZE, DISCOVERY_NQN, IATTR,
                                          IPO_DATA_CNTLID, IPO_DATA_HOSTNQN, IPO_DATA_SUBNQN,
                                          IPO_SQE_QID, IPO_SQE_SQSIZE, ConnectCommand,
                                          ConnectData,
                                          connect_invalid_param, nqn_problem)
from blockfabric.rdma import (CONNECTION_ENDED, PD, SGE, Access, CMEventType, CMId,
                              Listener, get_provider)
from blockfabric.target import config as cfg
from blockfabric.target import metrics as mx
from blockfabric.target import pollgroups
from blockfabric.target import reload as rl
from blockfabric.target import resvctl
from blockfabric.target.ana import Ana
from blockfabric.target.backoff import PeerBackoff
from blockfabric.target.control import ControlServer
from blockfabric.target.controller import AERL, Controller
from blockfabric.target.fairshare import BouncePool, FairExecutor, Lease
from blockfabric.target.gateway import Coordinator, refuse_exclusive_lock
from blockfabric.target.namespace import Namespace, Subsystem
from blockfabric.target.rbdvolume import VolumeWatch
from blockfabric.target.reloader import Reloader, close_namespace
from blockfabric.target.services import Owner, Resources

log = logging.getLogger(__name__)

ADMIN_MAX_DEPTH = 32
CONTROL_SLOT = 4096
BOUNCE_SLOTS = 64
#: A host's share of the bounce buffers never drops below this, however many hosts want them.
BOUNCE_FLOOR = 4
BACKEND_THREADS = 4
#: Completions all the queues of one host take in one reactor pass (split evenly between
#: them, at least PASS_FLOOR each), so that a host with many queues cannot fill the pass.
HOST_PASS = 128
PASS_FLOOR = 16
MAX_CNTLID = 0xFFEF
#: How long a drain waits for commands in flight.  Below the unit's TimeoutStopSec (30 s),
#: so a stop ends in exit 0.
DRAIN_TIMEOUT = 20.0
DRAIN_POLL = 0.005
#: errno values that mean "out of resources" (descriptors, memory) rather than a bug
NO_RESOURCES_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS))


def abort_command(cmd: Command) -> None:
    """A command that will never be answered (its queue is gone): run its undo hook
    (``cmd.user(cmd)``, set where a command pins a namespace) and release its buffer."""
    undo, cmd.user = cmd.user, None
    if undo is not None:
        undo(cmd)
    release, cmd.on_released = cmd.on_released, None
    if release is not None:
        release(cmd)


def close_queue(queue: TargetQueue, bounce_pools: Any) -> None:
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
    # Commands still waiting for a bounce buffer will never need it.
    for pool in bounce_pools:
        if pool.ring:
            pool.drop_unwanted()


class QueueSession:
    """The command handler of one queue: Connect first, then its controller's logic.
    ``req``: the RDMA CM request; None on NVMe/TCP, whose queue learns its qid from the
    Connect itself (``qid`` is set then, before :meth:`handle` sees it)."""

    def __init__(self, target: Target, listener: cfg.Listener, provider: str,
                 req: CMConnectRequest | None) -> None:
        self.target = target
        self.listener = listener
        self.provider = provider
        self.req = req
        self.qid = req.qid if req is not None else 0
        self.controller: Controller | None = None
        self.queue: TargetQueue | None = None
        #: Disconnects the queue if no Fabrics Connect completes in limits.connect_timeout.
        self.connect_timer: Timer | None = None
        #: The connected queue's command handler (the controller's, or its authentication
        #: gate); None until the Connect.
        self.handler: Callable[[Command], None] | None = None

    def handle(self, cmd: Command) -> None:
        handler = self.handler
        if handler is not None:
            handler(cmd)
            return
        sqe = cmd.sqe
        try:
            admit(sqe, QueueState.UNCONNECTED)      # Connect first, nothing else
            connect = ConnectCommand.from_sqe(sqe)
            if connect.qid != self.qid:
                raise connect_invalid_param(f"Connect qid {connect.qid} on queue {self.qid}",
                                            IATTR.SQE, IPO_SQE_QID)
            if self.qid == 0 and connect.sqsize + 1 > ADMIN_MAX_DEPTH:
                raise connect_invalid_param(f"admin Connect sqsize {connect.sqsize}",
                                            IATTR.SQE, IPO_SQE_SQSIZE)
            if cmd.data_length != CONNECT_DATA_SIZE:
                raise ProtocolError(f"Connect data is {cmd.data_length} bytes, not "
                                    f"{CONNECT_DATA_SIZE}", StatusCode.SGL_DATA_LENGTH_INVALID)
        except ProtocolError as exc:
            cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
            return
        view, sge, release = self.target.control_buffer(cmd.queue, CONNECT_DATA_SIZE)
        cmd.on_released = release
        cmd.fetch(view, sge, lambda c: self._connect(c, connect, view))

    def _connect(self, cmd: Command, connect: ConnectCommand, view: memoryview) -> None:
        try:
            data = ConnectData.unpack_from(view[:CONNECT_DATA_SIZE])
            ctrl = self.target.connect(self, connect, data)
        except ProtocolError as exc:
            log.info("connect refused: hostnqn=%s subnqn=%s qid=%d peer=%s: %s (status %#x)",
                     _safe_nqn(view, 512), _safe_nqn(view, 256), self.qid,
                     _peer(self.queue), exc, exc.status)
            cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
            return
        self.controller = ctrl
        if self.connect_timer is not None:
            self.connect_timer.cancel()
            self.connect_timer = None
        self.handler = ctrl.queue_handler(self.qid)
        self.queue.dispatch = self.handler      # the queue calls it without this session
        self.queue.sq_flow = not connect.sq_flow_control_disabled
        result = ctrl.cntlid | (CONNECT_AUTHREQ_ATR if ctrl.auth_policy else 0)
        poll = self.target.poll
        if poll is not None and poll.handoff(self, cmd, ctrl, result):
            return                              # a poll group answers it and serves it
        # The rest of the queue's receive slots, before the answer: a host sends nothing
        # else on this queue until it has the Connect response.
        self.queue.post_more_receives()
        # ATR: authenticate this queue before anything else (nvmet_connect_result)
        cmd.respond(result=result)

    def queue_broken(self, queue: TargetQueue, reason: str) -> None:
        self.target.queue_broken(self, queue, reason)


def auth_policy(subsystem: cfg.Subsystem, hostnqn: str) -> AuthPolicy | None:
    """How ``hostnqn`` must authenticate to ``subsystem`` (None: it need not)."""
    entry = subsystem.host(hostnqn)
    if entry is None or entry.dhchap_secret is None:
        return None
    return AuthPolicy(entry.dhchap_secret, entry.dhchap_ctrl_secret, entry.hash_id,
                      entry.dhgroup_id)


class _Episode:
    """A warning that a peer can make happen at will, logged when it starts and then at
    most once per ``interval`` seconds with how many were left out, so that a flood of
    refusals cannot flood the log."""

    def __init__(self, logger: logging.Logger, what: str, interval: float = 10.0) -> None:
        self.log = logger
        self.what = what
        self.interval = interval
        self.quiet_until = 0.0
        self.left_out = 0

    def note(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self.quiet_until:
            self.left_out += 1
            return
        if self.left_out:
            msg += f" (and {self.left_out} more {self.what} refused since the last such line)"
        self.log.warning(msg, *args)
        self.left_out = 0
        self.quiet_until = now + self.interval


class _Peer:
    """A connection's peer address where the limits read a CM id's ``peer_address``."""

    def __init__(self, address: tuple) -> None:
        self.peer_address = address


class TcpListener:
    """A listening NVMe/TCP socket (non-blocking; its connections are accepted on the
    reactor)."""

    def __init__(self, address: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((address, port))
            self.sock.listen(128)
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def deadline(self) -> None:
        return None

    def close(self) -> None:
        self.sock.close()


def _peer(queue: TargetQueue | None) -> str:
    try:
        return "%s:%s" % tuple(queue.cmid.peer_address[:2])
    except Exception:
        return "?"


def _peer_ip(queue: TargetQueue | None) -> str:
    try:
        return str(queue.cmid.peer_address[0])
    except Exception:
        return "?"


def _safe_nqn(view: memoryview, at: int) -> str:
    """An NQN field of Connect data as it may be logged (whatever the peer put there)."""
    raw = bytes(view[at:at + 256]).split(b"\0", 1)[0]
    return printable(raw.decode("utf-8", "surrogateescape"))


class Target:
    """The whole daemon state; used as ``with Target(config) as t: t.serve_forever()``."""

    def __init__(self, config: cfg.TargetConfig) -> None:
        self.config = config
        self.reactor = Reactor("target")
        self.discovery_nqn = DISCOVERY_NQN
        self.discovery_serial = "blockfabric-disc"
        self.firmware_revision = __version__[:8]
        self.subsystems: dict[str, Subsystem] = {}
        self.listeners: list[tuple[cfg.Listener, str, Listener]] = []
        self.controllers: dict[int, Controller] = {}
        self.sessions: set[QueueSession] = set()
        self._next_cntlid = 1
        self._pds: dict[int, PD] = {}
        self._control: dict[int, BufferPool] = {}
        self._zeros: dict[int, BufferPool] = {}
        self._old_zeros: list[BufferPool] = []      # outgrown by a larger mdts (reload)
        self._bounce: dict[int, BouncePool] = {}
        self._hold_timer: Timer | None = None
        #: id(listener) -> the timer that calls it back at its deadline() (see _on_requests)
        self._listener_timers: dict[int, Timer] = {}
        self._shed_log = _Episode(log, "connection requests")
        self.executor = FairExecutor(self.reactor, BACKEND_THREADS)
        self._started = threading.Event()
        self.genctr = 0
        self.auth_failures = 0                  # failed DH-HMAC-CHAP exchanges
        #: Peer addresses whose authentications keep failing (limits.auth_max_failures).
        self.auth_backoff = PeerBackoff()
        self.hold_disconnects = 0               # controllers ended for holding a bounce buffer
        self.started = time.time()
        self.reloads = 0
        self.last_reload_error: str | None = None
        self.metrics_server: mx.MetricsServer | None = None
        self.control_server: ControlServer | None = None
        self._closing: list[Namespace] = []     # removed, closed once their I/O is done
        self.reloader = Reloader(self)          # reloads, and namespace changes while serving
        self.volumes = VolumeWatch(self)        # RBD volumes: availability and size
        self.ana: Ana | None = None             # a member of a gateway group: its ANA state
        self.coordinator: Coordinator | None = None
        #: The worker processes of ``reactors`` > 1 (target.pollgroups), started by start().
        self.poll: pollgroups.PollGroups | None = None
        pollgroups.prepare(config.reactor_count)
        try:
            for sub in config.subsystems:
                self.subsystems[sub.nqn] = Subsystem(sub)
            if config.gateway is not None:
                refuse_exclusive_lock(ns for sub in self.subsystems.values()
                                      for ns in sub.namespaces.values())
                self.ana = Ana(self, config.gateway)
        except BaseException:
            self.close()
            raise
        # What a controller may use of the daemon (services.py), the same pair for all.
        self.resources = Resources(
            reactor=self.reactor, control_buffer=self.control_buffer, zeros=self.zeros,
            with_bounce=self.with_bounce, run_blocking=self.run_blocking,
            volume_lost=self.volumes.lost, config=lambda: self.config)
        self.owner = Owner(
            destroy_controller=self.destroy_controller, end_queue=self.end_queue,
            flush_subsystem=self.flush_subsystem, auth_failed=self.auth_failed,
            discovery_log=self.discovery_log, controllers=self.controllers, ana=self.ana,
            discovery_nqn=self.discovery_nqn, discovery_serial=self.discovery_serial,
            firmware_revision=self.firmware_revision)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listeners ---------------------------------------------------------------------
    def start(self) -> None:
        """Open every listener (all or nothing), then the metrics listener and the control
        socket: when this returns, every listener accepts."""
        try:
            if self.ana is not None:        # join the group first: it may refuse us
                self.coordinator = Coordinator(self, self.ana, self.config.gateway)
                self.coordinator.connect()
            if self.config.reactor_count > 1:
                self.poll = pollgroups.PollGroups(self, self.config.reactor_count)
                self.owner.publish_resv = self.poll.publish_resv
                self.poll.start()
            for lconf in self.config.listeners:
                self._add_listener(self._open_listener(lconf))
            self._start_metrics()
        except BaseException:
            self.close()
            raise
        if self.coordinator is not None:
            self.ana.start()
            self.coordinator.start()
        self._start_control()
        self._start_watchdog()
        self.volumes.start()
        resvctl.bind(self)                  # reservations shared with the other gateways
        self._started.set()

    def _open_listener(self, lconf: cfg.Listener) -> tuple[cfg.Listener, str, Listener]:
        if lconf.transport == "tcp":
            return lconf, "tcp", TcpListener(lconf.address, lconf.port)
        provider = get_provider(lconf.provider, lconf.address)
        limits = self.config.limits
        return lconf, provider.name, provider.listen(
            lconf.address, lconf.port, max_pending=limits.max_pending_requests,
            request_timeout=limits.request_timeout)

    def _add_listener(self, entry: tuple[cfg.Listener, str, Listener]) -> None:
        lconf, provider, listener = entry
        self.listeners.append(entry)
        if lconf.transport == "tcp":
            self.reactor.add_reader(listener.fileno(), lambda: self._on_tcp(lconf, listener))
            log.info("listening on %s (NVMe/TCP)", lconf.endpoint)
            return
        self.reactor.add_reader(listener.fileno(),
                                lambda: self._on_requests(lconf, provider, listener))
        log.info("listening on %s (%s provider)", lconf.endpoint, provider)

    def _close_listener(self, entry: tuple[cfg.Listener, str, Listener]) -> None:
        timer = self._listener_timers.pop(id(entry[2]), None)
        if timer is not None:
            timer.cancel()
        self.listeners.remove(entry)
        self.reactor.remove_reader(entry[2].fileno())
        entry[2].close()

    def _start_metrics(self) -> None:
        m = self.config.metrics
        if m is not None:
            self.metrics_server = mx.MetricsServer(m.address, m.port, self.metrics_text).start()
            log.info("metrics on http://%s:%d/metrics", m.address, self.metrics_server.port)

    def _start_control(self) -> None:
        """The control socket is for ``status``: a target without one still serves I/O."""
        try:
            self.control_server = ControlServer(self.config.control_socket,
                                                self._control_request).start()
        except OSError as exc:
            log.warning("no control socket at %s: %s", self.config.control_socket, exc)

    def _start_watchdog(self) -> None:
        """WATCHDOG=1 from the reactor itself at half of WatchdogSec: a stuck reactor gets
        the service restarted."""
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and int(pid) != os.getpid()):
            return

        def ping() -> None:
            sd_notify("WATCHDOG=1")
            self.reactor.call_later(usec / 2e6, ping)
        self.reactor.call_later(usec / 2e6, ping)

    def serve_forever(self) -> None:
        self.reactor.run_forever()

    def stop(self) -> None:
        self.reactor.stop()

    # -- signals: only wake the reactor ------------------------------------------------
    def request_stop(self) -> None:
        """For a signal handler: drain and stop (a second request stops at once)."""
        self.reactor.call_soon_threadsafe(self.drain)

    def request_reload(self, load: Callable[[], cfg.TargetConfig]) -> None:
        """For a signal handler: reload with the configuration ``load()`` returns."""
        self.reactor.call_soon_threadsafe(lambda: self.reload_from(load))

    def _on_requests(self, lconf: cfg.Listener, provider: str, listener: Listener) -> None:
        try:
            while True:
                cmid = listener.get_request(0)
                if cmid is None:
                    return
                try:
                    self._accept(lconf, provider, cmid)
                except Exception as exc:
                    if getattr(exc, "errno", None) in NO_RESOURCES_ERRNOS:
                        # Out of descriptors or memory: refused like any other shortage,
                        # and logged as one (not a traceback per connection).
                        self._shed_log.note("rejecting connection from %s: NO_RESOURCES (%s)",
                                            cmid.peer_address[0], exc)
                    else:
                        log.exception("connection set-up from %s failed", cmid.peer_address)
                    self._reject_and_close(cmid)
        finally:
            self._wake_listener_at_deadline(lconf, provider, listener)

    @staticmethod
    def _reject_and_close(cmid: CMId) -> None:
        try:
            cmid.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
        except Exception:
            pass                # already accepted or closed: closing is all that is left
        cmid.close()

    def _wake_listener_at_deadline(self, lconf: cfg.Listener, provider: str,
                                   listener: Listener) -> None:
        """A listener has timed work (half-received requests to expire, a pause after
        running out of descriptors to end) that no readable fd announces: one timer per
        listener calls it back then."""
        when = listener.deadline()
        key = id(listener)
        timer = self._listener_timers.get(key)
        if when is None or (timer is not None and not timer.cancelled and timer.when <= when):
            return
        if timer is not None:
            timer.cancel()

        def wake() -> None:
            self._listener_timers.pop(key, None)
            if any(entry[2] is listener for entry in self.listeners):
                self._on_requests(lconf, provider, listener)
        self._listener_timers[key] = self.reactor.call_later(when - time.monotonic(), wake)

    def _accept(self, lconf: cfg.Listener, provider: str, cmid: CMId) -> None:
        try:
            req = CMConnectRequest.unpack_from(cmid.private_data)
            req.check_limits(max_admin_depth=ADMIN_MAX_DEPTH,
                             max_queue_size=self.config.limits.queue_size)
        except ProtocolError as exc:
            sts = exc.cm_reject or CMRejectStatus.NO_RESOURCES
            log.info("rejecting connection from %s: %s", cmid.peer_address, exc)
            cmid.reject(CMReject(sts=sts).pack())
            cmid.close()
            return
        if self._over_host_limit(cmid) or self._over_unconnected_limit(cmid):
            cmid.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
            cmid.close()
            return
        if self.poll is not None and self.poll.handoff_rdma(lconf, provider, cmid, req):
            return                              # a poll group accepts and serves it
        session = QueueSession(self, lconf, provider, req)
        depth = req.hsqsize + 1
        pd = self.pd_for(cmid)
        inline = self.config.limits.inline_data_size if req.qid else 0
        # One receive slot until the Fabrics Connect succeeds (QueueSession._connect posts
        # the rest before answering it): a peer that never proves to be a host costs one
        # capsule buffer, not a queue's worth.
        queue = TargetQueue(cmid, pd, qid=req.qid, depth=depth, inline_size=inline,
                            handler=session, name=f"{cmid.peer_address[0]} q{req.qid}",
                            recv_now=1)
        session.queue = queue
        queue.qp.max_unsent = self.config.limits.unsent_limit(depth, inline)
        queue.on_cm_event = lambda: self._on_cm_event(session)
        try:
            queue.post_all_receives()
            queue.attach(self.reactor)
        except BaseException:
            queue.close()       # its CQ, buffers and QP; the caller refuses the request
            raise
        self.sessions.add(session)
        timeout = self.config.limits.connect_timeout
        session.connect_timer = self.reactor.call_later(
            timeout, lambda: self._connect_timed_out(session, timeout))
        cmid.accept(CMAccept(crqsize=depth).pack())
        log.debug("accepted %s qid %d depth %d", cmid.peer_address, req.qid, depth)

    def _on_tcp(self, lconf: cfg.Listener, listener: TcpListener) -> None:
        """NVMe/TCP connections: each a queue whose first PDU must be an ICReq and whose
        first command a Fabrics Connect (which names its qid and depth), bounded by the
        same limits as an RDMA connection request."""
        while True:
            try:
                sock, peer = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in NO_RESOURCES_ERRNOS:
                    self._shed_log.note("not accepting NVMe/TCP connections: %s", exc)
                    return
                log.warning("%s: accept failed: %s", lconf.endpoint, exc)
                return
            try:
                self._accept_tcp(lconf, sock, peer)
            except Exception:
                log.exception("NVMe/TCP connection set-up from %s failed", peer)
                sock.close()

    def _accept_tcp(self, lconf: cfg.Listener, sock: Any, peer: tuple) -> None:
        probe = _Peer(peer)
        if self._over_host_limit(probe) or self._over_unconnected_limit(probe):
            sock.close()
            return
        limits = self.config.limits
        session = QueueSession(self, lconf, "tcp", None)
        pd = self._pds.get(0)
        if pd is None:
            pd = self._pds[0] = local_pd()
        queue = TcpTargetQueue(
            sock, pd, handler=session, inline_size=limits.inline_data_size,
            max_depth=lambda qid: ADMIN_MAX_DEPTH if qid == 0 else limits.queue_size,
            name=f"{peer[0]} tcp", cpda=self._listener_now(lconf).cpda)
        queue.max_unsent = limits.unsent_limit(limits.queue_size, limits.inline_data_size)
        session.queue = queue
        queue.attach(self.reactor)
        self.sessions.add(session)
        timeout = limits.connect_timeout
        session.connect_timer = self.reactor.call_later(
            timeout, lambda: self._connect_timed_out(session, timeout))
        log.debug("accepted NVMe/TCP connection from %s", peer)

    def _over_host_limit(self, cmid: CMId) -> bool:
        """limits.max_connections_per_host, counted per peer address: at CM time the host
        NQN is not known yet, and a flood of bare connections must be stopped before it
        costs queue memory."""
        peer = cmid.peer_address[0]
        limit = self.config.limits.max_connections_per_host
        count = sum(1 for s in self.sessions
                    if s.queue is not None and s.queue.cmid.peer_address[0] == peer)
        if count < limit:
            return False
        self._shed_log.note("rejecting connection from %s: NO_RESOURCES (%d connections from "
                            "that address, limits.max_connections_per_host is %d)", peer,
                            count, limit)
        return True

    def _over_unconnected_limit(self, cmid: CMId) -> bool:
        """limits.max_unconnected_queues, across all addresses: queues accepted whose
        Fabrics Connect has not completed yet (each holds a socket, a QP and a receive slot
        until limits.connect_timeout)."""
        limit = self.config.limits.max_unconnected_queues
        count = sum(1 for s in self.sessions if s.controller is None)
        if count < limit:
            return False
        self._shed_log.note("rejecting connection from %s: NO_RESOURCES (%d queues without a "
                            "Fabrics Connect, limits.max_unconnected_queues is %d)",
                            cmid.peer_address[0], count, limit)
        return True

    def _connect_timed_out(self, session: QueueSession, timeout: int) -> None:
        """A queue that is still not bound to a controller after limits.connect_timeout:
        disconnect it, freeing its queue memory and its per-host connection slot."""
        session.connect_timer = None
        if session.controller is not None or session not in self.sessions:
            return
        log.info("disconnecting qid=%d from peer %s: no Fabrics Connect within %d s "
                 "(limits.connect_timeout)", session.qid, _peer(session.queue), timeout)
        self._close_queue(session)

    def _on_cm_event(self, session: QueueSession) -> None:
        queue = session.queue
        while queue is not None and not queue.closed:
            event = queue.cmid.get_event(0)
            if event is None:
                return
            if event.type in CONNECTION_ENDED:
                self.queue_broken(session, queue, "peer disconnected"
                                  if event.type == CMEventType.DISCONNECTED
                                  else f"connection ended ({event.type.name})")
                return

    # -- resources ---------------------------------------------------------------------
    def pd_for(self, cmid: CMId) -> PD:
        key = id(cmid.context)
        pd = self._pds.get(key)
        if pd is None:
            pd = self._pds[key] = cmid.context.alloc_pd()
        return pd

    def control_buffer(self, queue: TargetQueue, length: int
                       ) -> tuple[memoryview, SGE, Callable[[Command], None]]:
        """A registered buffer for admin data (Identify pages, log pages, Connect data)."""
        pd = queue.pd
        if length <= CONTROL_SLOT:
            pool = self._control.get(id(pd))
            if pool is None:
                pool = self._control[id(pd)] = BufferPool(pd, 64, CONTROL_SLOT)
            index = pool.get()
            if index is not None:
                return (pool.views[index], pool.sge(index, length),
                        lambda _cmd: pool.put(index))
        # Large or many: a one-off registration (the admin path is not the hot path).
        pool = BufferPool(pd, 1, max(length, 1))
        return pool.views[0], pool.sge(0, length), lambda _cmd: pool.close()

    def zeros(self, queue: TargetQueue, length: int) -> SGE:
        """``length`` (at most limits.mdts) bytes of zeros in registered memory, one region
        per protection domain that is never written: answers padded to a length the host
        chose cost no memory of that length."""
        pd = queue.pd
        pool = self._zeros.get(id(pd))
        if pool is None or pool.size < length:
            if pool is not None:
                self._old_zeros.append(pool)    # may still be read by a posted WRITE
            size = max(length, self.config.limits.mdts)
            pool = self._zeros[id(pd)] = BufferPool(pd, 1, size, Access(0))
        return pool.sge(0, length)

    def with_bounce(self, cmd: Command, host: str, length: int,
                    use: Callable[[memoryview, SGE, Lease], None]) -> None:
        """Run ``use(view, sge, lease)`` with a registered bounce buffer (file backends),
        when ``host``'s fair share allows (see fairshare.py); the command gives it back
        through ``lease.release`` as its ``on_released``."""
        pd = cmd.queue.pd
        pool = self._bounce.get(id(pd))
        if pool is None:
            pool = self._bounce[id(pd)] = BouncePool(
                BufferPool(pd, BOUNCE_SLOTS, self.config.limits.mdts), BOUNCE_FLOOR,
                abort_command)
            self._watch_holds()
        pool.request(host, (cmd, length, use))

    def _watch_holds(self) -> None:
        """Check the bounce buffers against limits.buffer_hold_timeout, a few times per
        bound (at most once a second)."""
        if self._hold_timer is None:
            period = min(1.0, self.config.limits.buffer_hold_timeout / 4)
            self._hold_timer = self.reactor.call_later(period, self._check_holds)

    def _check_holds(self) -> None:
        self._hold_timer = None
        bound = self.config.limits.buffer_hold_timeout
        now = time.monotonic()
        try:
            for pool in list(self._bounce.values()):
                for lease in pool.overdue(now, bound):
                    cmd = lease.cmd
                    if cmd is not None and not cmd.queue.closed:  # not gone with an earlier one
                        self._hoarding(cmd.queue, now - lease.since, bound)
        finally:
            self._watch_holds()

    def _hoarding(self, queue: TargetQueue, held: float, bound: float) -> None:
        """A queue's host kept a bounce buffer waiting on it (an RDMA READ it does not
        answer, an answer it does not acknowledge) past the bound: disconnect it and tear
        its controller down.  The buffers come back as the queue closes, after its QP is
        destroyed, never while a work request may still reference them."""
        session = queue.handler
        ctrl = session.controller
        self.hold_disconnects += 1
        log.warning("ctrl %s hostnqn=%r qid=%d peer=%r: held a bounce buffer for %.1f s "
                    "(limits.buffer_hold_timeout is %g s): disconnecting it",
                    ctrl.cntlid if ctrl else "-", ctrl.hostnqn if ctrl else None, queue.qid,
                    _peer(queue), held, bound)
        self._close_queue(session)
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            self.destroy_controller(ctrl, f"qid {queue.qid} over limits.buffer_hold_timeout")

    def run_blocking(self, work: Callable[[], object],
                     finish: Callable[[BaseException | None], None], host: str) -> None:
        """Run ``work`` on the backend threads, in ``host``'s fair turn; ``finish(exc)``
        runs back on the reactor."""
        self.executor.submit(host, work, finish)

    def flush_subsystem(self, subsystem: Subsystem | None) -> None:
        if subsystem is None:
            return
        for ns in subsystem.namespaces.values():
            try:
                ns.backend.flush()
            except OSError as exc:
                log.error("flushing %s ns %d: %s", subsystem.nqn, ns.nsid, exc)

    # -- controllers -----------------------------------------------------------------
    def connect(self, session: QueueSession, connect: ConnectCommand,
                data: ConnectData) -> Controller:
        """Bind a queue to a controller (new on the admin queue); raises the Connect status."""
        subnqn, hostnqn = data.subnqn, data.hostnqn
        # Both NQNs as the spec has them (base 4.7) before either is used or logged.
        for what, nqn, offset in (("subsystem", subnqn, IPO_DATA_SUBNQN),
                                  ("host", hostnqn, IPO_DATA_HOSTNQN)):
            problem = nqn_problem(nqn)
            if problem is not None:
                raise connect_invalid_param(f"{what} NQN {problem}", IATTR.DATA, offset)
        subsystem = None
        if subnqn == DISCOVERY_NQN:
            if session.qid:     # a discovery controller has an admin queue only (as nvmet)
                raise connect_invalid_param("I/O queue Connect to the discovery controller",
                                            IATTR.SQE, IPO_SQE_QID)
        else:
            subsystem = self.subsystems.get(subnqn)
            if subsystem is None or not self._exposed(subsystem, session.listener):
                raise connect_invalid_param("unknown subsystem", IATTR.DATA, IPO_DATA_SUBNQN)
            if not subsystem.allows(hostnqn):
                log.warning("access denied: hostnqn=%s subnqn=%s qid=%d peer=%s: host not "
                            "allowed", hostnqn, subnqn, session.qid, _peer(session.queue))
                raise ProtocolError("host not allowed", StatusCode.CONNECT_INVALID_HOST)
            if session.qid == 0:
                self.volumes.check_connect(subsystem)
        limits = self.config.limits
        lconf = self._check_listener_limit(session)
        if session.qid == 0:
            policy = auth_policy(subsystem.conf, hostnqn) if subsystem is not None else None
            if policy is not None:
                self._check_auth_backoff(session)
            state = ControllerState.admin_connect(
                connect, data, cntlid=self._alloc_cntlid(),
                max_io_queues=min(limits.max_io_queues,
                                  lconf.max_io_queues or limits.max_io_queues),
                cap=Controller.capabilities(min(limits.queue_size,
                                                lconf.queue_size or limits.queue_size)),
                aerl=AERL)
            ctrl = Controller(self.resources, self.owner, state, subsystem, hostnqn,
                              data.hostid, session.provider)
            ctrl.auth_policy = policy
            ctrl.listener = session.listener
            ctrl.peer = _peer(session.queue)
            ctrl.queues[0] = session.queue
            self.controllers[ctrl.cntlid] = ctrl
            self._share_passes(hostnqn)
            ctrl.start_keep_alive()
            log.info("%s: created (kato %d ms, via %s %s, peer %s)", ctrl.name, ctrl.kato_ms,
                     session.provider, session.listener.endpoint, ctrl.peer)
            return ctrl
        ctrl = self.controllers.get(data.cntlid)
        if ctrl is None or ctrl.dead or ctrl.subsystem is not subsystem \
                or ctrl.hostnqn != hostnqn:
            raise connect_invalid_param(f"no controller {data.cntlid} for this host",
                                        IATTR.DATA, IPO_DATA_CNTLID)
        if not ctrl.ready:
            raise ProtocolError("I/O queue Connect before CC.EN", StatusCode.CMD_SEQ_ERROR)
        if ctrl.auth_policy is not None:
            self._check_auth_backoff(session)
        ctrl.state = ctrl.state.io_connect(connect, data)
        ctrl.queues[session.qid] = session.queue
        self._share_passes(hostnqn)
        log.debug("%s qid=%d: connected (depth %d)", ctrl.name, session.qid,
                  session.queue.depth)
        return ctrl

    def _listener_now(self, lconf: cfg.Listener) -> cfg.Listener:
        """The listener's configuration as it is now (a reload may have changed its keys
        since a connection, or the listener's reader, took hold of ``lconf``)."""
        key = rl.listener_key(lconf)
        return next((lc for lc, _p, _l in self.listeners if rl.listener_key(lc) == key), lconf)

    def _check_listener_limit(self, session: QueueSession) -> cfg.Listener:
        """The listener's ``max_connections`` (as the configuration has it now, a reload
        included): refused with Controller Busy once that many queues are connected
        through it.  Returns that listener's configuration."""
        lconf = self._listener_now(session.listener)
        key = rl.listener_key(lconf)
        most = lconf.max_connections
        if most is not None:
            held = sum(1 for s in self.sessions if s.controller is not None
                       and rl.listener_key(s.listener) == key)
            if held >= most:
                raise ProtocolError(f"listener {lconf.endpoint}: {held} queues connected, its "
                                    f"max_connections is {most}", StatusCode.CONNECT_CTRL_BUSY)
        return lconf

    def _check_auth_backoff(self, session: QueueSession) -> None:
        """A Connect that would start an authentication, from an address whose
        authentications keep failing: refused (Controller Busy, may be retried) until its
        back-off is over, so nobody can guess secrets at the speed of connection set-up, nor
        make the target compute DH exchanges for them."""
        left = self.auth_backoff.blocked(_peer_ip(session.queue), time.monotonic())
        if left > 0:
            raise ProtocolError(f"too many failed authentications from this address: refused "
                                f"for {left:.0f} s more (limits.auth_backoff)",
                                StatusCode.CONNECT_CTRL_BUSY, dnr=False)

    def auth_failed(self, ctrl: Controller, queue: TargetQueue, auth: TargetAuth) -> None:
        """An exchange on ``queue`` failed (wrong answer, a message out of sequence, timed
        out): log it with the queue's peer, count it, and past limits.auth_max_failures
        within limits.auth_failure_window from one address, start that address's
        back-off."""
        log.warning("%s qid=%d peer=%s: authentication failed: %s (explanation %#x): tearing "
                    "the %s down", ctrl.name, queue.qid, _peer(queue), auth.reason,
                    auth.explanation, "queue" if queue.qid else "controller")
        self.auth_failures += 1
        peer_ip = _peer_ip(queue)
        limits = self.config.limits
        if self.auth_backoff.failed(peer_ip, time.monotonic(), limits.auth_max_failures,
                                    limits.auth_failure_window, limits.auth_backoff):
            log.warning("peer %s: %d failed authentications within %d s: refusing its Connects "
                        "that need authentication for %d s (limits.auth_max_failures, "
                        "auth_failure_window, auth_backoff)", peer_ip,
                        limits.auth_max_failures, limits.auth_failure_window,
                        limits.auth_backoff)

    def end_queue(self, queue: TargetQueue, reason: str) -> None:
        """Disconnect one queue of a controller (as if its host had gone)."""
        for session in self.sessions:
            if session.queue is queue:
                self.queue_broken(session, queue, reason)
                return

    def _exposed(self, subsystem: Subsystem, listener: cfg.Listener) -> bool:
        key = rl.listener_key(listener)
        return any(rl.listener_key(x) == key for x in self.config.listeners_for(subsystem.conf))

    def _alloc_cntlid(self) -> int:
        # a gateway's range as it joined its group with (a reload does not change it)
        gw = self.ana.gw if self.ana is not None else None
        lo, hi = (gw.cntlid_min, gw.cntlid_max) if gw is not None else (1, MAX_CNTLID)
        for _ in range(hi - lo + 1):
            cntlid = self._next_cntlid if lo <= self._next_cntlid <= hi else lo
            self._next_cntlid = cntlid + 1 if cntlid < hi else lo
            if cntlid not in self.controllers:
                return cntlid
        raise ProtocolError("no controller id free", StatusCode.CONNECT_CTRL_BUSY)

    def queue_broken(self, session: QueueSession, queue: TargetQueue, reason: str) -> None:
        """A queue died (peer gone, RDMA error): release it; the admin queue takes its
        controller with it."""
        if queue.closed:
            return
        ctrl = session.controller
        level = logging.INFO if "disconnect" in reason or "flushed" in reason \
            else logging.WARNING
        log.log(level, "%s qid=%d: %s", ctrl.name if ctrl else queue.name, queue.qid, reason)
        self._close_queue(session)
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            ctrl.auth.pop(queue.qid, None)
            ctrl.state = ctrl.state.disconnect(queue.qid)
            if queue.qid == 0:
                self.destroy_controller(ctrl, f"admin queue lost: {reason}")
            else:
                self._share_passes(ctrl.hostnqn)

    def _share_passes(self, hostnqn: str) -> None:
        """Split HOST_PASS between the queues of ``hostnqn`` (on a Connect or a loss; the
        per-completion path only reads the result)."""
        queues = [q for c in self.controllers.values() if c.hostnqn == hostnqn
                  for q in c.queues.values()]
        for q in queues:
            q.pass_limit = max(PASS_FLOOR, HOST_PASS // len(queues))

    def _close_queue(self, session: QueueSession) -> None:
        """Close a session's queue and let go of everything its commands still hold."""
        queue = session.queue
        self.sessions.discard(session)
        if session.connect_timer is not None:
            session.connect_timer.cancel()
            session.connect_timer = None
        if queue is not None and not queue.closed:
            close_queue(queue, self._bounce.values())

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
            self._close_queue(session)
        ctrl.queues.clear()
        self._share_passes(ctrl.hostnqn)
        log.info("%s: destroyed (%s)", ctrl.name, reason)

    # -- discovery -------------------------------------------------------------------
    def discovery_log(self, ctrl: Controller) -> bytes:
        """The discovery log page for this host: subsystems it may use, once per transport
        and address: every NVMe/TCP listener, and the RDMA listeners of the provider it came
        in on (any, when it came in over TCP)."""
        entries = []
        for sub in self.subsystems.values():
            if not sub.allows(ctrl.hostnqn):
                continue
            for lconf, provider, _listener in self.listeners:
                tcp = lconf.transport == "tcp"
                if lconf not in self.config.listeners_for(sub.conf) or not (
                        tcp or ctrl.provider in (provider, "tcp")):
                    continue
                entries.append(lp.DiscoveryLogEntry(
                    trtype=lp.TransportType.TCP if tcp else lp.TransportType.RDMA,
                    adrfam=lp.AddressFamily.IPV6 if ":" in lconf.address
                    else lp.AddressFamily.IPV4,
                    # TCP: no secure channel (TREQ 1:0 = 0, so no host asks for TLS), SQ flow
                    # control may be disabled (bit 2, as nvmet: reads then skip CapsuleResp)
                    subtype=lp.SubsystemType.NVM, treq=lp.TREQ_SQFLOW_DISABLE if tcp else 0,
                    portid=self.config.listeners.index(lconf) + 1,
                    cntlid=0xFFFF, asqsz=ADMIN_MAX_DEPTH,
                    trsvcid=str(lconf.port), subnqn=sub.nqn, traddr=lconf.address,
                    tsas=lp.TCP_TSAS if tcp else lp.RdmaTsas()))
        return bytes(lp.pack_discovery_log(self.genctr, entries))

    # -- drain (SIGTERM) ---------------------------------------------------------------
    def inflight(self) -> int:
        """Commands executing on any namespace (held ones, and AERs, are not counted)."""
        nss = [ns for sub in self.subsystems.values() for ns in sub.namespaces.values()]
        return sum(ns.stats.inflight for ns in nss + self._closing)

    @property
    def draining(self) -> bool:
        """Stopping (SIGTERM): held on :attr:`owner`, which every controller reads."""
        return self.owner.draining

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Stop accepting, let the commands in flight finish (new ones are held, not run),
        flush every volume, disconnect every host, and stop the reactor."""
        if self.draining:
            log.warning("stop requested again while draining: stopping now")
            self.reactor.stop()
            return
        self.owner.draining = True
        sd_notify("STOPPING=1")
        for entry in list(self.listeners):
            self._close_listener(entry)
        if self.poll is not None:
            self.poll.drain(timeout)
        log.info("draining: listeners closed, %d command(s) in flight, %d controller(s)",
                 self.inflight(), len(self.controllers))
        deadline = time.monotonic() + timeout

        def check() -> None:
            left = self.inflight() + (self.poll.draining_left() if self.poll else 0)
            if left and time.monotonic() < deadline:
                self.reactor.call_later(DRAIN_POLL, check)
                return
            if left:
                log.error("drain: %d command(s) still in flight after %.0f s; stopping anyway",
                          left, timeout)
            for sub in self.subsystems.values():
                self.flush_subsystem(sub)
            for ctrl in list(self.controllers.values()):
                self.destroy_controller(ctrl, "target stopping")
            log.info("drained: volumes flushed, hosts disconnected")
            self.reactor.stop()
        check()

    # -- reload (SIGHUP) ---------------------------------------------------------------
    def reload_from(self, load: Callable[[], cfg.TargetConfig]) -> bool:
        """Load a new configuration and apply it; on any error keep the old one whole."""
        if self.draining:
            log.warning("reload ignored: the target is stopping")
            return False
        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            try:
                new = load()
            except BlockfabricError as exc:
                self._reload_failed(str(exc))
                return False
            return self.reload(new)
        finally:
            sd_notify("READY=1\nSTATUS=serving")

    def _reload_failed(self, error: str) -> None:
        self.last_reload_error = error
        log.error("reload rejected, the running configuration is unchanged: %s", error)

    def reload(self, new: cfg.TargetConfig) -> bool:
        """Apply ``new`` (see :class:`~blockfabric.target.reloader.Reloader`)."""
        refusal = pollgroups.reload_refusal(self.config, new)
        if refusal is not None:
            self._reload_failed(f"{new.source}: {refusal}")
            return False
        applied = self.reloader.apply(new)
        if applied and self.poll is not None:
            self.poll.push_config(self.config)
        return applied

    def may_stay(self, ctrl: Controller) -> bool:
        """After a reload: still allowed, still exposed, and authenticated with what the
        configuration now says (a changed or revoked secret disconnects the host)."""
        sub = ctrl.subsystem
        return (self.subsystems.get(sub.nqn) is sub and sub.allows(ctrl.hostnqn)
                and self._exposed(sub, ctrl.listener)
                and ctrl.auth_policy == auth_policy(sub.conf, ctrl.hostnqn))

    def destroy_where(self, condition: Callable[[Controller], bool], reason: str) -> None:
        for ctrl in [c for c in self.controllers.values() if condition(c)]:
            self.destroy_controller(ctrl, reason)

    # -- status and metrics -------------------------------------------------------------
    def _control_request(self, request: dict[str, Any]) -> Any:
        """The control socket's handler (on its thread): answers come from the reactor."""
        command = request.get("command")
        if command != "status":
            raise ValueError(f"unknown command {command!r} (known: status)")
        box: list[dict[str, Any]] = []
        self.reactor.call_sync(lambda: box.append(self.snapshot()))
        return box[0]

    def metrics_text(self) -> str:
        box: list[dict[str, Any]] = []
        self.reactor.call_sync(lambda: box.append(self.snapshot()))
        return mx.render_metrics(box[0])

    def snapshot(self) -> dict[str, Any]:
        """Everything ``status`` and the metrics show, copied on the reactor."""
        per_listener: dict[tuple, int] = {}
        for ctrl in self.controllers.values():
            key = rl.listener_key(ctrl.listener)
            per_listener[key] = per_listener.get(key, 0) + 1
        subsystems = []
        for sub in self.subsystems.values():
            subsystems.append({
                "nqn": sub.nqn, "allow_any_host": sub.conf.allow_any_host,
                "hosts": list(sub.conf.host_nqns),     # never the secrets
                "listeners": [x.endpoint for x in self.config.listeners_for(sub.conf)],
                "controllers": sum(1 for c in self.controllers.values() if c.subsystem is sub),
                "io": sub.stats(),
                "namespaces": [{"nsid": ns.nsid, "backend": ns.conf.backend,
                                "path": ns.conf.path, "size": ns.size,
                                "block_size": ns.block_size, "read_only": ns.read_only,
                                "io": ns.stats.copy()}
                               for ns in sorted(sub.namespaces.values(), key=lambda n: n.nsid)]})
        controllers = []
        for ctrl in sorted(self.controllers.values(), key=lambda c: c.cntlid):
            controllers.append({
                "cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "subnqn": ctrl.subnqn,
                "discovery": ctrl.is_discovery, "provider": ctrl.provider,
                "listener": ctrl.listener.endpoint, "peer": ctrl.peer,
                "kato_ms": ctrl.kato_ms, "created": ctrl.created,
                "queues": [{"qid": qid, "depth": q.depth, "in_use": q.outstanding}
                           for qid, q in sorted(ctrl.queues.items())],
                "io": ctrl.io.copy(), "admin_errors": ctrl.admin_errors,
                # DH-HMAC-CHAP: whether its queues must authenticate, and which have
                "auth_required": ctrl.auth_policy is not None,
                "authenticated_queues": sorted(q for q, a in ctrl.auth.items()
                                               if a.authenticated)})
        now = time.time()
        out = {
            "version": __version__, "pid": os.getpid(), "config": self.config.source,
            "started": self.started, "uptime_s": now - self.started,
            "state": "draining" if self.draining else "serving",
            "reloads": self.reloads, "last_reload_error": self.last_reload_error,
            "genctr": self.genctr, "auth_failures": self.auth_failures,
            "buffer_hold_disconnects": self.hold_disconnects,
            "listeners": [{"endpoint": lc.endpoint, "name": lc.name, "address": lc.address,
                           "port": lc.port, "provider": p,
                           "controllers": per_listener.get(rl.listener_key(lc), 0)}
                          for lc, p, _li in self.listeners],
            "subsystems": subsystems, "controllers": controllers,
            "gateway": self.ana.snapshot() if self.ana is not None else None,
            # What hosts hold right now: a host that vanished must leave all of it at rest.
            "resources": {
                "connections": len(self.sessions),
                "commands_in_flight": self.inflight(),
                "bounce_buffers_in_use": sum(p.used for p in self._bounce.values()),
                "bounce_waiters": sum(p.waiting for p in self._bounce.values()),
                # per host (its fair share is what fairshare.py says)
                "bounce_buffers_by_host": _by_host(self._bounce.values()),
                "backend_threads": {"busy": self.executor.used,
                                    "waiting": self.executor.waiting,
                                    "by_host": _by_host([self.executor])},
            },
        }
        if self.poll is not None:
            self.poll.snapshot(out)
        return out

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Stop accepting, close every queue, flush and close every volume; idempotent."""
        for _lconf, _provider, listener in self.listeners:
            self.reactor.remove_reader(listener.fileno())
            listener.close()
        self.listeners.clear()
        for ctrl in list(self.controllers.values()):
            self.destroy_controller(ctrl, "target stopping")
        for session in list(self.sessions):
            self._close_queue(session)
        if self.poll is not None:
            self.poll.close()
            self.poll = None
        for server in (self.control_server, self.metrics_server):
            if server is not None:
                server.close()
        self.control_server = self.metrics_server = None
        self.volumes.stop()
        if self.ana is not None:
            # A planned stop hands the groups over: no longer optimized here first, then
            # the leases are released for the survivors to take at once.
            self.ana.stop()
            for group in list(self.ana.owned):
                self.ana.set_owned(group, False, why="gateway stopping")
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self.executor.shutdown()
        for sub in self.subsystems.values():
            self.flush_subsystem(sub)
            sub.close()
        self.subsystems.clear()
        for ns in self._closing:
            close_namespace(ns)
        self._closing.clear()
        for pool in [*self._control.values(), *self._bounce.values(), *self._zeros.values(),
                     *self._old_zeros]:
            pool.close()
        self._control.clear()
        self._zeros.clear()
        self._old_zeros.clear()
        self._bounce.clear()
        for pd in self._pds.values():
            pd.close()
        self._pds.clear()
        self.reactor.close()



def _by_host(pools: Any) -> dict[str, int]:
    """Units held per host NQN, summed over ``pools``."""
    out: dict[str, int] = {}
    for pool in pools:
        for h in pool.hosts.values():
            if h.held:
                out[h.key] = out.get(h.key, 0) + h.held
    return out

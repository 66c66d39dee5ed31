"""Queue sessions and the Fabrics Connect: what a new queue must say first, and how it is
bound to a controller (a new one on the admin queue, an existing one on an I/O queue) or
refused (unknown or unexposed subsystem, host not allowed, listener full, authentication
back-off).

A :class:`QueueSession` is the command handler of one accepted queue until its Connect
succeeds; then the queue calls its controller's handler directly.  The :class:`Connector`
checks a Connect against the configuration and the registry, and counts failed
authentications per peer address (:mod:`blockfabric.target.backoff`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.fabric.target_side import Command
from blockfabric.logutil import printable
from blockfabric.protocol import StatusCode
from blockfabric.protocol.auth import CONNECT_AUTHREQ_ATR, AuthPolicy, TargetAuth
from blockfabric.protocol.cm import CMConnectRequest
from blockfabric.protocol.controller import ControllerState, QueueState, admit
from blockfabric.protocol.errors import ProtocolError
from blockfabric.rdma import CONNECTION_ENDED, CMEventType
from blockfabric.protocol.fabrics import (CONNECT_DATA_SIZE, DISCOVERY_NQN, IATTR,
                                          IPO_DATA_CNTLID, IPO_DATA_HOSTNQN, IPO_DATA_SUBNQN,
                                          IPO_SQE_QID, IPO_SQE_SQSIZE, ConnectCommand,
                                          ConnectData,
                                          connect_invalid_param, nqn_problem)
from blockfabric.target import config as cfg
from blockfabric.target import reload
from blockfabric.target.backoff import PeerBackoff
from blockfabric.target.controller import AERL, Controller
from blockfabric.target.namespace import Subsystem
from blockfabric.target.services import ControlBuffer

if TYPE_CHECKING:
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.fabric.reactor import Timer
    from blockfabric.target.rbdvolume import VolumeWatch
    from blockfabric.target.registry import ControllerRegistry

log = logging.getLogger(__name__)

ADMIN_MAX_DEPTH = 32

#: ``new_controller(state, subsystem, hostnqn, hostid, provider)``: a controller with the
#: daemon's resources and owner (the composition root makes it).
NewController = Callable[[ControllerState, "Subsystem | None", str, bytes, str], Controller]


class QueueSession:
    """The command handler of one queue: Connect first, then its controller's logic.
    ``req``: the RDMA CM request; None on NVMe/TCP, whose queue learns its qid from the
    Connect itself (``qid`` is set then, before :meth:`handle` sees it)."""

    def __init__(self, connector: Connector, listener: cfg.Listener, provider: str,
                 req: CMConnectRequest | None) -> None:
        self.connector = connector
        self.listener = listener
        self.provider = provider
        self.req = req
        self.qid = req.qid if req is not None else 0
        self.controller: Controller | None = None
        # the queue it handles: set by the listener that made it, at once
        self.queue: AnyTargetQueue = None  # type: ignore[assignment]
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
        view, sge, release = self.connector.control_buffer(cmd.queue, CONNECT_DATA_SIZE)
        cmd.on_released = release
        cmd.fetch(view, sge, lambda c: self._connect(c, connect, view))

    def _connect(self, cmd: Command, connect: ConnectCommand, view: memoryview) -> None:
        try:
            data = ConnectData.unpack_from(view[:CONNECT_DATA_SIZE])
            ctrl = self.connector.connect(self, connect, data)
        except ProtocolError as exc:
            log.info("connect refused: hostnqn=%s subnqn=%s qid=%d peer=%s: %s (status %#x)",
                     _safe_nqn(view, 512), _safe_nqn(view, 256), self.qid,
                     peer_of(self.queue), exc, exc.status)
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
        poll = self.connector.poll
        if poll is not None and poll.handoff(self, cmd, ctrl, result):
            return                              # a poll group answers it and serves it
        # The rest of the queue's receive slots, before the answer: a host sends nothing
        # else on this queue until it has the Connect response.
        self.queue.post_more_receives()
        # ATR: authenticate this queue before anything else (nvmet_connect_result)
        cmd.respond(result=result)

    def queue_broken(self, queue: AnyTargetQueue, reason: str) -> None:
        self.connector.queue_broken(self, queue, reason)


def auth_policy(subsystem: cfg.Subsystem, hostnqn: str) -> AuthPolicy | None:
    """How ``hostnqn`` must authenticate to ``subsystem`` (None: it need not)."""
    entry = subsystem.host(hostnqn)
    if entry is None or entry.dhchap_secret is None:
        return None
    return AuthPolicy(entry.dhchap_secret, entry.dhchap_ctrl_secret, entry.hash_id,
                      entry.dhgroup_id)


def exposed(config: cfg.TargetConfig, subsystem: Subsystem, listener: cfg.Listener) -> bool:
    """Whether ``config`` exposes ``subsystem`` on ``listener``."""
    key = reload.listener_key(listener)
    return any(reload.listener_key(x) == key for x in config.listeners_for(subsystem.conf))


def peer_of(queue: AnyTargetQueue | None) -> str:
    """A queue's peer as ``address:port``, for the log ("?" when it has none)."""
    try:
        return "%s:%s" % tuple(queue.cmid.peer_address[:2])  # type: ignore[union-attr]  # (None: ?)
    except Exception:
        return "?"


def connection_end(queue: AnyTargetQueue | None) -> str | None:
    """An RDMA queue's CM events, read without blocking until none is left: why the
    connection ended if one of them ended it (then no more are read), else None.  The
    listener's and a poll-group worker's queues both watch their CM id with it."""
    while queue is not None and not queue.closed:
        event = queue.cmid.get_event(0)  # type: ignore[union-attr]  # (RDMA: a CM id)
        if event is None:
            return None
        if event.type in CONNECTION_ENDED:
            return ("peer disconnected" if event.type == CMEventType.DISCONNECTED
                    else f"connection ended ({event.type.name})")
    return None


def _peer_ip(queue: AnyTargetQueue | None) -> str:
    try:
        return str(queue.cmid.peer_address[0])  # type: ignore[union-attr]  # (None: "?")
    except Exception:
        return "?"


def _safe_nqn(view: memoryview, at: int) -> str:
    """An NQN field of Connect data as it may be logged (whatever the peer put there)."""
    raw = bytes(view[at:at + 256]).split(b"\0", 1)[0]
    return printable(raw.decode("utf-8", "surrogateescape"))


class Connector:
    """Binds a queue to a controller on its Fabrics Connect, or refuses it with the
    Connect status.  ``config()``: the configuration in force; ``listener_now(lconf)``:
    a listener's configuration as it is now (a reload may have changed it)."""

    def __init__(self, *, config: Callable[[], cfg.TargetConfig],
                 subsystems: dict[str, Subsystem], registry: ControllerRegistry,
                 volumes: VolumeWatch,
                 listener_now: Callable[[cfg.Listener], cfg.Listener],
                 control_buffer: ControlBuffer,
                 new_controller: NewController) -> None:
        self._config = config
        self.subsystems = subsystems
        self.registry = registry
        self.volumes = volumes
        self.listener_now = listener_now
        self.control_buffer = control_buffer
        self.new_controller = new_controller
        self.queue_broken = registry.queue_broken
        self.auth_failures = 0                  # failed DH-HMAC-CHAP exchanges
        #: Peer addresses whose authentications keep failing (limits.auth_max_failures).
        self.auth_backoff = PeerBackoff()
        #: With ``reactors`` > 1 (target.pollgroups): hands NVMe/TCP I/O queues to a
        #: worker at their Connect; None: every queue is served here.
        self.poll: Any = None

    def connect(self, session: QueueSession, connect: ConnectCommand,
                data: ConnectData) -> Controller:
        """Bind a queue to a controller (new on the admin queue); raises the Connect status."""
        subnqn, hostnqn = data.subnqn, data.hostnqn
        ctrl: Controller | None
        # Both NQNs as the spec has them (base 4.7) before either is used or logged.
        for what, nqn, offset in (("subsystem", subnqn, IPO_DATA_SUBNQN),
                                  ("host", hostnqn, IPO_DATA_HOSTNQN)):
            problem = nqn_problem(nqn)
            if problem is not None:
                raise connect_invalid_param(f"{what} NQN {problem}", IATTR.DATA, offset)
        config = self._config()
        subsystem = None
        if subnqn == DISCOVERY_NQN:
            if session.qid:     # a discovery controller has an admin queue only (as nvmet)
                raise connect_invalid_param("I/O queue Connect to the discovery controller",
                                            IATTR.SQE, IPO_SQE_QID)
        else:
            subsystem = self.subsystems.get(subnqn)
            if subsystem is None or not exposed(config, subsystem, session.listener):
                raise connect_invalid_param("unknown subsystem", IATTR.DATA, IPO_DATA_SUBNQN)
            if not subsystem.allows(hostnqn):
                log.warning("access denied: hostnqn=%s subnqn=%s qid=%d peer=%s: host not "
                            "allowed", hostnqn, subnqn, session.qid, peer_of(session.queue))
                raise ProtocolError("host not allowed", StatusCode.CONNECT_INVALID_HOST)
            if session.qid == 0:
                self.volumes.check_connect(subsystem)
        limits = config.limits
        lconf = self._check_listener_limit(session)
        registry = self.registry
        if session.qid == 0:
            policy = auth_policy(subsystem.conf, hostnqn) if subsystem is not None else None
            if policy is not None:
                self._check_auth_backoff(session)
            state = ControllerState.admin_connect(
                connect, data, cntlid=registry.alloc_cntlid(),
                max_io_queues=min(limits.max_io_queues,
                                  lconf.max_io_queues or limits.max_io_queues),
                cap=Controller.capabilities(min(limits.queue_size,
                                                lconf.queue_size or limits.queue_size)),
                aerl=AERL)
            ctrl = self.new_controller(state, subsystem, hostnqn, data.hostid,
                                       session.provider)
            ctrl.auth_policy = policy
            ctrl.listener = session.listener
            ctrl.peer = peer_of(session.queue)
            ctrl.queues[0] = session.queue
            registry.controllers[ctrl.cntlid] = ctrl
            registry.share_passes(hostnqn)
            ctrl.start_keep_alive()
            log.info("%s: created (kato %d ms, via %s %s, peer %s)", ctrl.name, ctrl.kato_ms,
                     session.provider, session.listener.endpoint, ctrl.peer)
            return ctrl
        ctrl = registry.controllers.get(data.cntlid)
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
        registry.share_passes(hostnqn)
        log.debug("%s qid=%d: connected (depth %d)", ctrl.name, session.qid,
                  session.queue.depth)
        return ctrl

    def _check_listener_limit(self, session: QueueSession) -> cfg.Listener:
        """The listener's ``max_connections`` (as the configuration has it now, a reload
        included): refused with Controller Busy once that many queues are connected
        through it.  Returns that listener's configuration."""
        lconf = self.listener_now(session.listener)
        key = reload.listener_key(lconf)
        most = lconf.max_connections
        if most is not None:
            held = sum(1 for s in self.registry.sessions if s.controller is not None
                       and reload.listener_key(s.listener) == key)
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

    def auth_failed(self, ctrl: Controller, queue: AnyTargetQueue, auth: TargetAuth) -> None:
        """An exchange on ``queue`` failed (wrong answer, a message out of sequence, timed
        out): log it with the queue's peer, count it, and past limits.auth_max_failures
        within limits.auth_failure_window from one address, start that address's
        back-off."""
        log.warning("%s qid=%d peer=%s: authentication failed: %s (explanation %#x): tearing "
                    "the %s down", ctrl.name, queue.qid, peer_of(queue), auth.reason,
                    auth.explanation, "queue" if queue.qid else "controller")
        self.auth_failures += 1
        peer_ip = _peer_ip(queue)
        limits = self._config().limits
        if self.auth_backoff.failed(peer_ip, time.monotonic(), limits.auth_max_failures,
                                    limits.auth_failure_window, limits.auth_backoff):
            log.warning("peer %s: %d failed authentications within %d s: refusing its Connects "
                        "that need authentication for %d s (limits.auth_max_failures, "
                        "auth_failure_window, auth_backoff)", peer_ip,
                        limits.auth_max_failures, limits.auth_failure_window,
                        limits.auth_backoff)

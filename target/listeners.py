"""The target's listeners: opening and closing them (rdma_cm and NVMe/TCP), accepting their
connections on the reactor, and the limits a connection meets before any Connect (per peer
address, unconnected queues across all addresses, the Connect deadline).

A connection arrives as an rdma_cm connect request carrying the NVMe-oF private data
(qid, queue sizes), or as an NVMe/TCP socket.  It is checked, a queue is made with one
posted receive (the rest once its Connect succeeds) and a :class:`~blockfabric.target.
sessions.QueueSession` as its handler, and the connection is accepted.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Any, Callable

from blockfabric.errors import ConnectionAbandoned
from blockfabric.fabric.reactor import Reactor, Timer
from blockfabric.fabric.target_side import TargetQueue
from blockfabric.fabric.tcp_target import TcpTargetQueue
from blockfabric.protocol.cm import CMAccept, CMConnectRequest, CMReject, CMRejectStatus
from blockfabric.protocol.errors import ProtocolError
from blockfabric.rdma import CMId, Listener, get_provider
from blockfabric.target import config as cfg
from blockfabric.target import reload
from blockfabric.target.broker import BufferBroker
from blockfabric.target.registry import ControllerRegistry
from blockfabric.target.sessions import ADMIN_MAX_DEPTH, QueueSession, connection_end, peer_of

log = logging.getLogger(__name__)

#: errno values that mean "out of resources" (descriptors, memory) rather than a bug
NO_RESOURCES_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS))

#: One open listener: its configuration, its provider's name ("tcp" for NVMe/TCP), itself.
Entry = tuple[cfg.Listener, str, "Listener | TcpListener"]


class Episode:
    """A warning that a peer can make happen at will, logged when it starts and then at
    most once per ``interval`` seconds with how many were left out, so that a flood of
    refusals cannot flood the log."""

    def __init__(self, logger: logging.Logger, what: str, interval: float = 10.0,
                 verb: str = "refused") -> None:
        self.log = logger
        self.what = what
        self.verb = verb
        self.interval = interval
        self.quiet_until = 0.0
        self.left_out = 0

    def note(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self.quiet_until:
            self.left_out += 1
            return
        if self.left_out:
            msg += (f" (and {self.left_out} more {self.what} {self.verb} since the last such "
                    "line)")
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


class Listeners:
    """The open listeners of one target and the connections they accept.
    ``config()``: the configuration in force; ``new_session(lconf, provider, req)``: the
    handler of a new queue (``req`` None on NVMe/TCP)."""

    def __init__(self, reactor: Reactor, config: Callable[[], cfg.TargetConfig],
                 registry: ControllerRegistry, broker: BufferBroker,
                 new_session: Callable[[cfg.Listener, str, CMConnectRequest | None],
                                       QueueSession]) -> None:
        self.reactor = reactor
        self._config = config
        self.registry = registry
        self.broker = broker
        self.new_session = new_session
        self.entries: list[Entry] = []
        #: id(listener) -> the timer that calls it back at its deadline() (see _on_requests)
        self._timers: dict[int, Timer] = {}
        self._shed_log = Episode(log, "connection requests")
        #: connect requests whose host gave up before they were accepted (stale: nothing
        #: of them is kept, see _on_requests)
        self.abandoned = 0
        self._abandoned_log = Episode(log, "connection requests", verb="abandoned")
        #: With ``reactors`` > 1 (target.pollgroups): hands soft-RDMA I/O queues to a
        #: worker at their CM request; None: every queue is accepted here.
        self.poll: Any = None

    # -- open and close --------------------------------------------------------------------
    def open(self, lconf: cfg.Listener) -> Entry:
        """Open (bind) a listener; it accepts nothing until :meth:`add`."""
        if lconf.transport == "tcp":
            return lconf, "tcp", TcpListener(lconf.address, lconf.port)
        provider = get_provider(lconf.provider, lconf.address)
        limits = self._config().limits
        return lconf, provider.name, provider.listen(
            lconf.address, lconf.port, max_pending=limits.max_pending_requests,
            request_timeout=limits.request_timeout)

    def add(self, entry: Entry) -> None:
        """Accept an opened listener's connections on the reactor."""
        lconf, provider, listener = entry
        self.entries.append(entry)
        if lconf.transport == "tcp":
            self.reactor.add_reader(listener.fileno(), lambda: self._on_tcp(
                lconf, listener))  # type: ignore[arg-type]  # (tcp: a TcpListener)
            log.info("listening on %s (NVMe/TCP)", lconf.endpoint)
            return
        self.reactor.add_reader(listener.fileno(),
                                lambda: self._on_requests(lconf, provider,
                                                          listener))  # type: ignore[arg-type]
        log.info("listening on %s (%s provider)", lconf.endpoint, provider)

    def close_one(self, entry: Entry) -> None:
        """Stop accepting on one listener and close it."""
        timer = self._timers.pop(id(entry[2]), None)
        if timer is not None:
            timer.cancel()
        self.entries.remove(entry)
        self.reactor.remove_reader(entry[2].fileno())
        entry[2].close()

    def close(self) -> None:
        """Close every listener (the target is stopping)."""
        for _lconf, _provider, listener in self.entries:
            self.reactor.remove_reader(listener.fileno())
            listener.close()
        self.entries.clear()

    def rename(self, listeners: list[cfg.Listener]) -> None:
        """A reload's listener configurations replace those of the same identity (a renamed
        listener keeps its socket and its connections)."""
        renamed = {reload.listener_key(x): x for x in listeners}
        self.entries = [(renamed[reload.listener_key(lc)], p, li) for lc, p, li in self.entries]

    def now(self, lconf: cfg.Listener) -> cfg.Listener:
        """The listener's configuration as it is now (a reload may have changed its keys
        since a connection, or the listener's reader, took hold of ``lconf``)."""
        key = reload.listener_key(lconf)
        return next((lc for lc, _p, _l in self.entries if reload.listener_key(lc) == key), lconf)

    # -- rdma_cm -----------------------------------------------------------------------------
    def _on_requests(self, lconf: cfg.Listener, provider: str, listener: Listener) -> None:
        try:
            while True:
                cmid = listener.get_request(0)
                if cmid is None:
                    return
                try:
                    self._accept(lconf, provider, cmid)
                except ConnectionAbandoned as exc:
                    # The host timed out and went away before we took its request: nobody
                    # to refuse; the id goes (nothing of the queue was kept), the rest wait.
                    self.abandoned += 1
                    self._abandoned_log.note("connection request from %s abandoned (%d so "
                                             "far): %s", cmid.peer_address[0],
                                             self.abandoned, exc)
                    cmid.close()
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
            self._wake_at_deadline(lconf, provider, listener)

    @staticmethod
    def _reject_and_close(cmid: CMId) -> None:
        try:
            cmid.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
        except Exception:
            pass                # already accepted or closed: closing is all that is left
        cmid.close()

    def _wake_at_deadline(self, lconf: cfg.Listener, provider: str,
                          listener: Listener) -> None:
        """A listener has timed work (half-received requests to expire, a pause after
        running out of descriptors to end) that no readable fd announces: one timer per
        listener calls it back then."""
        when = listener.deadline()
        key = id(listener)
        timer = self._timers.get(key)
        if when is None or (timer is not None and not timer.cancelled and timer.when <= when):
            return
        if timer is not None:
            timer.cancel()

        def wake() -> None:
            self._timers.pop(key, None)
            if any(entry[2] is listener for entry in self.entries):
                self._on_requests(lconf, provider, listener)
        self._timers[key] = self.reactor.call_later(when - time.monotonic(), wake)

    def _accept(self, lconf: cfg.Listener, provider: str, cmid: CMId) -> None:
        limits = self._config().limits
        try:
            req = CMConnectRequest.unpack_from(cmid.private_data)
            req.check_limits(max_admin_depth=ADMIN_MAX_DEPTH, max_queue_size=limits.queue_size)
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
        session = self.new_session(lconf, provider, req)
        depth = req.hsqsize + 1
        pd = self.broker.pd_for(cmid)
        inline = limits.inline_data_size if req.qid else 0
        # One receive slot until the Fabrics Connect succeeds (QueueSession._connect posts
        # the rest before answering it): a peer that never proves to be a host costs one
        # capsule buffer, not a queue's worth.
        queue = TargetQueue(cmid, pd, qid=req.qid, depth=depth, inline_size=inline,
                            handler=session, name=f"{cmid.peer_address[0]} q{req.qid}",
                            recv_now=1)
        session.queue = queue
        queue.qp.max_unsent = limits.unsent_limit(depth, inline)
        queue.on_cm_event = lambda: self._on_cm_event(session)
        try:
            queue.post_all_receives()
            queue.attach(self.reactor)
        except BaseException:
            queue.close()       # its CQ, buffers and QP; the caller refuses the request
            raise
        self._admitted(session, limits.connect_timeout)
        try:
            cmid.accept(CMAccept(crqsize=depth).pack())
        except BaseException:
            # not a queue after all (the host gave up on it, or the CM refused): nothing of
            # it stays counted, registered or waiting for a Connect
            self.registry.close_queue(session)
            raise
        log.debug("accepted %s qid %d depth %d", cmid.peer_address, req.qid, depth)

    def _on_cm_event(self, session: QueueSession) -> None:
        reason = connection_end(session.queue)
        if reason is not None:
            self.registry.queue_broken(session, session.queue, reason)

    # -- NVMe/TCP ----------------------------------------------------------------------------
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
        limits = self._config().limits
        session = self.new_session(lconf, "tcp", None)
        queue = TcpTargetQueue(
            sock, self.broker.tcp_pd(), handler=session, inline_size=limits.inline_data_size,
            max_depth=lambda qid: ADMIN_MAX_DEPTH if qid == 0 else limits.queue_size,
            name=f"{peer[0]} tcp", cpda=self.now(lconf).cpda)
        queue.max_unsent = limits.unsent_limit(limits.queue_size, limits.inline_data_size)
        queue.data_timeout = lambda: float(self._config().limits.buffer_hold_timeout)
        session.queue = queue
        queue.attach(self.reactor)
        self._admitted(session, limits.connect_timeout)
        log.debug("accepted NVMe/TCP connection from %s", peer)

    # -- limits before the Connect -------------------------------------------------------------
    def _admitted(self, session: QueueSession, timeout: int) -> None:
        """A queue is accepted: counted, and disconnected unless its Connect comes in time."""
        self.registry.sessions.add(session)
        session.connect_timer = self.reactor.call_later(
            timeout, lambda: self._connect_timed_out(session, timeout))

    def _over_host_limit(self, cmid: CMId | _Peer) -> bool:
        """limits.max_connections_per_host, counted per peer address: at CM time the host
        NQN is not known yet, and a flood of bare connections must be stopped before it
        costs queue memory."""
        peer = cmid.peer_address[0]
        limit = self._config().limits.max_connections_per_host
        count = sum(1 for s in self.registry.sessions
                    if s.queue is not None and s.queue.cmid.peer_address[0] == peer)
        if count < limit:
            return False
        self._shed_log.note("rejecting connection from %s: NO_RESOURCES (%d connections from "
                            "that address, limits.max_connections_per_host is %d)", peer,
                            count, limit)
        return True

    def _over_unconnected_limit(self, cmid: CMId | _Peer) -> bool:
        """limits.max_unconnected_queues, across all addresses: queues accepted whose
        Fabrics Connect has not completed yet (each holds a socket, a QP and a receive slot
        until limits.connect_timeout)."""
        limit = self._config().limits.max_unconnected_queues
        count = sum(1 for s in self.registry.sessions if s.controller is None)
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
        if session.controller is not None or session not in self.registry.sessions:
            return
        log.info("disconnecting qid=%d from peer %s: no Fabrics Connect within %d s "
                 "(limits.connect_timeout)", session.qid, peer_of(session.queue), timeout)
        self.registry.close_queue(session)

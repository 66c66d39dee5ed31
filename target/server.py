"""The target: listeners, connection set-up, controllers, discovery, and the reactor.

A connection arrives as an rdma_cm connect request carrying the NVMe-oF private data
(qid, queue sizes).  It is checked, a :class:`~blockfabric.fabric.target_side.TargetQueue`
is made with one posted receive per SQ entry, and the connection is accepted.  The first
command on the queue must be a Fabrics Connect: on the admin queue it creates a controller
(or a discovery controller), on an I/O queue it joins the existing controller it names.

Teardown happens in one ordered place (:meth:`Target.close`); signal handlers only ask for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable

from blockfabric import __version__
from blockfabric.fabric.buffers import BufferPool
from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.target_side import Command, TargetQueue
from blockfabric.protocol import StatusCode
from blockfabric.protocol import logpages as lp
from blockfabric.protocol.cm import CMAccept, CMConnectRequest, CMReject, CMRejectStatus
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.controller import ControllerState, QueueState, admit
from blockfabric.protocol.fabrics import (CONNECT_DATA_SIZE, DISCOVERY_NQN, IATTR,
                                          IPO_DATA_CNTLID, IPO_DATA_HOSTNQN, IPO_DATA_SUBNQN,
                                          IPO_SQE_QID, IPO_SQE_SQSIZE, ConnectCommand,
                                          ConnectData,
                                          connect_invalid_param)
from blockfabric.rdma import PD, SGE, CMEventType, CMId, Listener, get_provider
from blockfabric.target import config as cfg
from blockfabric.target.controller import AERL, Controller
from blockfabric.target.namespace import Subsystem

log = logging.getLogger(__name__)

ADMIN_MAX_DEPTH = 32
CONTROL_SLOT = 4096
BOUNCE_SLOTS = 64
MAX_CNTLID = 0xFFEF


class QueueSession:
    """The command handler of one queue: Connect first, then its controller's logic."""

    def __init__(self, target: Target, listener: cfg.Listener, provider: str,
                 req: CMConnectRequest) -> None:
        self.target = target
        self.listener = listener
        self.provider = provider
        self.req = req
        self.qid = req.qid
        self.controller: Controller | None = None
        self.queue: TargetQueue | None = None

    def handle(self, cmd: Command) -> None:
        ctrl = self.controller
        if ctrl is not None:
            ctrl.handle(cmd)
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
            log.info("connect refused: host %r subsystem %r qid %d: %s (status %#x)",
                     _safe_nqn(view, 512), _safe_nqn(view, 256), self.qid, exc, exc.status)
            cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
            return
        self.controller = ctrl
        self.queue.sq_flow = not connect.sq_flow_control_disabled
        cmd.respond(result=ctrl.cntlid)

    def queue_broken(self, queue: TargetQueue, reason: str) -> None:
        self.target.queue_broken(self, queue, reason)


def _safe_nqn(view: memoryview, at: int) -> str:
    raw = bytes(view[at:at + 256]).split(b"\0", 1)[0]
    return raw.decode("utf-8", "replace")


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
        self._bounce: dict[int, BufferPool] = {}
        self._bounce_waiters: dict[int, list[Callable[[], None]]] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(4, "backend-io")
        self._started = threading.Event()
        self.genctr = 0
        try:
            for sub in config.subsystems:
                self.subsystems[sub.nqn] = Subsystem(sub)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listeners ---------------------------------------------------------------------
    def start(self) -> None:
        """Open every listener (all or nothing)."""
        try:
            for lconf in self.config.listeners:
                provider = get_provider(lconf.provider, lconf.address)
                listener = provider.listen(lconf.address, lconf.port)
                self.listeners.append((lconf, provider.name, listener))
                self.reactor.add_reader(listener.fileno(),
                                        lambda lc=lconf, p=provider.name, li=listener:
                                        self._on_requests(lc, p, li))
                log.info("listening on %s (%s provider)", lconf.endpoint, provider.name)
        except BaseException:
            self.close()
            raise
        self._started.set()

    def serve_forever(self) -> None:
        self.reactor.run_forever()

    def stop(self) -> None:
        self.reactor.stop()

    def _on_requests(self, lconf: cfg.Listener, provider: str, listener: Listener) -> None:
        while True:
            cmid = listener.get_request(0)
            if cmid is None:
                return
            try:
                self._accept(lconf, provider, cmid)
            except Exception:
                log.exception("connection set-up from %s failed", cmid.peer_address)
                try:
                    cmid.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
                except Exception:
                    pass
                cmid.close()

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
        session = QueueSession(self, lconf, provider, req)
        depth = req.hsqsize + 1
        pd = self.pd_for(cmid)
        inline = self.config.limits.inline_data_size if req.qid else 0
        queue = TargetQueue(cmid, pd, qid=req.qid, depth=depth, inline_size=inline,
                            handler=session, name=f"{cmid.peer_address[0]} q{req.qid}")
        session.queue = queue
        queue.on_cm_event = lambda: self._on_cm_event(session)
        queue.post_all_receives()
        queue.attach(self.reactor)
        self.sessions.add(session)
        cmid.accept(CMAccept(crqsize=depth).pack())
        log.debug("accepted %s qid %d depth %d", cmid.peer_address, req.qid, depth)

    def _on_cm_event(self, session: QueueSession) -> None:
        queue = session.queue
        while queue is not None and not queue.closed:
            event = queue.cmid.get_event(0)
            if event is None:
                return
            if event.type in (CMEventType.DISCONNECTED, CMEventType.DEVICE_REMOVAL):
                self.queue_broken(session, queue, "peer disconnected")
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

    def with_bounce(self, cmd: Command, length: int,
                    use: Callable[[memoryview, SGE, Callable[[Command], None]], None]) -> None:
        """Run ``use(view, sge, release)`` with a registered bounce buffer, waiting for one
        to be free if need be (file backends)."""
        pd = cmd.queue.pd
        pool = self._bounce.get(id(pd))
        if pool is None:
            pool = self._bounce[id(pd)] = BufferPool(pd, BOUNCE_SLOTS,
                                                     self.config.limits.mdts)
        index = pool.get()
        if index is None:
            self._bounce_waiters.setdefault(id(pd), []).append(
                lambda: self.with_bounce(cmd, length, use))
            return

        def release(_cmd: Command) -> None:
            pool.put(index)
            waiters = self._bounce_waiters.get(id(pd))
            if waiters:
                waiters.pop(0)()

        use(pool.views[index], pool.sge(index, length), release)

    def run_blocking(self, work: Callable[[], object],
                     finish: Callable[[BaseException | None], None]) -> None:
        """Run ``work`` on the I/O pool; ``finish(exc)`` runs back on the reactor."""
        def done(fut: concurrent.futures.Future) -> None:
            exc = fut.exception()
            self.reactor.call_soon_threadsafe(lambda: finish(exc))
        self.executor.submit(work).add_done_callback(done)

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
        subsystem = None
        if subnqn != DISCOVERY_NQN:
            subsystem = self.subsystems.get(subnqn)
            if subsystem is None or not self._exposed(subsystem, session.listener):
                raise connect_invalid_param(f"unknown subsystem {subnqn!r}", IATTR.DATA,
                                            IPO_DATA_SUBNQN)
            if not subsystem.allows(hostnqn):
                log.warning("host %r is not allowed on %s", hostnqn, subnqn)
                raise ProtocolError(f"host {hostnqn!r} not allowed",
                                    StatusCode.CONNECT_INVALID_HOST)
        if not hostnqn:
            raise connect_invalid_param("empty host NQN", IATTR.DATA, IPO_DATA_HOSTNQN)
        limits = self.config.limits
        if session.qid == 0:
            state = ControllerState.admin_connect(
                connect, data, cntlid=self._alloc_cntlid(), max_io_queues=limits.max_io_queues,
                cap=Controller.capabilities(limits.queue_size), aerl=AERL)
            ctrl = Controller(self, state, subsystem, hostnqn, data.hostid, session.provider)
            ctrl.queues[0] = session.queue
            self.controllers[ctrl.cntlid] = ctrl
            ctrl.start_keep_alive()
            log.info("%s: created (kato %d ms, via %s %s)", ctrl.name, ctrl.kato_ms,
                     session.provider, session.listener.endpoint)
            return ctrl
        ctrl = self.controllers.get(data.cntlid)
        if ctrl is None or ctrl.dead or ctrl.subsystem is not subsystem \
                or ctrl.hostnqn != hostnqn:
            raise connect_invalid_param(f"no controller {data.cntlid} for this host",
                                        IATTR.DATA, IPO_DATA_CNTLID)
        if not ctrl.ready:
            raise ProtocolError("I/O queue Connect before CC.EN", StatusCode.CMD_SEQ_ERROR)
        ctrl.state = ctrl.state.io_connect(connect, data)
        ctrl.queues[session.qid] = session.queue
        return ctrl

    def _exposed(self, subsystem: Subsystem, listener: cfg.Listener) -> bool:
        return listener in self.config.listeners_for(subsystem.conf)

    def _alloc_cntlid(self) -> int:
        for _ in range(MAX_CNTLID):
            cntlid = self._next_cntlid
            self._next_cntlid = cntlid % MAX_CNTLID + 1
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
        log.log(level, "%s q%d: %s", ctrl.name if ctrl else queue.name, queue.qid, reason)
        self._close_queue(session)
        if ctrl is not None:
            ctrl.queues.pop(queue.qid, None)
            ctrl.state = ctrl.state.disconnect(queue.qid)
            if queue.qid == 0:
                self.destroy_controller(ctrl, f"admin queue lost: {reason}")

    def _close_queue(self, session: QueueSession) -> None:
        queue = session.queue
        self.sessions.discard(session)
        if queue is not None:
            queue.close()

    def destroy_controller(self, ctrl: Controller, reason: str) -> None:
        if ctrl.dead:
            return
        ctrl.dead = True
        if ctrl.kato_timer is not None:
            ctrl.kato_timer.cancel()
        self.controllers.pop(ctrl.cntlid, None)
        for session in [s for s in self.sessions if s.controller is ctrl]:
            self._close_queue(session)
        ctrl.queues.clear()
        log.info("%s: destroyed (%s)", ctrl.name, reason)

    # -- discovery -------------------------------------------------------------------
    def discovery_log(self, ctrl: Controller) -> bytes:
        """The discovery log page for this host: subsystems it may use, on listeners of the
        provider it came in on."""
        entries = []
        for sub in self.subsystems.values():
            if not sub.allows(ctrl.hostnqn):
                continue
            for lconf, provider, _listener in self.listeners:
                if provider != ctrl.provider or lconf not in self.config.listeners_for(sub.conf):
                    continue
                entries.append(lp.DiscoveryLogEntry(
                    trtype=lp.TransportType.RDMA,
                    adrfam=lp.AddressFamily.IPV6 if ":" in lconf.address
                    else lp.AddressFamily.IPV4,
                    subtype=lp.SubsystemType.NVM, treq=0,
                    portid=self.config.listeners.index(lconf) + 1,
                    cntlid=0xFFFF, asqsz=ADMIN_MAX_DEPTH,
                    trsvcid=str(lconf.port), subnqn=sub.nqn, traddr=lconf.address,
                    tsas=lp.RdmaTsas()))
        return bytes(lp.pack_discovery_log(self.genctr, entries))

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
        self.executor.shutdown(wait=True)
        for sub in self.subsystems.values():
            self.flush_subsystem(sub)
            sub.close()
        self.subsystems.clear()
        for pool in list(self._control.values()) + list(self._bounce.values()):
            pool.close()
        self._control.clear()
        self._bounce.clear()
        for pd in self._pds.values():
            pd.close()
        self._pds.clear()
        self.reactor.close()


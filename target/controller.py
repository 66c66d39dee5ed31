"""The NVMe controller a host gets when it connects: admin, fabrics and I/O command logic.

Everything here runs on the target's reactor thread.  Backend file I/O goes to a small
thread pool (os.preadv/pwritev release the GIL) and comes back with
``reactor.call_soon_threadsafe``; memory volumes are moved by RDMA straight into and out of
their registered memory, with no copy and no thread hop.
"""

from __future__ import annotations

import errno
import logging
import time
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING, Callable

from blockfabric.fabric.reactor import Timer
from blockfabric.fabric.target_side import Command, TargetQueue
from blockfabric.logutil import printable
from blockfabric.protocol import StatusCode
from blockfabric.protocol import identify as idn
from blockfabric.protocol import io as nio
from blockfabric.protocol import logpages as lp
from blockfabric.protocol import auth as au
from blockfabric.protocol.admin import (OAES_ANA_CHANGE, OAES_DISCOVERY_CHANGE, OAES_NS_ATTR,
                                        AsyncEvent,
                                        AsyncEventType, AsyncNotice, GetFeatures, GetLogPage,
                                        Identify, NumberOfQueues, SetFeatures)
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.controller import ControllerState, Phase
from blockfabric.protocol.fabrics import CAP, VS, PropertyGet, PropertySet
from blockfabric.protocol.opcodes import (FABRICS_OPCODE, AdminOpcode, FabricsType,
                                          FeatureId, IdentifyCNS, IOOpcode, LogPageId)
from blockfabric.protocol.sgl import TYPE_OFFSET
from blockfabric.rdma import SGE
from blockfabric.protocol import resv as pr
from blockfabric.target import resvctl
from blockfabric.target.backends import Unavailable
from blockfabric.target.metrics import READ, WRITE, IoStats, done_pair

if TYPE_CHECKING:
    from blockfabric.target.fairshare import Lease
    from blockfabric.target.namespace import Namespace, Subsystem
    from blockfabric.target.services import Owner, Resources

log = logging.getLogger(__name__)

NVME_VERSION = VS(ter=0, mnr=3, mjr=1).to_int()  # NVMe 1.3, as nvmet reports
AERL = 3  # 0-based: four outstanding AERs at most (nvmet's value)
DISCOVERY_KATO_MS = 120_000  # a discovery controller connected with kato 0 (as nvmet)
#: Largest Authentication Send/Receive transfer taken (the Linux host uses 4 KiB; a Reply
#: with ffdhe8192 is 16 + 2 x 64 + 1024 bytes).
AUTH_MAX_TRANSFER = 16 * 1024

_ERRNO_STATUS = {
    errno.ERANGE: StatusCode.LBA_OUT_OF_RANGE,
    errno.EROFS: StatusCode.NS_WRITE_PROTECTED,
    errno.ENOSPC: StatusCode.CAPACITY_EXCEEDED,
    errno.EACCES: StatusCode.ACCESS_DENIED,
    errno.EPERM: StatusCode.ACCESS_DENIED,
    errno.EOPNOTSUPP: StatusCode.INVALID_OPCODE,
}


def errno_status(exc: OSError, writing: bool) -> StatusCode:
    """Map a backend error to an NVMe status, as nvmet's errno_to_nvme_status does."""
    status = _ERRNO_STATUS.get(exc.errno or 0)
    if status is not None:
        return status
    if exc.errno == errno.EIO:
        return StatusCode.WRITE_FAULT if writing else StatusCode.UNRECOVERED_READ_ERROR
    return StatusCode.INTERNAL_ERROR


def _no_auth(cmd: Command) -> ProtocolError:
    """Authentication Send/Receive from a host that is not asked to authenticate: what
    nvmet built without authentication answers (an unknown capsule type)."""
    return ProtocolError(f"fabrics command {cmd.sqe.fctype:#x}: this host has no "
                         "DH-HMAC-CHAP secret here", StatusCode.INVALID_OPCODE)


class Controller:
    """One host's controller on one subsystem (or on the discovery subsystem)."""

    def __init__(self, res: Resources, owner: Owner, state: ControllerState,
                 subsystem: Subsystem | None, hostnqn: str, hostid: bytes,
                 provider: str) -> None:
        self.res = res                      # buffers, threads, timers, limits (services.py)
        self.owner = owner                  # what it tells its daemon, and asks of it
        self.cntlid = state.cntlid
        kato_ms = state.kato
        self.subsystem = subsystem          # None: the discovery controller
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.provider = provider            # the RDMA provider the host came in on
        self.is_discovery = subsystem is None
        self.kato_ms = self._effective_kato(kato_ms)
        limits = res.limits
        self.queue_size = state.cap.mqes + 1      # the listener's queue_size, or the limit
        self.mdts_bytes = limits.mdts
        self.state = state                  # registers, phase, queues: the protocol's table
        self.aec = 0
        self.queues: dict[int, TargetQueue] = {}
        self.aers: list[Command] = []
        self.pending_events: list[int] = []
        self.changed_nsids: set[int] = set()
        self.resv = resvctl.CtrlResv()      # reservation notification log and masks
        self.error_count = 0
        self.created = time.time()
        self.last_activity = time.monotonic()
        self.kato_timer = None
        self.dead = False
        self.listener = None                # the cfg.Listener it came in on (set by connect)
        #: Set when the host's allow-list entry has a DH-HMAC-CHAP secret: then every queue
        #: authenticates (Connect answers ATR) before it runs anything but Fabrics commands.
        self.auth_policy: au.AuthPolicy | None = None
        self.auth: dict[int, au.TargetAuth] = {}
        #: Per queue: ends the queue (the admin queue: the controller) if it is not
        #: authenticated in time (limits.auth_timeout).
        self.auth_timers: dict[int, Timer] = {}
        self._auth_reported: set[au.TargetAuth] = set()
        self.auth_failures = 0
        self.peer = ""
        # The log context of every line about this controller (key=value, greppable); the
        # host NQN was checked at Connect, and is escaped all the same: it is the peer's.
        self._name = f"ctrl {self.cntlid} hostnqn={printable(hostnqn)} subnqn={self.subnqn}"
        # counters (host-visible through SMART, operator-visible through status/metrics)
        self.io = IoStats()
        self.admin_errors = 0
        # Bound once: what a Read/Write leaves on its command (no closure per I/O).
        self._unpin_cmd = self._unpin_rw
        self._write_fetched = self._written

    # The protocol's table, and what the per-I/O path reads of it as a plain bool.
    @property
    def state(self) -> ControllerState:
        return self._state

    @state.setter
    def state(self, state: ControllerState) -> None:
        self._state = state
        self.is_ready = state.phase is Phase.READY

    # -- identity --------------------------------------------------------------------
    @property
    def subnqn(self) -> str:
        return self.subsystem.nqn if self.subsystem else self.owner.discovery_nqn

    @property
    def name(self) -> str:
        """The log context of every line about this controller (key=value, greppable)."""
        return self._name

    @property
    def queue_depth_in_use(self) -> int:
        """Commands held by the target on all of this controller's queues (AERs included)."""
        return sum(q.outstanding for q in self.queues.values())

    @property
    def ready(self) -> bool:
        return self.is_ready

    @staticmethod
    def capabilities(queue_size: int) -> CAP:
        """CAP as advertised: NVM command set only (no CSI bit, so hosts select CSS 0 and do
        not ask for command-set specific Identify data this target does not serve)."""
        return CAP(mqes=queue_size - 1, cqr=True, to=15, css=CAP.CSS_NVM)

    # -- keep-alive ------------------------------------------------------------------
    def _effective_kato(self, requested_ms: int) -> int:
        """The keep-alive timeout the target enforces for a KATO the host asked for (Connect
        or Set Features): at most keep_alive.max_timeout_ms.  KATO 0 (the host sends no
        keep-alive) still ends a controller that sees no command at all for that long (a
        discovery controller: DISCOVERY_KATO_MS, as nvmet), so that no controller nobody
        uses lives for ever."""
        cap = self.res.keep_alive.max_timeout_ms
        if requested_ms == 0:
            requested_ms = DISCOVERY_KATO_MS if self.is_discovery else cap
        return min(requested_ms, cap)

    def start_keep_alive(self) -> None:
        if self.kato_ms:
            self.kato_timer = self.res.reactor.call_later(self.kato_ms / 1000,
                                                          self._check_keep_alive)

    def _check_keep_alive(self) -> None:
        if self.dead:
            return
        idle = time.monotonic() - self.last_activity
        if idle * 1000 >= self.kato_ms:
            log.warning("%s: keep-alive timeout kato_ms=%d idle_s=%.1f: tearing it down",
                        self.name, self.kato_ms, idle)
            self.owner.destroy_controller(self, "keep-alive expired")
            return
        self.kato_timer = self.res.reactor.call_later(
            self.kato_ms / 1000 - idle, self._check_keep_alive)

    # -- dispatch --------------------------------------------------------------------
    def handle(self, cmd: Command) -> None:
        """A command on one of this controller's queues (after Connect)."""
        if self.owner.draining:
            # Stopping: hold the command unanswered.  It was not executed, so the host may
            # retry it elsewhere or after a reconnect; it dies with the queue.
            return
        self.last_activity = monotonic()
        try:
            if cmd.rw:
                self._read_write(cmd)
                return
            self.state.admit(cmd.sqe, cmd.queue.qid)
            if cmd.queue.qid == 0:
                self._admin(cmd)
            else:
                self._io(cmd)
        except ProtocolError as exc:
            if cmd.opcode == FABRICS_OPCODE and exc.status == StatusCode.INVALID_NS:
                exc = _no_auth(cmd)     # on an I/O queue: its "nsid" was the fctype
            self._count_error(cmd)
            log.debug("%s qid=%d: cid %d opcode %#x: %s", self.name, cmd.queue.qid, cmd.cid,
                      cmd.opcode, exc)
            cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
        except Exception:
            # A bug here must not leave the host waiting for an answer that never comes.
            self._count_error(cmd)
            log.exception("%s qid=%d: cid %d opcode %#x: internal error", self.name,
                          cmd.queue.qid, cmd.cid, cmd.opcode)
            cmd.respond(StatusCode.INTERNAL_ERROR, dnr=True)

    # -- in-band authentication ----------------------------------------------------------
    def queue_handler(self, qid: int) -> Callable[[Command], None]:
        """What runs the commands of queue ``qid``: :meth:`handle` itself when the host does
        not authenticate (so that path costs nothing more), else a gate in front of it."""
        if self.auth_policy is None:
            return self.handle
        state = au.TargetAuth(self.auth_policy, self.hostnqn, self.subnqn)
        self.auth[qid] = state
        self._arm_auth_timer(self.queues[qid], state)
        return lambda cmd: self._gate(cmd, state)

    def _arm_auth_timer(self, queue: TargetQueue, auth: au.TargetAuth) -> None:
        """Within limits.auth_timeout the queue is authenticated (its Connect just now), or
        its failed exchange answered (a failure): else the queue ends (the admin queue: the
        controller).  nvmet resets an abandoned transaction after KATO (120 s without);
        here an unauthenticated queue holds a connection slot and may keep its controller
        alive with Fabrics commands, so it ends."""
        timeout = self.res.limits.auth_timeout
        old = self.auth_timers.pop(queue.qid, None)
        if old is not None:
            old.cancel()
        self.auth_timers[queue.qid] = self.res.reactor.call_later(
            timeout, lambda: self._auth_expired(queue, auth, timeout))

    def _auth_expired(self, queue: TargetQueue, auth: au.TargetAuth, timeout: int) -> None:
        qid = queue.qid
        if self.auth.get(qid) is not auth:      # the queue is gone, or connected again
            return
        self.auth_timers.pop(qid, None)
        if self.dead or queue.closed or auth.authenticated:
            return
        if not auth.failed:
            auth.reason = (f"not authenticated within {timeout} s of the Connect "
                           "(limits.auth_timeout)")
            auth.explanation = au.Explanation.FAILED
        self._auth_failed(queue, auth)
        self._end_auth(queue, f"authentication timed out on qid {qid}")

    def _auth_failed(self, queue: TargetQueue, auth: au.TargetAuth) -> None:
        """A queue's exchange failed: logged (its peer, the host NQN) and counted once per
        exchange, the moment it is known; the queue ends once the host has had the answer
        (Failure1), or after limits.auth_timeout if it never asks for it."""
        if auth in self._auth_reported:
            return
        self._auth_reported.add(auth)
        self.auth_failures += 1
        self.owner.auth_failed(self, queue, auth)
        if not auth.fatal:
            self._arm_auth_timer(queue, auth)

    def _end_auth(self, queue: TargetQueue, reason: str) -> None:
        """After a failed exchange: the admin queue takes the controller with it (as
        nvmet); an I/O queue goes alone, so that whoever joins a controller with a queue it
        cannot authenticate does not take down the host that owns it."""
        if queue.qid == 0:
            self.owner.destroy_controller(self, reason)
        else:
            self.owner.end_queue(queue, reason)

    def _gate(self, cmd: Command, auth: au.TargetAuth) -> None:
        """Authentication Send/Receive go to the queue's transaction; before it succeeded,
        everything else but Fabrics commands is AUTH_REQUIRED | DNR (nvmet_parse_admin_cmd,
        nvmet_parse_io_cmd)."""
        if cmd.opcode == FABRICS_OPCODE:
            fctype = cmd.sqe.fctype
            if fctype == FabricsType.AUTH_SEND or fctype == FabricsType.AUTH_RECEIVE:
                if self.owner.draining:
                    return
                self.last_activity = monotonic()
                try:
                    self._auth_command(cmd, auth)
                except ProtocolError as exc:
                    self._count_error(cmd)
                    log.debug("%s qid=%d: cid %d authentication command: %s", self.name,
                              cmd.queue.qid, cmd.cid, exc)
                    cmd.respond(exc.status, dnr=exc.dnr, result=exc.result or 0)
                return
        elif not auth.authenticated:
            self._count_error(cmd)
            cmd.respond(StatusCode.AUTH_REQUIRED, dnr=True)
            return
        self.handle(cmd)

    @staticmethod
    def _auth_fields(secp: int, spsp0: int, spsp1: int, length: int, what: str) -> None:
        if secp != au.SECP_DHCHAP or spsp0 != au.SPSP_DHCHAP or spsp1 != au.SPSP_DHCHAP:
            raise ProtocolError(f"authentication SECP {secp:#x} SPSP {spsp0:#x}/{spsp1:#x}: "
                                "only DH-HMAC-CHAP (0xe9, 1, 1)", StatusCode.INVALID_FIELD)
        if not 0 < length <= AUTH_MAX_TRANSFER:
            raise ProtocolError(f"authentication {what} {length}, not 1..{AUTH_MAX_TRANSFER}",
                                StatusCode.INVALID_FIELD)

    def _auth_command(self, cmd: Command, auth: au.TargetAuth) -> None:
        self.state.admit(cmd.sqe, cmd.queue.qid)
        if cmd.sqe.fctype == FabricsType.AUTH_SEND:
            send = au.AuthSend.from_sqe(cmd.sqe)
            self._auth_fields(send.secp, send.spsp0, send.spsp1, send.tl, "TL")
            if cmd.data_length != send.tl:
                raise ProtocolError(f"SGL length {cmd.data_length}, TL {send.tl}",
                                    StatusCode.SGL_DATA_LENGTH_INVALID)
            view, sge, release = self.res.control_buffer(cmd.queue, send.tl)
            cmd.on_released = release
            cmd.fetch(view, sge, lambda c: self._auth_sent(c, auth, bytes(view[:send.tl])))
            return
        receive = au.AuthReceive.from_sqe(cmd.sqe)
        self._auth_fields(receive.secp, receive.spsp0, receive.spsp1, receive.al, "AL")
        if cmd.data_length != receive.al:
            raise ProtocolError(f"SGL length {cmd.data_length}, AL {receive.al}",
                                StatusCode.SGL_DATA_LENGTH_INVALID)
        try:
            message = auth.receive(receive.al)
        except au.AuthError as exc:
            raise ProtocolError(str(exc), StatusCode.INVALID_FIELD) from exc
        if auth.failed:
            self._auth_failed(cmd.queue, auth)
        view, sge, release = self.res.control_buffer(cmd.queue, len(message))
        view[:len(message)] = message
        cmd.on_released = self._auth_release(cmd, auth, release)
        cmd.respond(data=(sge,))

    def _auth_sent(self, cmd: Command, auth: au.TargetAuth, message: bytes) -> None:
        was = auth.authenticated
        auth.send(message)
        if auth.failed:
            self._auth_failed(cmd.queue, auth)
        elif auth.authenticated and not was:
            timer = self.auth_timers.pop(cmd.queue.qid, None)
            if timer is not None:
                timer.cancel()
            both = message[1:2] == bytes([au.AuthMsg.SUCCESS2])
            log.info("%s qid=%d: host authenticated (hash %s, DH group %s)%s", self.name,
                     cmd.queue.qid, au.HASH_NAMES.get(auth.hash_id, auth.hash_id),
                     au.DHGROUP_NAMES.get(auth.dhgroup, auth.dhgroup),
                     "; it authenticated the controller too" if both else "")
        cmd.on_released = self._auth_release(cmd, auth, cmd.on_released)
        cmd.respond()

    def _auth_release(self, cmd: Command, auth: au.TargetAuth,
                      release: Callable[[Command], None] | None
                      ) -> Callable[[Command], None] | None:
        """What runs once the answer has been sent: after a failure, the end of the queue
        (:meth:`_end_auth`; nvmet_ctrl_fatal_error after Failure1 or a message out of
        sequence).  Set before the answer is posted: a provider may complete the send at
        once."""
        if not auth.fatal or self.dead:
            return release
        queue = cmd.queue
        reason = f"authentication failed on qid {queue.qid}"

        def released(c: Command) -> None:
            if release is not None:
                release(c)
            self.res.reactor.call_later(0, lambda: self._end_auth(queue, reason))

        return released

    def _count_error(self, cmd: Command) -> None:
        if cmd.queue.qid:
            self.io.errors += 1
        else:
            self.admin_errors += 1

    # -- admin -------------------------------------------------------------------------
    def _admin(self, cmd: Command) -> None:
        sqe = cmd.sqe
        op = sqe.opcode
        if op == FABRICS_OPCODE:
            self._fabrics(cmd)
        elif op == AdminOpcode.IDENTIFY:
            self._identify(cmd, Identify.from_sqe(sqe))
        elif op == AdminOpcode.GET_LOG_PAGE:
            self._get_log_page(cmd, GetLogPage.from_sqe(sqe))
        elif op == AdminOpcode.SET_FEATURES:
            self._set_features(cmd, SetFeatures.from_sqe(sqe))
        elif op == AdminOpcode.GET_FEATURES:
            self._get_features(cmd, GetFeatures.from_sqe(sqe))
        elif op == AdminOpcode.KEEP_ALIVE:
            cmd.respond()
        elif op == AdminOpcode.ASYNC_EVENT_REQUEST:
            self._aer(cmd)
        else:
            raise ProtocolError(f"admin opcode {op:#x} not supported",
                                StatusCode.INVALID_OPCODE)

    def _fabrics(self, cmd: Command) -> None:
        """Property Get/Set (admit() already refused every other fabrics command here but
        Authentication Send/Receive, which reach here only when the host has no secret)."""
        if cmd.sqe.fctype in (FabricsType.AUTH_SEND, FabricsType.AUTH_RECEIVE):
            raise _no_auth(cmd)
        if cmd.sqe.fctype == FabricsType.PROPERTY_GET:
            cmd.respond(result=self.state.property_get(PropertyGet.from_sqe(cmd.sqe)))
            return
        before = self.state
        self.state = before.property_set(PropertySet.from_sqe(cmd.sqe))
        phase = self.state.phase
        if phase is not before.phase:
            log.debug("%s: %s -> %s (CSTS %#x)", self.name, before.phase.value, phase.value,
                      self.state.csts.to_int())
        if phase in (Phase.DISABLED, Phase.SHUTTING_DOWN, Phase.FAILED) \
                and before.phase is Phase.READY:
            self._complete_aers(StatusCode.INTERNAL_ERROR)
        if phase is Phase.SHUTTING_DOWN:
            # Every command before this one has been answered or is in the backend pool;
            # flushing the volumes is what makes a normal shutdown safe.
            self.owner.flush_subsystem(self.subsystem)
            self.state = self.state.shutdown_complete()
        cmd.respond()

    def _complete_aers(self, status: StatusCode) -> None:
        """Answer every outstanding AER (the controller is going away or being reset)."""
        aers, self.aers = self.aers, []
        for aer in aers:
            self.state = self.state.complete_aer()
            aer.respond(status, dnr=True)

    # Identify ---------------------------------------------------------------------------
    def _identify(self, cmd: Command, ident: Identify) -> None:
        if ident.cns == IdentifyCNS.CONTROLLER:
            data = self.identify_controller().pack()
        elif self.is_discovery:
            raise ProtocolError(f"Identify CNS {ident.cns:#x} on a discovery controller",
                                StatusCode.INVALID_FIELD)
        elif ident.cns == IdentifyCNS.NAMESPACE:
            data = self._identify_namespace(ident.nsid)
        elif ident.cns == IdentifyCNS.ACTIVE_NS_LIST:
            if ident.nsid >= 0xFFFFFFFE:
                raise ProtocolError("active namespace list from NSID >= 0xFFFFFFFE",
                                    StatusCode.INVALID_NS)
            nsids = tuple(n for n in sorted(self.subsystem.namespaces) if n > ident.nsid)
            data = idn.ActiveNamespaceList(nsids=nsids[:1024]).pack()
        elif ident.cns == IdentifyCNS.NS_ID_DESCRIPTORS:
            ns = self._namespace(ident.nsid)
            data = idn.NamespaceIdDescriptorList.of(
                [(idn.NidType.NGUID, ns.nguid), (idn.NidType.UUID, ns.uuid),
                 (idn.NidType.CSI, b"\0")]).pack()
        else:  # pragma: no cover - Identify.from_sqe refuses other CNS values
            raise ProtocolError(f"Identify CNS {ident.cns:#x}", StatusCode.INVALID_FIELD)
        self.send_data(cmd, data)

    def identify_controller(self) -> idn.IdentifyController:
        limits = self.res.limits
        sub = self.subsystem
        inline = limits.inline_data_size
        # CMIC: a subsystem takes any number of controllers (hosts, and a host's paths),
        # through every listener; the Linux host refuses a second controller of a subsystem
        # whose CMIC lacks bit 1.  A gateway group adds the ANA bit.
        cmic = idn.CMIC_MULTI_PORT | idn.CMIC_MULTI_CTRL if sub else 0
        ana = self.owner.ana.identify() if self.owner.ana and sub else {"cmic": cmic}
        return idn.IdentifyController(
            vid=0, ssvid=0,
            sn=sub.serial if sub else self.owner.discovery_serial,
            mn=sub.model if sub else "blockfabric discovery",
            fr=self.owner.firmware_revision,
            rab=6,
            mdts=(self.mdts_bytes // 4096).bit_length() - 1,
            cntlid=self.cntlid, ver=NVME_VERSION,
            oaes=self._oaes(),
            ctratt=pr.CTRATT_HOSTID_128,
            cntrltype=idn.CNTRLTYPE_DISCOVERY if self.is_discovery else idn.CNTRLTYPE_IO,
            acl=3, aerl=AERL, frmw=3, lpa=0, elpe=0,
            kas=self.res.keep_alive.kas_ms // 100,
            sqes=0x66, cqes=0x44, maxcmd=self.queue_size,
            nn=0 if self.is_discovery else 1024,
            oncs=(0 if self.is_discovery else
                  idn.ONCS_DSM | idn.ONCS_WRITE_ZEROES | pr.ONCS_RESERVATIONS),
            vwc=0 if self.is_discovery else 1,
            sgls=idn.SGLS_SUPPORTED | idn.SGLS_KEYED | idn.SGLS_OFFSET,
            subnqn=sub.nqn if sub else self.owner.discovery_nqn,
            ioccsz=(64 + inline) // 16, iorcsz=1, icdoff=0, fcatt=0, msdbd=1,
            **ana)

    def _oaes(self) -> int:
        """The asynchronous events this controller can send (Identify OAES)."""
        if self.is_discovery:
            return OAES_DISCOVERY_CHANGE
        return OAES_NS_ATTR | (OAES_ANA_CHANGE if self.owner.ana else 0)

    def _namespace(self, nsid: int) -> Namespace:
        ns = self.subsystem.namespaces.get(nsid) if self.subsystem else None
        if ns is None:
            raise ProtocolError(f"namespace {nsid} is not active", StatusCode.INVALID_NS)
        return ns

    def _identify_namespace(self, nsid: int) -> bytes:
        if nsid == 0xFFFFFFFF or nsid == 0:
            raise ProtocolError(f"Identify Namespace NSID {nsid:#x}", StatusCode.INVALID_NS)
        ns = self.subsystem.namespaces.get(nsid)
        if ns is None:
            return bytes(idn.IDENTIFY_SIZE)  # an inactive NSID: the all-zero page
        return idn.IdentifyNamespace(
            nsze=ns.nblocks, ncap=ns.nblocks, nuse=ns.nblocks, nlbaf=0, flbas=0,
            nmic=1, rescap=resvctl.rescap(ns), anagrpid=ns.ana_group, dlfeat=1, nsattr=idn.NSATTR_WRITE_PROTECTED if ns.read_only else 0,
            nguid=ns.nguid, eui64=bytes(8),
            lbaf=(idn.LBAFormat(ms=0, ds=ns.block_size.bit_length() - 1, rp=0),),
        ).pack()

    # Log pages ----------------------------------------------------------------------------
    def _get_log_page(self, cmd: Command, glp: GetLogPage) -> None:
        lid = glp.lid
        # NUMD asks for up to 16 GiB: checked against the SGL and MDTS before anything is
        # built, and whatever lies past the page is zeros that cost no memory (send_data).
        self._check_length(cmd, glp.length)
        if lid == LogPageId.DISCOVERY:
            if not self.is_discovery:
                raise ProtocolError("discovery log page on an NVM controller",
                                    StatusCode.INVALID_LOG_PAGE)
            page = self.owner.discovery_log(self)
        elif self.is_discovery:
            raise ProtocolError(f"log page {lid:#x} on a discovery controller",
                                StatusCode.INVALID_LOG_PAGE)
        elif lid == LogPageId.ERROR:
            page = bytes(64)
        elif lid == LogPageId.SMART:
            io = self.io
            page = lp.SmartLog(data_units_read=-(-io.bytes[READ] // 512000),
                               data_units_written=-(-io.bytes[WRITE] // 512000),
                               host_reads=io.ops[READ], host_writes=io.ops[WRITE],
                               temperature=300).pack()
        elif lid == LogPageId.CHANGED_NS:
            nsids = sorted(self.changed_nsids)
            self.changed_nsids.clear()
            page = lp.ChangedNamespaceList(nsids=tuple(nsids[:1024])).pack()
        elif lid == LogPageId.FW_SLOT:
            page = bytes(512)
        elif lid == LogPageId.ANA and self.owner.ana is not None:
            page = self.owner.ana.log_page(self, rgo=bool(glp.lsp & lp.ANA_LSP_RGO),
                                            retain=glp.rae)
        elif lid == LogPageId.RESV_NOTIFY:
            page = self.resv.next_page()
        else:
            raise ProtocolError(f"log page {lid:#x} not supported", StatusCode.INVALID_LOG_PAGE)
        if glp.lpo > len(page):
            raise ProtocolError(f"log page offset {glp.lpo} beyond {len(page)} bytes",
                                StatusCode.INVALID_FIELD)
        self.send_data(cmd, page[glp.lpo:glp.lpo + glp.length], glp.length)

    # Features -----------------------------------------------------------------------------
    def _set_features(self, cmd: Command, sf: SetFeatures) -> None:
        if sf.save:
            raise ProtocolError("features are not saveable", StatusCode.FEATURE_NOT_SAVEABLE)
        if sf.fid == FeatureId.NUM_QUEUES:
            self.state, granted = self.state.set_number_of_queues(
                NumberOfQueues.from_int(sf.value))
            cmd.respond(result=granted.to_int())
        elif sf.fid == FeatureId.KATO:
            self.kato_ms = self._effective_kato(sf.value)
            if self.kato_timer is not None:
                self.kato_timer.cancel()
                self.kato_timer = None
            self.start_keep_alive()
            cmd.respond()
        elif sf.fid == FeatureId.ASYNC_EVENT:
            self.aec = sf.value & self._oaes()
            cmd.respond()
        elif sf.fid == FeatureId.HOST_ID:
            raise ProtocolError("host identifier is set by Connect", StatusCode.CMD_SEQ_ERROR)
        elif sf.fid in (FeatureId.RESV_MASK, FeatureId.RESV_PERSIST) and not self.is_discovery:
            resvctl.set_feature(self, cmd, sf.fid, sf.nsid, sf.value)
        else:
            raise ProtocolError(f"Set Features {sf.fid:#x} not supported",
                                StatusCode.INVALID_FIELD)

    def _get_features(self, cmd: Command, gf: GetFeatures) -> None:
        if gf.fid == FeatureId.NUM_QUEUES:
            n = (self.state.granted_io_queues or self.state.max_io_queues) - 1
            cmd.respond(result=NumberOfQueues(nsqr=n, ncqr=n).to_int())
        elif gf.fid == FeatureId.KATO:
            cmd.respond(result=self.kato_ms)
        elif gf.fid == FeatureId.ASYNC_EVENT:
            cmd.respond(result=self.aec)
        elif gf.fid == FeatureId.VOLATILE_WC:
            cmd.respond(result=0 if self.is_discovery else 1)
        elif gf.fid == FeatureId.HOST_ID:
            if not gf.value & 1:        # EXHID: only the 128-bit identifier exists here
                raise ProtocolError("Get Features host identifier without EXHID",
                                    StatusCode.INVALID_FIELD)
            self.send_data(cmd, self.hostid)
        elif gf.fid in (FeatureId.RESV_MASK, FeatureId.RESV_PERSIST) and not self.is_discovery:
            resvctl.get_feature(self, cmd, gf.fid, gf.nsid)
        else:
            raise ProtocolError(f"Get Features {gf.fid:#x} not supported",
                                StatusCode.INVALID_FIELD)

    # Asynchronous events --------------------------------------------------------------
    def _aer(self, cmd: Command) -> None:
        self.state = self.state.submit_aer()
        self.aers.append(cmd)
        self._deliver_events()

    def notify(self, info: int, log_page: int, nsids: tuple[int, ...] = ()) -> None:
        """Queue a notice event (and the namespaces it is about); deliver if an AER waits."""
        enabled = {AsyncNotice.NS_ATTR_CHANGED: OAES_NS_ATTR,
                   AsyncNotice.ANA_CHANGE: OAES_ANA_CHANGE,
                   AsyncNotice.DISCOVERY_CHANGE: OAES_DISCOVERY_CHANGE}.get(info, 0)
        if not self.aec & enabled:
            return
        self.changed_nsids.update(nsids)
        event = AsyncEvent(event_type=AsyncEventType.NOTICE, info=info,
                           log_page=log_page).to_int()
        if event not in self.pending_events:
            self.pending_events.append(event)
        self._deliver_events()

    def notify_resv(self) -> None:
        """A reservation notification log entry was queued: AEN type 6 (not subject to
        Set Features 0x0B, as nvmet's NVME_AER_CSS events)."""
        if pr.AEN_RESV not in self.pending_events:
            self.pending_events.append(pr.AEN_RESV)
        self._deliver_events()

    def _deliver_events(self) -> None:
        while self.aers and self.pending_events:
            self.state = self.state.complete_aer()
            self.aers.pop(0).respond(result=self.pending_events.pop(0))

    # -- data out for admin commands -----------------------------------------------------
    def _check_length(self, cmd: Command, length: int) -> None:
        """A transfer length the host put in the command: it must be what the SGL describes
        and at most MDTS, checked before anything of that size exists."""
        if cmd.data_length != length:
            raise ProtocolError(f"SGL length {cmd.data_length}, the command asks for "
                                f"{length} bytes", StatusCode.SGL_DATA_LENGTH_INVALID)
        self._check_mdts(length)

    def _check_mdts(self, length: int) -> None:
        if length > self.mdts_bytes:
            raise ProtocolError(f"{length} bytes exceeds MDTS {self.mdts_bytes}",
                                StatusCode.INVALID_FIELD)

    def send_data(self, cmd: Command, data: bytes, length: int | None = None) -> None:
        """Respond with ``data`` RDMA-written into the host's buffer (an admin command),
        followed by zeros up to ``length`` (checked by :meth:`_check_length`) from the
        target's shared zero region."""
        if length is None:
            length = len(data)
            self._check_length(cmd, length)
        view, sge, release = self.res.control_buffer(cmd.queue, len(data))
        view[:len(data)] = data
        cmd.on_released = release
        sges = (sge,) if data else ()
        if length > len(data):
            sges += (self.res.zeros(cmd.queue, length - len(data)),)
        cmd.respond(data=sges)

    # -- I/O ---------------------------------------------------------------------------
    def _io(self, cmd: Command) -> None:
        sqe = cmd.sqe
        op = sqe.opcode
        nss = self._io_namespace(sqe.nsid, flush=op == IOOpcode.FLUSH)
        if nss[0].ana_status:       # this path may not serve it now (ANA): try another
            raise ProtocolError(f"namespace {sqe.nsid}: ANA group {nss[0].ana_group} is "
                                "inaccessible on this gateway", nss[0].ana_status, dnr=False)
        if any(ns.paused for ns in nss):
            # A namespace is being resized: run the command once it is done.
            next(ns for ns in nss if ns.paused).held.append(lambda: self.handle(cmd))
            return
        if op in pr.OPCODES:
            resvctl.execute(self, cmd, nss[0])
            return
        resvctl.check_io(self, nss, op)
        if op == IOOpcode.READ or op == IOOpcode.WRITE:
            # Decoded in full rather than by the queue's fast path: the same handler.
            cmd.slba = sqe.cdw10 | sqe.cdw11 << 32
            cmd.cdw12 = sqe.cdw12
            self._read_write(cmd)
        elif op == IOOpcode.FLUSH:
            self._backend_call(cmd, nss, lambda: [n.backend.flush() for n in nss], True,
                               blocking=True, aio=self._aio(nss, "flush"))
        elif op == IOOpcode.WRITE_ZEROES:
            wz = nio.WriteZeroes.from_sqe(sqe)
            ns = nss[0]
            self._check_range(ns, wz.slba, wz.blocks, write=True)
            off, length = wz.slba * ns.block_size, wz.blocks * ns.block_size
            self._backend_call(cmd, nss, lambda: ns.backend.write_zeroes(off, length), True,
                               blocking=ns.memory is None,
                               aio=self._aio(nss, "write_zeroes", off, length))
        elif op == IOOpcode.DATASET_MANAGEMENT:
            self._dsm(cmd, nss[0], nio.DatasetManagement.from_sqe(sqe))
        elif op == FABRICS_OPCODE:
            raise _no_auth(cmd)
        else:
            raise ProtocolError(f"I/O opcode {op:#x} not supported", StatusCode.INVALID_OPCODE)

    def _io_namespace(self, nsid: int, flush: bool = False) -> list[Namespace]:
        if flush and nsid == 0xFFFFFFFF:
            return list(self.subsystem.namespaces.values())
        ns = self.subsystem.namespaces.get(nsid)
        if ns is None:
            raise ProtocolError(f"namespace {nsid} is not active", StatusCode.INVALID_NS)
        return [ns]

    @staticmethod
    def _check_range(ns: Namespace, slba: int, blocks: int, write: bool) -> None:
        if slba + blocks > ns.nblocks:
            raise ProtocolError(f"LBA {slba}+{blocks} beyond {ns.nblocks} blocks",
                                StatusCode.LBA_OUT_OF_RANGE)
        if write and ns.read_only:
            raise ProtocolError(f"namespace {ns.nsid} is read-only",
                                StatusCode.NS_WRITE_PROTECTED)

    # Every command that touches a namespace's backend is counted in flight from _begin to
    # _end: a resize or removal waits for that count to reach zero before it touches the
    # volume, and a drain waits for it before flushing.
    def _begin(self, nss: list[Namespace]) -> int:
        for ns in nss:
            ns.stats.inflight += 1
        self.io.inflight += 1
        return perf_counter_ns()

    def _unpin(self, nss: list[Namespace]) -> None:
        for ns in nss:
            ns.stats.inflight -= 1
        self.io.inflight -= 1

    def _end(self, cmd: Command, nss: list[Namespace], started: int,
             status: int = StatusCode.SUCCESS, *, dnr: bool = False,
             data: tuple[SGE, ...] = (), rw: int | None = None, nbytes: int = 0,
             pinned: bool = False) -> None:
        """Count and answer; ``pinned``: the answer's RDMA WRITE reads the volume's memory,
        so the command stays in flight until its response SEND completes."""
        ok = status == StatusCode.SUCCESS
        if not pinned:
            self._unpin(nss)
        for ns in nss:
            if rw is not None:
                ns.stats.done(rw, nbytes, started, ok)
            elif not ok:
                ns.stats.errors += 1
        io = self.io
        if rw is not None:
            io.done(rw, nbytes, started, ok)
        elif not ok:
            io.errors += 1
        cmd.user = None                         # answered: nothing left to undo
        cmd.respond(status, dnr=dnr, data=data)
        if not cmd.responded:       # the queue closed under it: no SEND will release it
            release, cmd.on_released = cmd.on_released, None
            if release is not None:
                release(cmd)

    # Read and Write: the per-I/O path.  The checks and statuses of nvmet (and of the rest of
    # this class), in its order: controller ready, namespace active, SGL length, MDTS, LBA
    # range, write protection; made on the ints the queue decoded, with no exception, object
    # or closure on the way of a success.
    def _read_write(self, cmd: Command) -> None:
        if not self.is_ready:
            self._refuse(cmd, StatusCode.CMD_SEQ_ERROR,
                         f"opcode {cmd.opcode:#x} before CC.EN=1 and CSTS.RDY=1")
            return
        ns = self.subsystem.namespaces.get(cmd.nsid)
        if ns is None:
            self._refuse(cmd, StatusCode.INVALID_NS, f"namespace {cmd.nsid} is not active")
            return
        if ns.ana_status:   # this path may not serve it now (ANA): the host tries another
            self.io.errors += 1
            cmd.queue.respond(cmd, ns.ana_status)
            return
        if ns.paused:
            # A namespace is being resized: run the command once it is done.
            ns.held.append(lambda: self.handle(cmd))
            return
        write = cmd.opcode == IOOpcode.WRITE
        if not ns.resv_open:        # something is reserved: may this host read/write?
            status = resvctl.io_status(self, ns, write)
            if status:
                self.io.errors += 1
                cmd.queue.respond(cmd, status, dnr=status == resvctl.CONFLICT)
                return
        bs = ns.block_size
        blocks = (cmd.cdw12 & 0xFFFF) + 1
        length = blocks * bs
        if cmd.data_length != length:
            self._refuse(cmd, StatusCode.SGL_DATA_LENGTH_INVALID,
                         f"SGL length {cmd.data_length} for {blocks} blocks of {bs}")
            return
        if length > self.mdts_bytes:
            self._refuse(cmd, StatusCode.INVALID_FIELD,
                         f"{length} bytes exceeds MDTS {self.mdts_bytes}")
            return
        slba = cmd.slba
        if slba + blocks > ns.nblocks:
            self._refuse(cmd, StatusCode.LBA_OUT_OF_RANGE,
                         f"LBA {slba}+{blocks} beyond {ns.nblocks} blocks")
            return
        if write and ns.read_only:
            self._refuse(cmd, StatusCode.NS_WRITE_PROTECTED,
                         f"namespace {ns.nsid} is read-only")
            return
        offset = slba * bs
        queue = cmd.queue
        mr = ns.mr(queue.pd)
        # In flight from here to the answer (see _begin); for a read from the volume's
        # memory until its response SEND completed (its RDMA WRITE reads the volume).
        ns.stats.inflight += 1
        self.io.inflight += 1
        cmd.ns = ns
        started = cmd.started = perf_counter_ns()
        if mr is None:
            cmd.user = self._unpin_cmd          # undo, should the queue die before the answer
            self.res.with_bounce(cmd, self.hostnqn, length, lambda view, sge, lease:
                                    self._bounce_rw(cmd, ns, offset, length, write, view, sge,
                                                    lease, started))
            return
        if not write:                           # zero copy: RDMA WRITE out of the volume
            cmd.on_released = self._unpin_cmd
            done_pair(ns.stats, self.io, READ, length, started)
            queue.respond_ok(cmd, mr.addr + offset, length, mr.lkey)
            if not cmd.responded:   # the queue closed under it: no SEND will release it
                cmd.on_released = None
                self._unpin_rw(cmd)
            return
        if cmd.sgl_type == TYPE_OFFSET:         # in-capsule data: copied, done
            queue.take_inline(cmd, ns.memory, offset, length)
            self._written(cmd)
            return
        cmd.user = self._unpin_cmd              # undo, should the queue die before the READ
        queue.fetch_to(cmd, mr.addr + offset, length, mr.lkey, self._write_fetched)

    def _written(self, cmd: Command) -> None:
        """A write's data is in the volume's memory: count and answer."""
        ns = cmd.ns
        ns.stats.inflight -= 1
        self.io.inflight -= 1
        cmd.user = None
        done_pair(ns.stats, self.io, WRITE, cmd.data_length, cmd.started)
        cmd.queue.respond_ok(cmd)

    def _unpin_rw(self, cmd: Command) -> None:
        """A Read/Write's namespace is no longer in flight (answered, or never will be)."""
        cmd.ns.stats.inflight -= 1
        self.io.inflight -= 1

    def _refuse(self, cmd: Command, status: StatusCode, why: str) -> None:
        """Answer a Read/Write with an error status (DNR), as :meth:`handle` answers a
        ProtocolError."""
        self.io.errors += 1
        log.debug("%s qid=%d: cid %d opcode %#x: %s", self.name, cmd.queue.qid, cmd.cid,
                  cmd.opcode, why)
        cmd.queue.respond(cmd, status, dnr=True)

    def _bounce_rw(self, cmd: Command, ns: Namespace, offset: int, length: int, write: bool,
                   view: memoryview, sge: SGE, lease: Lease, started: int) -> None:
        cmd.on_released = lease.release
        part = view[:length]
        direction = WRITE if write else READ
        if write:
            cmd.fetch(part, sge, lambda c: self._backend_call(
                c, [ns], lambda: ns.backend.write(offset, part), True, blocking=True,
                started=started, rw=direction, nbytes=length, lease=lease,
                aio=self._aio([ns], "write", offset, part)))
        else:
            self._backend_call(cmd, [ns], lambda: ns.backend.readinto(offset, part), False,
                               blocking=True, data=(sge,), started=started, rw=direction,
                               nbytes=length, lease=lease,
                               aio=self._aio([ns], "readinto", offset, part))

    def _dsm(self, cmd: Command, ns: Namespace, dsm: nio.DatasetManagement) -> None:
        nranges = dsm.ranges
        # At least the ranges, as nvmet checks (data length <= transfer length): the Linux
        # host sends one range in a whole 4 KiB page.
        if cmd.data_length < dsm.data_length:
            raise ProtocolError(f"SGL length {cmd.data_length} for {nranges} DSM ranges",
                                StatusCode.SGL_DATA_LENGTH_INVALID)
        self._check_mdts(cmd.data_length)
        if not dsm.ad:
            cmd.respond()
            return
        if ns.read_only:
            raise ProtocolError(f"namespace {ns.nsid} is read-only",
                                StatusCode.NS_WRITE_PROTECTED)
        # Only the ranges are read (at most 256 x 16 bytes), however long the SGL is.
        view, sge, release = self.res.control_buffer(cmd.queue, dsm.data_length)
        cmd.on_released = release
        started = self._begin([ns])
        cmd.user = lambda _c: self._unpin([ns])

        def fetched(c: Command) -> None:
            try:
                ranges = [(r.slba, r.nlb) for r in nio.DSMRange.iter_from(view, nranges)]
                for slba, nlb in ranges:
                    self._check_range(ns, slba, nlb, write=True)
            except ProtocolError as exc:
                self._end(c, [ns], started, exc.status, dnr=exc.dnr)
                return
            bs = ns.block_size
            self._backend_call(c, [ns], lambda: [ns.backend.discard(s * bs, n * bs)
                                                 for s, n in ranges if n], True,
                               blocking=ns.memory is None, started=started,
                               aio=self._aio([ns], "discard",
                                             [(s * bs, n * bs) for s, n in ranges]))

        cmd.fetch(view, sge, fetched)

    def _aio(self, nss: list[Namespace], op: str, *args: object
             ) -> Callable[[Callable[[BaseException | None], None]], None] | None:
        """The asynchronous form of ``op`` when the namespace's backend has one (RBD), else
        None (the backend threads run the synchronous form)."""
        if len(nss) != 1 or not nss[0].backend.aio:
            return None
        backend, post = nss[0].backend, self.res.reactor.call_soon_threadsafe
        return lambda done: backend.start(post, done, op, *args)

    def _backend_call(self, cmd: Command, nss: list[Namespace], work: Callable[[], object],
                      writing: bool, *, blocking: bool, data: tuple[SGE, ...] = (),
                      started: int | None = None, rw: int | None = None,
                      nbytes: int = 0, lease: Lease | None = None,
                      aio: Callable[[Callable[[BaseException | None], None]], None] | None
                      = None) -> None:
        """Run ``work`` (inline, or on the I/O pool when it may block) and respond;
        ``lease``: the bounce buffer, whose wait on the host starts again with the answer;
        ``aio``: instead of ``work``, start the operation on an asynchronous backend (see
        :meth:`_aio`), which calls back on the reactor."""
        if started is None:
            started = self._begin(nss)

        def finish(exc: BaseException | None) -> None:
            if lease is not None:
                lease.on_wire()
            if exc is None:
                self._end(cmd, nss, started, data=data, rw=rw, nbytes=nbytes)
            elif isinstance(exc, OSError):
                if isinstance(exc, Unavailable):        # the store does not answer
                    self.res.volume_lost(nss, exc)
                status = errno_status(exc, writing)
                log.warning("%s: backend error %s -> %s", self.name, exc, status.name)
                self._end(cmd, nss, started, status, dnr=status != StatusCode.INTERNAL_ERROR,
                          rw=rw, nbytes=nbytes)
            else:
                log.error("%s: backend failure: %r", self.name, exc)
                self._end(cmd, nss, started, StatusCode.INTERNAL_ERROR, rw=rw,
                          nbytes=nbytes)

        if aio is not None:
            try:
                aio(finish)
            except Exception as exc:
                finish(exc)
            return
        if not blocking:
            try:
                work()
            except Exception as exc:
                finish(exc)
            else:
                finish(None)
            return
        self.res.run_blocking(work, finish, self.hostnqn)

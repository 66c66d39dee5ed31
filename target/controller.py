"""The NVMe controller a host gets when it connects: admin, fabrics and I/O command logic.

Its parts, imported one way (controller -> ctrl_io -> ctrl_auth; none imports this module):
here its state, keep-alive, dispatch and admin commands; :mod:`ctrl_auth` the DH-HMAC-CHAP
gate; :mod:`ctrl_io` the I/O commands.  What it may use of the daemon comes in as two small
objects (:mod:`services`), never the daemon itself.

Everything here runs on the target's reactor thread.  Backend file I/O goes to a small
thread pool (os.preadv/pwritev release the GIL) and comes back with
``reactor.call_soon_threadsafe``; memory volumes are moved by RDMA straight into and out of
their registered memory, with no copy and no thread hop.

Longer than ~500 lines because the controller's state, its dispatch and its admin and
fabrics commands read the same fields on every command; its I/O commands and its
authentication, which need none of the admin side, are already apart.
"""

from __future__ import annotations

import logging
import time
from time import monotonic
from typing import TYPE_CHECKING

from blockfabric.fabric.reactor import Timer
from blockfabric.fabric.target_side import Command
from blockfabric.logutil import printable
from blockfabric.protocol import StatusCode
from blockfabric.protocol import identify
from blockfabric.protocol import logpages
from blockfabric.protocol import auth
from blockfabric.protocol.admin import (OAES_ANA_CHANGE, OAES_DISCOVERY_CHANGE, OAES_NS_ATTR,
                                        AsyncEvent,
                                        AsyncEventType, AsyncNotice, GetFeatures, GetLogPage,
                                        Identify, NumberOfQueues, SetFeatures)
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.controller import ControllerState, Phase
from blockfabric.protocol.fabrics import CAP, VS, PropertyGet, PropertySet
from blockfabric.protocol.opcodes import (FABRICS_OPCODE, AdminOpcode, FabricsType,
                                          FeatureId, IdentifyCNS, LogPageId)
from blockfabric.protocol import resv
from blockfabric.target import resvctl
from blockfabric.target.ctrl_auth import AuthGate, no_auth
from blockfabric.target.ctrl_io import IoCommands
from blockfabric.target.ctrl_io import errno_status as errno_status  # public, as before
from blockfabric.target.metrics import READ, WRITE, IoStats

if TYPE_CHECKING:
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.rdma import SGE
    from blockfabric.target import config as cfg
    from blockfabric.target.namespace import Namespace, Subsystem
    from blockfabric.target.services import Owner, Resources

log = logging.getLogger(__name__)

_CHANGED_NS_SIZE = len(logpages.ChangedNamespaceList(nsids=()).pack())
_RESV_NOTIFY_SIZE = len(resv.NotificationLog(0, 0, 0, 0).pack())
#: Get Features of these mandatory features answers 0 (nothing to set here): arbitration,
#: power management, temperature threshold, error recovery, write atomicity normal
_ZERO_FEATURES = frozenset((0x01, 0x02, 0x04, 0x05, 0x0A))
_AEC_KNOWN = OAES_NS_ATTR | OAES_ANA_CHANGE | OAES_DISCOVERY_CHANGE


def _check_offset(lpo: int, size: int) -> None:
    """A log page offset past the page's ``size`` bytes: Invalid Field."""
    if lpo > size:
        raise ProtocolError(f"log page offset {lpo} beyond {size} bytes",
                            StatusCode.INVALID_FIELD)


NVME_VERSION = VS(ter=0, mnr=3, mjr=1).to_int()  # NVMe 1.3, as nvmet reports
AERL = 3  # 0-based: four outstanding AERs at most (nvmet's value)
DISCOVERY_KATO_MS = 120_000  # a discovery controller connected with kato 0 (as nvmet)


class Controller(AuthGate, IoCommands):
    """One host's controller on one subsystem (or on the discovery subsystem): its state,
    keep-alive, dispatch and admin commands here; the DH-HMAC-CHAP gate in
    :mod:`~blockfabric.target.ctrl_auth`, the I/O commands in :mod:`~blockfabric.target.ctrl_io`
    (mixins that import nothing from here)."""

    #: Seconds the keep-alive allows beyond KATO for activity reported late: a queue in a
    #: poll-group worker (target.groupstate.ACTIVITY_LAG); 0 here.
    activity_lag = 0.0
    #: The keep-alive found it idle and asked the poll groups for their reports: look again
    #: once they answered, and end it then if still idle.
    activity_asked = False

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
        self.queues: dict[int, AnyTargetQueue] = {}
        self.aers: list[Command] = []
        self.pending_events: list[int] = []
        self.changed_nsids: set[int] = set()
        self.resv = resvctl.CtrlResv()      # reservation notification log and masks
        self.error_count = 0
        self.created = time.time()
        self.last_activity = time.monotonic()
        self.kato_timer: Timer | None = None
        self.dead = False
        # the cfg.Listener it came in on (set by connect, before it is registered)
        self.listener: cfg.Listener = None  # type: ignore[assignment]
        #: Set when the host's allow-list entry has a DH-HMAC-CHAP secret: then every queue
        #: authenticates (Connect answers ATR) before it runs anything but Fabrics commands.
        self.auth_policy: auth.AuthPolicy | None = None
        self.auth: dict[int, auth.TargetAuth] = {}
        #: Per queue: ends the queue (the admin queue: the controller) if it is not
        #: authenticated in time (limits.auth_timeout).
        self.auth_timers: dict[int, Timer] = {}
        self._auth_reported: set[auth.TargetAuth] = set()
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
        # activity_lag: a queue in a poll-group worker reports its commands late
        idle = time.monotonic() - self.last_activity - self.activity_lag
        if idle * 1000 >= self.kato_ms:
            refresh = self.owner.refresh_activity
            if self.activity_lag and refresh is not None and not self.activity_asked:
                # a worker's report may be late behind a busy machine, not the host silent
                self.activity_asked = True
                self.kato_timer = None
                refresh(self, self._activity_refreshed)
                return
            log.warning("%s: keep-alive timeout kato_ms=%d idle_s=%.1f: tearing it down",
                        self.name, self.kato_ms, idle)
            self.owner.destroy_controller(self, "keep-alive expired")
            return
        self.activity_asked = False
        self.kato_timer = self.res.reactor.call_later(
            self.kato_ms / 1000 - idle, self._check_keep_alive)

    def _activity_refreshed(self) -> None:
        if self.kato_timer is None:     # (a Set Features KATO meanwhile started a new check)
            self._check_keep_alive()

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
                exc = no_auth(cmd)     # on an I/O queue: its "nsid" was the fctype
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
            self._check_length(cmd, 0)      # (it moves no data: nvmet refuses a buffer)
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
            raise no_auth(cmd)
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
        if (phase is Phase.READY) is not (before.phase is Phase.READY):
            # I/O queues a poll group serves: their worker answers as this controller
            # does now (Command Sequence Error while it is not ready)
            for queue in list(self.queues.values()):
                tell = getattr(queue, "controller_ready", None)
                if tell is not None:
                    tell(phase is Phase.READY)
        if phase is Phase.SHUTTING_DOWN:
            # Every command before this one has been answered or is in the backend pool;
            # flushing the volumes is what makes a normal shutdown safe.  On the backend
            # threads (a file's fdatasync, RBD's flush block): CSTS.SHST says 'in progress'
            # meanwhile, and the host polls it, while this loop serves every other host.
            subsystem = self.subsystem

            def flushed(exc: BaseException | None) -> None:
                if exc is not None:
                    log.error("%s: flushing at shutdown: %s", self.name, exc)
                if self.state.phase is Phase.SHUTTING_DOWN:
                    self.state = self.state.shutdown_complete()
            self.res.run_blocking(lambda: self.owner.flush_subsystem(subsystem), flushed,
                                  self.hostnqn)
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
            nsids = tuple(n for n in sorted(self.subsystem.namespaces)  # type: ignore[union-attr]
                          if n > ident.nsid)    # (not discovery: it has a subsystem)
            data = identify.ActiveNamespaceList(nsids=nsids[:1024]).pack()
        elif ident.cns == IdentifyCNS.NS_ID_DESCRIPTORS:
            ns = self._namespace(ident.nsid)
            data = identify.NamespaceIdDescriptorList.of(
                [(identify.NidType.NGUID, ns.nguid), (identify.NidType.UUID, ns.uuid),
                 (identify.NidType.CSI, b"\0")]).pack()
        else:  # pragma: no cover - Identify.from_sqe refuses other CNS values
            raise ProtocolError(f"Identify CNS {ident.cns:#x}", StatusCode.INVALID_FIELD)
        self.send_data(cmd, data)

    def identify_controller(self) -> identify.IdentifyController:
        limits = self.res.limits
        sub = self.subsystem
        inline = limits.inline_data_size
        # CMIC: a subsystem takes any number of controllers (hosts, and a host's paths),
        # through every listener; the Linux host refuses a second controller of a subsystem
        # whose CMIC lacks bit 1.  A gateway group adds the ANA bit.
        cmic = identify.CMIC_MULTI_PORT | identify.CMIC_MULTI_CTRL if sub else 0
        ana = self.owner.ana.identify() if self.owner.ana and sub else {"cmic": cmic}
        return identify.IdentifyController(
            vid=0, ssvid=0,
            sn=sub.serial if sub else self.owner.discovery_serial,
            mn=sub.model if sub else "blockfabric discovery",
            fr=self.owner.firmware_revision,
            rab=6,
            mdts=(self.mdts_bytes // 4096).bit_length() - 1,
            cntlid=self.cntlid, ver=NVME_VERSION,
            oaes=self._oaes(),
            ctratt=resv.CTRATT_HOSTID_128,
            cntrltype=identify.CNTRLTYPE_DISCOVERY if self.is_discovery else identify.CNTRLTYPE_IO,
            acl=3, aerl=AERL, frmw=3, lpa=0, elpe=0,
            kas=self.res.keep_alive.kas_ms // 100,
            sqes=0x66, cqes=0x44, maxcmd=self.queue_size,
            nn=0 if self.is_discovery else 1024,
            oncs=(0 if self.is_discovery else
                  identify.ONCS_DSM | identify.ONCS_WRITE_ZEROES | resv.ONCS_RESERVATIONS),
            vwc=0 if self.is_discovery else 1,
            sgls=identify.SGLS_SUPPORTED | identify.SGLS_KEYED | identify.SGLS_OFFSET,
            subnqn=sub.nqn if sub else self.owner.discovery_nqn,
            ioccsz=(64 + inline) // 16, iorcsz=1, icdoff=0, fcatt=0, msdbd=1,
            **ana)  # type: ignore[arg-type]  # (ANA's fields, cmic: ints)

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
        ns = self.subsystem.namespaces.get(nsid)  # type: ignore[union-attr]  # (not discovery)
        if ns is None:
            return bytes(identify.IDENTIFY_SIZE)  # an inactive NSID: the all-zero page
        return identify.IdentifyNamespace(
            nsze=ns.nblocks, ncap=ns.nblocks, nuse=ns.nblocks, nlbaf=0, flbas=0,
            nmic=1, rescap=resvctl.rescap(ns), anagrpid=ns.ana_group, dlfeat=1,
            nsattr=identify.NSATTR_WRITE_PROTECTED if ns.read_only else 0,
            nguid=ns.nguid, eui64=bytes(8),
            lbaf=(identify.LBAFormat(ms=0, ds=ns.block_size.bit_length() - 1, rp=0),),
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
            page = logpages.SmartLog(data_units_read=-(-io.bytes[READ] // 512000),
                                     data_units_written=-(-io.bytes[WRITE] // 512000),
                               host_reads=io.ops[READ], host_writes=io.ops[WRITE],
                               temperature=300).pack()
        elif lid == LogPageId.CHANGED_NS:
            # reading it clears it: only a read that will be answered does
            _check_offset(glp.lpo, _CHANGED_NS_SIZE)
            nsids = sorted(self.changed_nsids)
            self.changed_nsids.clear()
            page = logpages.ChangedNamespaceList(nsids=tuple(nsids[:1024])).pack()
        elif lid == LogPageId.FW_SLOT:
            page = bytes(512)
        elif lid == LogPageId.ANA and self.owner.ana is not None:
            page = self.owner.ana.log_page(self, rgo=bool(glp.lsp & logpages.ANA_LSP_RGO),
                                            retain=glp.rae)
        elif lid == LogPageId.RESV_NOTIFY:
            _check_offset(glp.lpo, _RESV_NOTIFY_SIZE)       # (a read takes an entry)
            page = self.resv.next_page()
        else:
            raise ProtocolError(f"log page {lid:#x} not supported", StatusCode.INVALID_LOG_PAGE)
        _check_offset(glp.lpo, len(page))
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
            # (bits of no event this target knows: refused, as nvmet refuses what is
            # outside its NVMET_AEN_CFG_ALL; those this controller does not send: kept off)
            if sf.value & ~_AEC_KNOWN:
                raise ProtocolError(f"asynchronous event configuration {sf.value:#x} "
                                    f"outside {_AEC_KNOWN:#x}", StatusCode.INVALID_FIELD, True)
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
        elif gf.fid in _ZERO_FEATURES:
            # mandatory features without a setting here (arbitration, power management,
            # temperature threshold, error recovery, write atomicity): 0, as nvmet answers
            cmd.respond()
        else:
            raise ProtocolError(f"Get Features {gf.fid:#x} not supported",
                                StatusCode.INVALID_FIELD)

    # Asynchronous events --------------------------------------------------------------
    def _aer(self, cmd: Command) -> None:
        self.state = self.state.submit_aer()
        self.aers.append(cmd)
        self._deliver_events()

    def notify(self, info: AsyncNotice, log_page: int, nsids: tuple[int, ...] = ()) -> None:
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
        if resv.AEN_RESV not in self.pending_events:
            self.pending_events.append(resv.AEN_RESV)
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
        sges: tuple[SGE, ...] = (sge,) if data else ()
        if length > len(data):
            sges += (self.res.zeros(cmd.queue, length - len(data)),)
        cmd.respond(data=sges)

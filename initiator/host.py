"""The host library: connect to an NVMe-oF subsystem and do block I/O on its namespaces.

This module composes :class:`Controller` from its parts and re-exports them (users import
everything from here): :mod:`.identity` (host NQN and ID), :mod:`.arena` (registered
memory), :mod:`.namespace`, :mod:`.io` (the I/O primitive and submission),
:mod:`.connection` (queues, Fabrics Connect, authentication), :mod:`.events` (rescans, AER,
ANA) and :mod:`.recovery` (reconnecting, keep-alive); :mod:`.errors` has their errors.

``connect()`` does what ``nvme connect -t rdma`` does: the admin queue (CM private data, then
Fabrics Connect with the 1024-byte connect data), the Property handshake (CC.EN -> CSTS.RDY),
Identify Controller, Set Features Number of Queues, the I/O queues, the namespaces, and a
keep-alive sent every KATO/2.  ``discover()`` does what ``nvme discover`` does.

Data moves one-sided: the host registers an I/O arena (REMOTE_READ for write data,
REMOTE_WRITE for read data; nothing else of the host is exposed) and names a piece of it in a
keyed SGL; the target RDMA-READs write data from it and RDMA-WRITEs read data into it.  Small
writes travel in the command capsule instead.

Thread model: any number of threads may submit.  One reactor thread per controller services
every queue's completions and the keep-alive timer; a caller blocks only on its own command.

Asynchronous events: an NVM controller keeps an Asynchronous Event Request outstanding.  On a
Namespace Attribute Changed notice a worker thread (not the reactor, which must keep
completing the commands it waits for) reads the Changed Namespace List log page, re-identifies
those namespaces and updates the :class:`HostNamespace` objects *in place* (a FUSE file that
reads ``ns.size`` sees a resize), adds and removes namespaces, then calls every function in
``Controller.namespace_listeners`` with ``(controller, changed_nsids)``.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from blockfabric.errors import BlockfabricError
from blockfabric.fabric.host_side import HostQueue
from blockfabric.fabric.reactor import Reactor
from blockfabric.protocol import (CC, CSTS, DISCOVERY_NQN, DiscoveryLogEntry, DiscoveryLogHeader,
                                  IdentifyController, LogPageId, Property)
from blockfabric.rdma import PD, get_provider

# The parts of the host library, composed into Controller here and re-exported, so that
# ``from blockfabric.initiator.host import connect, Controller, Namespace, ...`` keeps working.
from blockfabric.errors import QueueDead, WorkCompletionError  # noqa: F401,I001
from blockfabric.initiator.arena import HOST_ACCESS, Arena, HostMemory  # noqa: F401
from blockfabric.initiator.connection import (ADMIN_DEPTH, CAPSULE_CONNECT_DATA,  # noqa: F401
                                              QueueSetup, _secret)
from blockfabric.initiator.errors import (AuthenticationFailed, ControllerLost,  # noqa: F401
                                          NvmeError)
from blockfabric.initiator.events import ANA_LOG_READ, Events  # noqa: F401
from blockfabric.initiator.identity import (HOSTID_FILES, HOSTNQN_FILES,  # noqa: F401
                                            default_hostid, default_hostnqn)
from blockfabric.initiator.io import (HeldCommand, IoCommand, IoJoin, IoPath,  # noqa: F401
                                      SqeCommand)
from blockfabric.initiator.namespace import HostNamespace  # noqa: F401

#: Deprecated name of :class:`HostNamespace` (docs and users' code say ``Namespace``); new
#: code says HostNamespace, which the target's Namespace (a backing store) cannot be taken for.
Namespace = HostNamespace
from blockfabric.initiator.recovery import (CTRL_TRANSITIONS, CtrlEvent,  # noqa: F401,E402
                                            CtrlState, Recovery, RecoveryStats)

log = logging.getLogger(__name__)

DEFAULT_PORT = 4420
DEFAULT_ARENA = 64 << 20


# --------------------------------------------------------------------------- the controller

@dataclass
class ConnectOptions:
    """What ``nvme connect`` takes, with its names and units (seconds for timeouts)."""

    traddr: str
    subnqn: str
    trsvcid: int = DEFAULT_PORT
    hostnqn: str | None = None
    hostid: bytes | None = None
    provider: str = "auto"
    #: "rdma" (with ``provider``) or "tcp" (NVMe/TCP: any NVMe/TCP target, no RDMA)
    transport: str = "rdma"
    #: NVMe/TCP header and data digests (CRC32C), as nvme connect --hdr-digest/--data-digest
    hdr_digest: bool = False
    data_digest: bool = False
    #: NVMe/TCP: the data alignment asked for in ICReq (HPDA, 0's based dwords, 0-31):
    #: the target pads the read data it sends to (hpda + 1) * 4 bytes (interop and tests)
    hpda: int = 0
    nr_io_queues: int = 2
    queue_size: int = 128
    keep_alive_tmo: float = 5.0
    reconnect_delay: float = 10.0
    ctrl_loss_tmo: float = 600.0
    connect_timeout: float = 5.0
    #: seconds an admin command may go unanswered on a live controller before its caller
    #: gets a TimeoutError (a rescan, an ANA log read, an event's handling): the Linux
    #: host's admin_timeout (60 s)
    admin_timeout: float = 60.0
    arena_size: int = DEFAULT_ARENA
    #: Connect CATTR bit 2 (nvme connect --disable-sqflow): the controller then reports no
    #: SQ head, which this host never reads.  None (the default): on NVMe/TCP, where the
    #: controller then sends a read's data with SUCCESS and no response capsule (Linux
    #: nvmet and this target do); off on RDMA
    disable_sqflow: bool | None = None
    send_keep_alive: bool = True    # False only to test a target's keep-alive timeout
    #: DH-HMAC-CHAP secret of this host ('DHHC-1:XX:...:', as nvme connect --dhchap-secret):
    #: used when the subsystem asks the host to authenticate (Connect with ATR).
    dhchap_secret: str | None = None
    #: The controller's secret (--dhchap-ctrl-secret): the host then authenticates the
    #: controller too (bidirectional), and refuses one that cannot prove it holds it.
    dhchap_ctrl_secret: str | None = None
    #: Further listeners (traddr, trsvcid) of the same subsystem: the host connects to all
    #: of them at once and routes I/O by their ANA states (see
    #: :mod:`blockfabric.initiator.pathset`); a lost path reconnects in the background.
    #: A third item, "rdma" or "tcp", makes that path go over that transport.
    paths: list[tuple] = field(default_factory=list)


class Controller(QueueSetup, Events, IoPath, Recovery):
    """A connected controller: its queues, namespaces and reactor.  Use as a context
    manager, or call :meth:`close`.

    Given further ``paths``, ``Controller(opts)`` is a
    :class:`~blockfabric.initiator.pathset.MultipathController`: one controller per path,
    all connected at once, I/O routed by ANA state (the same interface, so the library, the
    bench and the mount use it unchanged).  ``share``: the multipath controller whose
    reactor, protection domain and arena this one path uses."""

    def __new__(cls, opts: ConnectOptions | None = None, *args: Any, **kwargs: Any):
        if cls is Controller and opts is not None and opts.paths \
                and kwargs.get("share") is None:
            # the pathset of this very module (tests import it as initiator.host too)
            pathset = importlib.import_module(__name__.rpartition(".")[0] + ".pathset")
            return super().__new__(pathset.MultipathController)
        return super().__new__(cls)

    def __init__(self, opts: ConnectOptions, *, share: Controller | None = None) -> None:
        self._share = share
        self.opts = opts
        self.hostnqn = opts.hostnqn or default_hostnqn()
        self.hostid = opts.hostid or default_hostid()
        self.dhchap_secret = _secret(opts.dhchap_secret, "dhchap_secret")
        self.dhchap_ctrl_secret = _secret(opts.dhchap_ctrl_secret, "dhchap_ctrl_secret")
        if self.dhchap_ctrl_secret is not None and self.dhchap_secret is None:
            raise ValueError("dhchap_ctrl_secret needs dhchap_secret as well: the controller "
                             "authenticates only after the host has")
        self._transactions = itertools.count(1)
        #: qid -> how it authenticated (hash, DH group, bidirectional), for .status
        self.authenticated: dict[int, str] = {}
        self.connect_result = 0             # the last Connect's result (cntlid, ATR)
        if opts.transport not in ("rdma", "tcp"):
            raise ValueError(f"transport {opts.transport!r}: rdma or tcp")
        self.provider = TCP if opts.transport == "tcp" else \
            get_provider(opts.provider, opts.traddr)
        self.reactor = share.reactor if share is not None else Reactor(f"host-{opts.traddr}")
        self.admin: HostQueue | None = None
        self.io_queues: list[HostQueue] = []
        self.namespaces: dict[int, HostNamespace] = {}
        self.cntlid = 0
        self.identify: IdentifyController | None = None
        self.arena: Arena | None = None
        self.pd: PD | None = None
        self._rr = itertools.count()
        self._ka_timer = None
        self._closed = False
        self.max_transfer = 128 << 10
        self.inline_size = 0
        #: (index, shares): connect only share ``index`` of the I/O queues granted, the rest
        #: being other processes' (a mount's FUSE workers); (0, 1): all of them
        self.io_share = (0, 1)
        self.io_queues_granted = 0
        self.io_depth = 0
        #: Called as ``fn(controller, changed_nsids)`` after namespaces were added, removed
        #: or changed (resized, read-only flipped); on the event worker thread.
        self.namespace_listeners: list[Callable[[Controller, set[int]], None]] = []
        #: Called as ``fn(controller)`` after a reconnect succeeded or was given up (on the
        #: reconnect thread): a multipath controller re-ranks its paths then.
        self.state_listeners: list[Callable[[Controller], None]] = []
        #: ANA (a gateway group): the last ANA log read, as (chgcnt, groups), and who wants
        #: to hear of a change: ``fn(controller, (chgcnt, groups))`` on the event worker.
        self.ana_log: tuple[int, list] | None = None
        self.ana_listeners: list[Callable[[Controller, tuple[int, list]], None]] = []
        self._events: concurrent.futures.ThreadPoolExecutor | None = None
        #: a namespace notice was not handled to the end: the next one rescans everything
        self._rescan_all = False
        self.paths = [(opts.traddr, int(opts.trsvcid))] + [(p[0], int(p[1])) for p in opts.paths]
        self.path_index = 0
        self.state = CtrlState.CONNECTING
        self.recovery = RecoveryStats()
        self._state_lock = threading.Lock()
        self._held: list[HeldCommand] = []
        self._gen = 0
        self._loss_deadline: float | None = None
        self._wake = threading.Event()
        self._recovery_thread: threading.Thread | None = None
        self._ka_sent: float | None = None
        self._closing = False

    @property
    def path(self) -> tuple[str, int]:
        """The (traddr, trsvcid) in use, or last used."""
        return self.paths[self.path_index]

    # -- information -----------------------------------------------------------------
    def queue_stats(self) -> dict[int, dict[str, int]]:
        queues = ([self.admin] if self.admin else []) + self.io_queues
        return {q.qid: q.stats.as_dict() for q in queues}

    # -- teardown ----------------------------------------------------------------------
    def shutdown(self, timeout: float = 2.0) -> None:
        """CC.SHN = normal, then wait for CSTS.SHST = complete (what nvme disconnect does),
        ``timeout`` seconds at most in all: a target that answers neither (hung, or
        lying) cannot hold a disconnect or an unmount."""
        if self.admin is None or self.admin.dead_reason:
            return
        try:
            deadline = time.monotonic() + timeout
            cc = CC(en=True, css=0, mps=0, ams=0, shn=1, iosqes=6, iocqes=4)
            self.property_set(Property.CC, cc.to_int(), timeout=timeout)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if CSTS.from_int(self.property_get(Property.CSTS, 4, timeout=left)).shst == 2:
                    return
                time.sleep(0.01)
        except (BlockfabricError, ConnectionError, TimeoutError) as exc:
            log.debug("shutdown: %s", exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True        # what shutdown provokes (a refused keep-alive) is no loss
        self.shutdown()
        with self._state_lock:
            self._closed = True
            reconnecting = self.state == CtrlState.RECONNECTING
            self._move(CtrlEvent.CLOSE)
        self._wake.set()
        if reconnecting and self._recovery_thread is not None:
            self._recovery_thread.join(2 * self.opts.connect_timeout + 5)
        self._give_up_held()
        if self._events is not None:
            self._events.shutdown(wait=False, cancel_futures=True)
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        if self._share is not None:         # one path of a multipath controller: its
            queues = self.io_queues + ([self.admin] if self.admin else [])   # reactor,
            self.io_queues, self.admin = [], None          # PD and arena are the owner's

            def fail_all() -> None:
                for queue in queues:
                    queue.fail("controller closed", expected=True)
            try:
                self.reactor.call_sync(fail_all, timeout=10)
            except (TimeoutError, RuntimeError):
                fail_all()
            for queue in queues:
                queue.close()
            self.arena = self.pd = None
            return
        self.reactor.stop()
        self.reactor.join(5)
        for queue in self.io_queues + ([self.admin] if self.admin else []):
            queue.fail("controller closed", expected=True)
            queue.close()
        self.io_queues = []
        self.admin = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.pd is not None:
            self.pd.close()
            self.pd = None
        self.reactor.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Tcp:
    """What a controller's ``provider`` says on NVMe/TCP (which has none): its name."""

    name = "tcp"


TCP = _Tcp()


def connect(traddr: str, subnqn: str, trsvcid: int = DEFAULT_PORT, **kwargs) -> Controller:
    """Connect as ``nvme connect -t rdma`` (or, with ``transport="tcp"``, ``-t tcp``) does;
    see :class:`ConnectOptions` for options."""
    return Controller(ConnectOptions(traddr=traddr, subnqn=subnqn, trsvcid=int(trsvcid),
                                     **kwargs)).connect()


#: discovery log TRTYPE -> the transport that reaches it
ENTRY_TRANSPORTS = {1: "rdma", 3: "tcp"}


def connect_entry(entry: DiscoveryLogEntry, **kwargs) -> Controller:
    """Connect to the subsystem and port a discovery log entry names, over the transport the
    entry names (an entry read over TCP may name an RDMA port, and the other way round)."""
    transport = ENTRY_TRANSPORTS.get(entry.trtype)
    if transport is None:
        raise ValueError(f"discovery entry for {entry.subnqn}: transport type {entry.trtype} "
                         "is neither RDMA (1) nor TCP (3)")
    try:
        port = int(entry.trsvcid)
    except ValueError:
        raise ValueError(f"discovery entry for {entry.subnqn}: trsvcid {entry.trsvcid!r}"
                         ) from None
    kwargs["transport"] = transport
    return connect(entry.traddr, entry.subnqn, port, **kwargs)


#: Reads of the discovery log before giving up on one that keeps changing (libnvme's)
DISCOVERY_TRIES = 10


def discover(traddr: str, trsvcid: int = DEFAULT_PORT, **kwargs) -> list[DiscoveryLogEntry]:
    """Read the discovery log as ``nvme discover`` does: the header, every entry, then the
    header again; when the generation counter moved meanwhile, the log changed under the
    read (entries may be missing or zero), so it is read again."""
    with connect(traddr, DISCOVERY_NQN, trsvcid, **kwargs) as ctrl:
        def header(rae: bool) -> DiscoveryLogHeader:
            return DiscoveryLogHeader.unpack_from(
                ctrl.get_log_page(LogPageId.DISCOVERY, 1024, rae=rae))
        first = header(True)
        for _ in range(DISCOVERY_TRIES):
            if first.numrec == 0:
                return []
            page = ctrl.get_log_page(LogPageId.DISCOVERY, 1024 * (first.numrec + 1),
                                     rae=True)
            again = header(False)       # (the last read: it re-arms the change event)
            if again.genctr == first.genctr == DiscoveryLogHeader.unpack_from(page).genctr:
                return list(DiscoveryLogEntry.iter_from(page, first.numrec))
            first = again
        raise ConnectionError(f"the discovery log at {traddr}:{trsvcid} changed during "
                              f"each of {DISCOVERY_TRIES} reads")

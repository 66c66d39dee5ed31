"""Reservations in the running daemon: the four commands, the access check, the features
(0x81 host identifier, 0x82 notification mask, 0x83 persistence), the notification log
page (0x80) and its AENs.  The state machine is :mod:`blockfabric.target.reservations`;
where the state lives, :mod:`blockfabric.target.resvstore`.

Every namespace carries ``resv_state`` (the last state this daemon knows, None when its
store could not be read: then I/O is answered "namespace not ready" and reservation
commands an internal error, never a guess) and ``resv_open`` (True when nothing is
reserved: the Read/Write path then pays one attribute test).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping

from blockfabric.protocol import resv
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.opcodes import IOOpcode
from blockfabric.protocol.status import StatusCode
from blockfabric.target import reservations
from blockfabric.target.resvstore import NOTIFY_TIMEOUT_MS, RadosStore, StoreError, store_for

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.fabric.target_side import Command
    from blockfabric.target.controller import Controller
    from blockfabric.target.namespace import Namespace, Subsystem
    from blockfabric.target.services import Owner, Resources

log = logging.getLogger(__name__)

LOG_QUEUE = 64                  # per controller, as nvmet's NVMET_PR_LOG_QUEUE_SIZE
FENCE_POLL = 0.002              # s between looks at a fenced host's in-flight count
RETRY_INTERVAL = 1.0            # s between reads of a state that could not be read
CONFLICT = reservations.CONFLICT
#: The write command group of nvmet_pr_check_cmd_access but Write (reads: Read only, here),
#: whose check is the Read/Write path's own.
WRITE_GROUP = frozenset({IOOpcode.FLUSH, IOOpcode.WRITE_ZEROES, IOOpcode.DATASET_MANAGEMENT})


# -- namespaces ---------------------------------------------------------------------------
def attach(ns: Namespace) -> None:
    """Open the namespace's store and read its state (a fresh start: without PTPL the
    state goes, as with a power cycle)."""
    ns.resv_store = store_for(ns.conf)         # StoreError: the namespace does not open
    ns.resv_bound = False
    try:
        set_state(ns, ns.resv_store.load(fresh_start=True))
    except StoreError as exc:
        log.error("ns %d: reservation state unreadable, I/O refused until it is: %s",
                  ns.nsid, exc)
        ns.resv_state = None
        ns.resv_open = False


def set_state(ns: Namespace, st: reservations.State) -> None:
    """Take ``st`` unless this daemon already knows a later one."""
    cur = ns.resv_state
    if cur is not None and cur.version > st.version:
        return
    ns.resv_state = st
    ns.resv_open = not st.rtype


def rescap(ns: Namespace) -> int:
    return resv.RESCAP_TYPES | resv.RESCAP_IEKEY13 | \
        (resv.RESCAP_PTPL if ns.resv_store.ptpl_capable else 0)


def io_status(ctrl: Controller, ns: Namespace, write: bool) -> int:
    """0, or the status a command of the read/write group gets from ``ctrl`` now (called
    only when ``ns.resv_open`` is False)."""
    st = ns.resv_state
    if st is None:
        return StatusCode.NS_NOT_READY
    return reservations.CONFLICT if st.conflicts(ctrl.hostid, write) else 0


def check_io(ctrl: Controller, nss: list[Namespace], opcode: int) -> None:
    """Raise the conflict for a non-Read/Write I/O command (Flush, Write Zeroes, DSM)."""
    if opcode not in WRITE_GROUP:
        return
    for ns in nss:
        if not ns.resv_open:
            status = io_status(ctrl, ns, True)
            if status:
                raise ProtocolError(f"namespace {ns.nsid}: reservation conflict",
                                    StatusCode(status), dnr=status == reservations.CONFLICT)


# -- per controller: the notification log ---------------------------------------------------
class CtrlResv:
    """A controller's reservation notification log (a FIFO of 64, nvmet's) and masks."""

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[int, int, int]] = collections.deque()
        self.counter = 0
        self.lost = 0
        self.masks: dict[int, int] = {}             # nsid -> Set Features 0x82 mask

    def add(self, log_type: int, nsid: int) -> None:
        self.counter = (self.counter + 1) & 0xFFFFFFFFFFFFFFFF or 1
        if len(self.queue) >= LOG_QUEUE:
            self.lost += 1
            return
        self.queue.append((self.counter, log_type, nsid))

    def next_page(self) -> bytes:
        """One entry per read (nvmet_execute_get_log_page_resv); count folds in the lost."""
        if not self.queue:
            return resv.NotificationLog(0, 0, 0, 0).pack()
        count, log_type, nsid = self.queue.popleft()
        if self.queue:
            nxt = self.queue[0][0]
            lost = (nxt - count - 1) if nxt > count else (2**64 - 1 - count + nxt - 1)
        else:
            lost = self.lost
        self.lost -= min(lost, self.lost)
        count = (count + lost) & 0xFFFFFFFFFFFFFFFF or 1
        return resv.NotificationLog(count, log_type, len(self.queue), nsid).pack()


def _notify(controllers: Mapping[int, Controller], ns: Namespace,
            notices: list[reservations.Notice]) -> None:
    """Log entries and AENs for every controller of each notice's host on this daemon."""
    for notice in notices:
        bit = resv.LOG_MASK_BIT[notice.log_type]
        for other in list(controllers.values()):
            if other.hostid != notice.hostid or other.dead or other.subsystem is None \
                    or other.subsystem.namespaces.get(ns.nsid) is not ns \
                    or other.resv.masks.get(ns.nsid, 0) & bit:
                continue
            other.resv.add(notice.log_type, ns.nsid)
            other.notify_resv()


# -- the commands -------------------------------------------------------------------------
def execute(ctrl: Controller, cmd: Command, ns: Namespace) -> None:
    """Reservation Register, Acquire, Release (data: keys) or Report (data: status)."""
    sqe = cmd.sqe
    assert sqe is not None              # a command with an SQE (not a fabrics one)
    if sqe.opcode == resv.OP_REPORT:
        _report(ctrl, cmd, ns)
        return
    if ns.resv_state is None:
        raise ProtocolError(f"namespace {ns.nsid}: reservation state unavailable",
                            StatusCode.INTERNAL_ERROR)
    fields = resv.ResvCommand.from_cdw10(sqe.cdw10)
    need = 8 if sqe.opcode == resv.OP_RELEASE else 16
    if cmd.data_length < need:
        raise ProtocolError(f"reservation command with {cmd.data_length} bytes of data, "
                            f"needs {need}", StatusCode.SGL_DATA_LENGTH_INVALID)
    hostid = ctrl.hostid
    if sqe.opcode == resv.OP_REGISTER:
        capable = ns.resv_store.ptpl_capable

        def change(st: reservations.State, k: tuple[int, int]) -> reservations.Outcome:
            return reservations.register(st, hostid, fields.action, fields.iekey, fields.cptpl, *k,
                                         ptpl_capable=capable)
    elif sqe.opcode == resv.OP_ACQUIRE:
        def change(st: reservations.State, k: tuple[int, int]) -> reservations.Outcome:
            return reservations.acquire(st, hostid, fields.action, fields.iekey, fields.rtype, *k)
    else:
        def change(st: reservations.State, k: tuple[int, int]) -> reservations.Outcome:
            return reservations.release(st, hostid, fields.action, fields.iekey, fields.rtype, k[0])
    # nvmet reads only the first 16 (8) bytes, however long the host's buffer is.
    view, sge, release = ctrl.res.control_buffer(cmd.queue, need)
    cmd.on_released = release

    def fetched(c: Command) -> None:
        k = resv.keys(bytes(view[:need]).ljust(16, b"\0"))
        run_update(ctrl, c, ns, lambda st: change(st, k))

    cmd.fetch(view, sge, fetched)


def run_update(ctrl: Controller, cmd: Command, ns: Namespace,
               change: Callable[[reservations.State], reservations.Outcome]) -> None:
    """Read-modify-write the state on the backend threads; answer back on the reactor."""
    box: list[reservations.Outcome] = []

    def work() -> None:
        box.append(ns.resv_store.update(change))

    def finish(exc: BaseException | None) -> None:
        if exc is not None:
            log.error("%s: ns %d: reservation state not stored: %s", ctrl.name, ns.nsid, exc)
            ctrl.io.errors += 1
            _answer(cmd, StatusCode.INTERNAL_ERROR)
            return
        out = box[0]
        if not out.ok:
            ctrl.io.errors += 1
            _answer(cmd, out.status, dnr=True)
            return
        set_state(ns, out.state)
        if out.notices:
            log.info("%s: ns %d: reservation %s", ctrl.name, ns.nsid,
                     reservations.describe(out.state))
        _notify(ctrl.owner.controllers, ns, out.notices)

        def then() -> None:
            if out.fenced:
                _fence(ctrl, ns, set(out.fenced), cmd)
            else:
                _answer(cmd)
        publish = ctrl.owner.publish_resv
        if publish is None:
            then()
        else:       # every poll group has the new state before the command is answered
            publish(ns, out.state, out.fenced, then)

    ctrl.res.run_blocking(work, finish, ctrl.hostnqn)


def _answer(cmd: Command, status: int = StatusCode.SUCCESS, dnr: bool = False) -> None:
    """Respond after the store's round trip; when the queue closed meanwhile, no SEND
    will complete to give the command's buffer back, so it is given back here."""
    cmd.respond(status, dnr=dnr)
    if not cmd.responded:
        release, cmd.on_released = cmd.on_released, None
        if release is not None:
            release(cmd)


def _fence(ctrl: Controller, ns: Namespace, hosts: set[bytes], cmd: Command) -> None:
    """Preempt and Abort: no command of the preempted hosts still in flight when it
    completes (their new ones already conflict).  Like nvmet, nothing is aborted: their
    in-flight commands are waited for."""
    _drained(ctrl.owner.controllers, ctrl.res.reactor, hosts, lambda: _answer(cmd),
             lambda: cmd.queue.closed)


def _drained(controllers: Mapping[int, Controller], reactor: Reactor, hosts: set[bytes],
             then: Callable[[], None],
             give_up: Callable[[], bool] = lambda: False) -> None:
    """On the reactor: ``then()`` once no controller of ``hosts`` has a command in flight
    on this daemon."""
    def check() -> None:
        busy = sum(c.io.inflight for c in controllers.values() if c.hostid in hosts)
        if busy and not give_up():
            reactor.call_later(FENCE_POLL, check)
            return
        then()

    check()


# -- gateways: a state changed through another gateway (RBD) --------------------------
def bind(subsystems: dict[str, Subsystem], res: Resources, owner: Owner) -> None:
    """Watch the shared state of every namespace of ``subsystems`` whose store is shared
    (at start, and after a reload for the new namespaces)."""
    for sub in subsystems.values():
        for ns in sub.namespaces.values():
            if ns.resv_bound:
                continue
            ns.resv_bound = True
            if isinstance(ns.resv_store, RadosStore):
                _watch(res, owner, ns)
            elif ns.resv_state is None:
                _read_again(res, owner, ns)


def _read_again(res: Resources, owner: Owner, ns: Namespace) -> None:
    """A state that could not be read at open (a sidecar unreadable or damaged): read it
    again every RETRY_INTERVAL seconds until it can be (the operator repairs or removes it;
    docs/reservations.md), I/O refused meanwhile."""
    store = ns.resv_store
    box: list[reservations.State] = []

    def finish(exc: BaseException | None) -> None:
        if ns.resv_store is not store or owner.draining:
            return
        if exc is None:
            log.warning("ns %d: reservation state readable again: I/O resumes", ns.nsid)
            set_state(ns, box[0])
            return
        res.reactor.call_later(RETRY_INTERVAL, attempt)

    def attempt() -> None:
        res.run_blocking(lambda: box.append(store.load()), finish, "")

    res.reactor.call_later(RETRY_INTERVAL, attempt)


def _watch(res: Resources, owner: Owner, ns: Namespace) -> None:
    store = ns.resv_store
    assert isinstance(store, RadosStore)    # watched only when the state is in RADOS
    wait = NOTIFY_TIMEOUT_MS / 1000 - 1

    def apply(out: reservations.Outcome) -> None:
        """On a librados thread, for a notify: answered once applied here (and the fenced
        hosts' commands on this gateway drained)."""
        done = threading.Event()

        def on_reactor() -> None:
            set_state(ns, out.state)
            _notify(owner.controllers, ns, out.notices)
            if out.fenced:
                _drained(owner.controllers, res.reactor, set(out.fenced), done.set)
            else:
                done.set()
        res.reactor.call_soon_threadsafe(on_reactor)
        if not done.wait(wait):
            log.warning("ns %d: reservation change from another gateway: fenced hosts "
                        "still busy after %.0f s", ns.nsid, wait)

    def lost() -> None:
        def unknown() -> None:
            log.error("ns %d: reservation watch lost: I/O waits until the state is read "
                      "again", ns.nsid)
            ns.resv_state = None
            ns.resv_open = False
        res.reactor.call_soon_threadsafe(unknown)
        threading.Thread(target=again, name="resv-watch", daemon=True).start()

    def again() -> None:
        while not store.closed and not owner.draining:
            try:
                store.watch(apply, lost)
                st = store.load()
            except Exception as exc:
                log.warning("ns %d: reservation watch: %s", ns.nsid, exc)
                time.sleep(1.0)
                continue
            res.reactor.call_soon_threadsafe(lambda: set_state(ns, st))
            return

    try:
        store.watch(apply, lost)
        st = store.load()       # what changed between the namespace's open and the watch
    except Exception as exc:
        log.warning("ns %d: reservation watch: %s", ns.nsid, exc)
        lost()
        return
    set_state(ns, st)


def _report(ctrl: Controller, cmd: Command, ns: Namespace) -> None:
    sqe = cmd.sqe
    assert sqe is not None
    length = 4 * ((sqe.cdw10 & 0xFFFFFFFF) + 1)
    ctrl._check_length(cmd, length)        # SGL and MDTS, before anything is built
    if not sqe.cdw11 & 1:
        raise ProtocolError("Reservation Report without EDS: host IDs here are 128-bit",
                            reservations.HOST_ID_INCONSISTENT)
    if length < resv.STATUS_EXT_HEADER:
        raise ProtocolError(f"Reservation Report of {length} bytes", StatusCode.INVALID_FIELD)
    st = ns.resv_state
    if st is None:
        raise ProtocolError(f"namespace {ns.nsid}: reservation state unavailable",
                            StatusCode.INTERNAL_ERROR)
    status = reservations.report(st)
    used = min(length, resv.STATUS_EXT_HEADER + resv.STATUS_EXT_ENTRY * len(status.registrants))
    ctrl.send_data(cmd, status.pack(used), length)


# -- features and the log page ----------------------------------------------------------
def set_feature(ctrl: Controller, cmd: Command, fid: int, nsid: int, value: int) -> None:
    if fid == resv.FID_RESV_MASK:
        if value & ~resv.MASK_ALL:
            raise ProtocolError(f"reservation notification mask {value:#x}",
                                StatusCode.INVALID_FIELD)
        assert ctrl.subsystem is not None   # features of an I/O controller
        nsids = list(ctrl.subsystem.namespaces) if nsid == 0xFFFFFFFF \
            else [_ns(ctrl, nsid).nsid]
        for n in nsids:
            ctrl.resv.masks[n] = value
        cmd.respond(result=value)
        return
    ns = _ns(ctrl, nsid)               # 0x83: one namespace
    ptpl = bool(value & 1)
    if ptpl and not ns.resv_store.ptpl_capable:
        raise ProtocolError(f"namespace {nsid}: this volume cannot persist reservations",
                            StatusCode.INVALID_FIELD)
    if ns.resv_state is None:
        raise ProtocolError(f"namespace {nsid}: reservation state unavailable",
                            StatusCode.INTERNAL_ERROR)
    run_update(ctrl, cmd, ns, lambda st: reservations.Outcome(reservations.OK,
                                                              reservations.set_ptpl(st, ptpl)))


def get_feature(ctrl: Controller, cmd: Command, fid: int, nsid: int) -> None:
    ns = _ns(ctrl, nsid)
    if fid == resv.FID_RESV_MASK:
        cmd.respond(result=ctrl.resv.masks.get(ns.nsid, 0))
        return
    st = ns.resv_state
    if st is None:
        raise ProtocolError(f"namespace {nsid}: reservation state unavailable",
                            StatusCode.INTERNAL_ERROR)
    cmd.respond(result=int(st.ptpl))


def _ns(ctrl: Controller, nsid: int) -> Namespace:
    ns = ctrl.subsystem.namespaces.get(nsid) if ctrl.subsystem else None
    if ns is None:
        raise ProtocolError(f"namespace {nsid} is not active", StatusCode.INVALID_NS)
    return ns

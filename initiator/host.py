"""The host library: connect to an NVMe-oF RDMA subsystem and do block I/O on its namespaces.

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
those namespaces and updates the :class:`Namespace` objects *in place* (a FUSE file that
reads ``ns.size`` sees a resize), adds and removes namespaces, then calls every function in
``Controller.namespace_listeners`` with ``(controller, changed_nsids)``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import importlib
import itertools
import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from blockfabric.errors import (BlockfabricError, ConnectionRejected, QueueDead,
                                WorkCompletionError)  # noqa: F401  (re-exported: users catch it)
from blockfabric.fabric.host_side import STATUS_BITS, HostQueue
from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_host import TcpHostQueue, open_connection
from blockfabric.initiator.multipath import format_path
from blockfabric.protocol import (CC, CQE, CSTS, OAES_NS_ATTR, DISCOVERY_NQN, DYNAMIC_CNTLID, SQE,
                                  ActiveNamespaceList, AsyncEvent, AsyncEventRequest,
                                  AsyncEventType, AsyncNotice, ChangedNamespaceList, CMAccept, CMConnectRequest, CMReject,
                                  ConnectCommand, ConnectData, DatasetManagement,
                                  DiscoveryLogEntry, DiscoveryLogHeader, DSMRange, Flush,
                                  GetLogPage, Identify, IdentifyCNS, IdentifyController,
                                  IdentifyNamespace, IOOpcode, KeepAlive, KeyedSGL, LogPageId,
                                  NumberOfQueues, Property, PropertyGet,
                                  PropertySet, ProtocolError, SetFeatures,
                                  StatusCode, WriteZeroes)
from blockfabric.protocol.auth import (CONNECT_AUTHREQ_ASCR, CONNECT_AUTHREQ_ATR, DHGROUP_NAMES,
                                       HASH_NAMES, AuthError, AuthReceive, AuthSend, Secret,
                                       host_authenticate)
from blockfabric.protocol.admin import OAES_ANA_CHANGE
from blockfabric.protocol.identify import CMIC_ANA
from blockfabric.protocol.logpages import ANA_LSP_RGO, unpack_ana_log
from blockfabric.protocol.opcodes import FeatureId
from blockfabric.rdma import PD, Access, CMId, get_provider

log = logging.getLogger(__name__)

ADMIN_DEPTH = 32
DEFAULT_PORT = 4420
DEFAULT_ARENA = 64 << 20
HOSTNQN_FILES = ("/etc/nvme/hostnqn", "/etc/blockfabric/hostnqn")
HOSTID_FILES = ("/etc/nvme/hostid", "/etc/blockfabric/hostid")
CAPSULE_CONNECT_DATA = 1024
_READ = IOOpcode.READ.value


class NvmeError(BlockfabricError):
    """A command completed with an error status: ``status`` is the StatusCode (SCT << 8 |
    SC), also as ``sct`` and ``sc``; ``dnr`` is Do Not Retry; ``result`` the CQE's DW0."""

    def __init__(self, what: str, status: int, dnr: bool = False, result: int = 0) -> None:
        self.status = StatusCode(status) if 0 <= status <= 0x7FF else status
        self.dnr = dnr
        self.result = result
        name = getattr(self.status, "name", hex(status))
        super().__init__(f"{what}: {name} ({int(status):#05x}{', DNR' if dnr else ''})")

    @classmethod
    def from_word(cls, what: str, word: int, result: int = 0) -> NvmeError:
        """From a response capsule's last 16 bits (phase, SC, SCT, CRD, M, DNR)."""
        return cls(what, (word >> 1) & 0x7FF, bool(word & 0x8000), result)

    @property
    def sct(self) -> int:
        """Status Code Type (0 generic, 1 command specific, 2 media, 3 path related)."""
        return (int(self.status) >> 8) & 7

    @property
    def sc(self) -> int:
        """Status Code, within its type."""
        return int(self.status) & 0xFF


class AuthenticationFailed(BlockfabricError, ConnectionRefusedError):
    """In-band (DH-HMAC-CHAP) authentication did not succeed: no or the wrong secret, or
    the controller could not prove it holds the controller secret."""


class ControllerLost(QueueDead):
    """Reconnecting gave up (ctrl_loss_tmo ran out, or the controller was closed): a held
    command is failed for good.  A file user sees EIO, as with the kernel host."""


class CtrlState(str, enum.Enum):
    """The host controller's life, as the Linux host's LIVE / CONNECTING / DELETING."""

    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass
class RecoveryStats:
    """What reconnecting did, for ``.status``, metrics and tests that must show I/O was held
    and re-issued across a fault rather than merely absent."""

    losses: int = 0             # times the controller was found dead
    attempts: int = 0           # reconnect attempts (each tries every path once)
    reconnects: int = 0         # successful reconnects
    failovers: int = 0          # reconnects that landed on a path other than the lost one
    held: int = 0               # commands held while reconnecting (new or in flight)
    retried: int = 0            # held commands re-issued after a reconnect
    failed: int = 0             # held commands failed after ctrl_loss_tmo
    path_errors: int = 0        # path-related statuses (SCT 3, ANA) re-routed (multipath)
    last_reason: str = ""

    def as_dict(self) -> dict[str, int | str]:
        return dict(self.__dict__)


class HeldCommand:
    """What every I/O command has, so that it can be held while the controller reconnects
    and issued again after (read, write, flush, write zeroes and DSM are idempotent): the
    one callback, ``parent.io_done(command, error)``, run exactly once per issue with None,
    an :class:`NvmeError` (the command's status), or :class:`ControllerLost`."""

    __slots__ = ("parent", "nsid", "gen", "held", "path")

    def __init__(self, parent: Any, nsid: int = 0) -> None:
        self.parent = parent
        self.nsid = nsid
        self.gen = -1
        self.held = 0
        self.path: Controller | None = None     # the path it was last sent on (multipath)

    def lost(self, exc: BaseException) -> None:
        self.parent.io_done(self, exc)


class IoCommand(HeldCommand):
    """The I/O primitive: one Read or Write (one piece at MDTS) that its user keeps and
    reuses.  The user fills the fields (or lets :meth:`Controller.plan_io` do it) and calls
    :meth:`Controller.issue`; the data moves by RDMA to or from ``length`` bytes at ``addr``
    under ``rkey`` (memory registered with the controller's PD), or, for a write whose
    ``data`` (a view of those bytes) fits, in the capsule.

    ``parent.io_done(cmd, error)`` runs exactly once per issue, on the controller's reactor
    thread: ``error`` is None, an :class:`NvmeError` (the command's status) or
    :class:`ControllerLost`.  A command lost with its queue is held and re-issued after a
    reconnect, as every I/O command is (``held`` counts how often).  Nothing is allocated
    on the way: the queue packs the SQE into its slot's buffer from these fields."""

    __slots__ = ("ctrl", "opcode", "slba", "nlb", "addr", "length", "rkey", "data")

    def __init__(self, ctrl: Controller, parent: Any) -> None:
        HeldCommand.__init__(self, parent)
        self.ctrl = ctrl
        self.opcode = IOOpcode.READ.value
        self.slba = self.nlb = self.addr = self.length = self.rkey = 0
        self.data: Any = None

    def send(self, ctrl: Controller, queue: HostQueue) -> None:
        queue.submit_rw(self, self.opcode, self.nsid, self.slba, self.nlb, self.addr,
                        self.length, self.rkey, self.data)

    def complete(self, raw: tuple | None, error: QueueDead | None) -> None:
        """The queue's callback (reactor thread)."""
        if error is not None:
            self.ctrl._hold(self, error)
            return
        word = raw[4]
        if word & STATUS_BITS:
            if word & 0x0E00 == 0x0600:     # SCT 3, path related (ANA): another path may serve
                self.ctrl._path_status(self, word, raw[0])
                return
            self.parent.io_done(self, NvmeError.from_word(
                "Read" if self.opcode == _READ else "Write", word, raw[0]))
        else:
            self.parent.io_done(self, None)


class SqeCommand(HeldCommand):
    """An I/O command that is not a read or a write (Flush, Write Zeroes, Dataset
    Management): built afresh by ``make_sqe`` for each issue, ``data_out`` (if any) sent
    from the arena or in the capsule; held and re-issued, and completed, like an
    :class:`IoCommand`."""

    __slots__ = ("ctrl", "make_sqe", "what", "data_out")

    def __init__(self, ctrl: Controller, parent: Any, nsid: int, make_sqe: Callable[[], SQE],
                 what: str, data_out: bytes | None = None) -> None:
        HeldCommand.__init__(self, parent, nsid)
        self.ctrl = ctrl
        self.make_sqe = make_sqe
        self.what = what
        self.data_out = data_out

    def send(self, ctrl: Controller, queue: HostQueue) -> None:
        inline = self.data_out is not None and len(self.data_out) <= queue.inline_size
        ctrl.submit(queue, self.make_sqe(), self._completed, data_out=self.data_out,
                    inline=inline)

    def _completed(self, cqe: CQE | None, _data: Any, error: QueueDead | None) -> None:
        if error is not None:
            self.ctrl._hold(self, error)
            return
        status = int(cqe.status)
        if not status:
            self.parent.io_done(self, None)
        elif (status >> 8) & 7 == 3:        # path related: another path may serve
            self.ctrl._path_status(self, status << 1 | cqe.dnr << 15, cqe.result)
        else:
            self.parent.io_done(self, NvmeError(self.what, status, cqe.dnr, cqe.result))


class IoJoin:
    """The parent of one request's commands (its pieces at MDTS): ``callback(error)`` once,
    when the last is done, with the first error or None."""

    __slots__ = ("callback", "left", "error")

    def __init__(self, callback: Callable[[BaseException | None], None], left: int) -> None:
        self.callback = callback
        self.left = left
        self.error: BaseException | None = None

    def io_done(self, _cmd: HeldCommand, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        if not self.left:
            self.callback(self.error)


class _FutureJoin:
    """The parent of a future's commands: the data sits in one arena block, copied out for
    a read; the block goes back and the future is settled when the last command is done."""

    __slots__ = ("future", "left", "error", "arena", "block", "read_length")

    def __init__(self, future: concurrent.futures.Future, left: int, arena: Arena | None = None,
                 block: tuple[int, int] | None = None, read_length: int = 0) -> None:
        self.future = future
        self.left = left
        self.error: BaseException | None = None
        self.arena = arena
        self.block = block
        self.read_length = read_length

    def io_done(self, _cmd: HeldCommand, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        if self.left:
            return
        data = None
        block = self.block
        if block is not None:
            if self.read_length and self.error is None:
                data = bytes(self.arena.view[block[0]:block[0] + self.read_length])
            self.arena.free(*block)
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(data)


# --------------------------------------------------------------------------- host identity

def default_hostnqn() -> str:
    """``/etc/nvme/hostnqn`` as nvme-cli, else one generated once under /etc/blockfabric."""
    return _stable_id(HOSTNQN_FILES, lambda: f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}")


def default_hostid() -> bytes:
    text = _stable_id(HOSTID_FILES, lambda: str(uuid.uuid4()))
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_OID, text).bytes


def _stable_id(files: tuple[str, ...], make: Callable[[], str]) -> str:
    for path in files:
        try:
            with open(path, encoding="ascii") as f:
                value = f.read().strip()
            if value:
                return value
        except OSError:
            continue
    value = make()
    path = files[-1]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # read-only /etc: still usable, just not stable across runs
        log.warning("could not keep %s (%s): using %s for this run", path, exc, value)
    return value


# --------------------------------------------------------------------------- registered memory

class Arena:
    """Registered host memory for I/O buffers, in power-of-two blocks of 4 KiB and up.

    Freed blocks go back to their size class and are never merged: I/O sizes repeat, so the
    classes settle quickly and an allocation is a list pop.
    """

    MIN_BLOCK = 4096

    def __init__(self, pd: PD, size: int) -> None:
        self.size = size
        self._mem = mmap.mmap(-1, size)
        self.mr = pd.reg_mr(self._mem, Access.LOCAL_WRITE | Access.REMOTE_READ
                            | Access.REMOTE_WRITE)
        self.view = self.mr.buf
        self._bump = 0
        self._free: dict[int, list[int]] = {}
        self._cond = threading.Condition()

    def alloc(self, nbytes: int, timeout: float | None = 30.0) -> tuple[int, int]:
        """(offset, block size) of a block of at least ``nbytes``."""
        block = max(self.MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())
        if block > self.size:
            raise ValueError(f"{nbytes} bytes exceed the {self.size}-byte I/O arena")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                free = self._free.get(block)
                if free:
                    return free.pop(), block
                if self._bump + block <= self.size:
                    offset = self._bump
                    self._bump += block
                    return offset, block
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError("no free I/O buffer")
                self._cond.wait(wait)

    def free(self, offset: int, block: int) -> None:
        with self._cond:
            self._free.setdefault(block, []).append(offset)
            self._cond.notify()

    def sgl(self, offset: int, length: int) -> KeyedSGL:
        return KeyedSGL(self.mr.addr + offset, length, self.mr.rkey, False)

    def close(self) -> None:
        self.view = None
        self.mr.close()
        try:
            self._mem.close()
        except BufferError:
            pass


class HostMemory:
    """``size`` bytes of this process's memory registered with a controller's PD for both
    RDMA directions: where a caller's own reads land and its writes come from (the FUSE
    server's request buffers, the bench's slots), named in a keyed SGL by ``addr`` and
    ``rkey``, with no arena block and no copy."""

    def __init__(self, pd: PD, size: int) -> None:
        self._mem = mmap.mmap(-1, size)
        self.mr = pd.reg_mr(self._mem, Access.LOCAL_WRITE | Access.REMOTE_READ
                            | Access.REMOTE_WRITE)
        self.view: memoryview = self.mr.buf
        self.addr: int = self.mr.addr
        self.rkey: int = self.mr.rkey

    def close(self) -> None:
        """Deregister and unmap (views of it taken by the caller must be released first)."""
        try:
            self.mr.close()
        finally:
            try:
                self._mem.close()
            except BufferError:     # a view still exported elsewhere keeps it alive
                pass


# --------------------------------------------------------------------------- namespaces

@dataclass
class Namespace:
    """One namespace of a connected controller.  Offsets and lengths are in bytes and must
    be multiples of ``block_size``."""

    ctrl: Controller
    nsid: int
    block_size: int
    nblocks: int
    read_only: bool
    nguid: bytes = b""
    identify: IdentifyNamespace | None = field(default=None, repr=False)
    #: False once the target removed the namespace (I/O then fails with invalid namespace).
    active: bool = True

    @property
    def size(self) -> int:
        return self.nblocks * self.block_size

    def _check(self, offset: int, length: int) -> None:
        bs = self.block_size
        if offset % bs or length % bs or length <= 0:
            raise ValueError(f"offset {offset} and length {length} must be positive "
                             f"multiples of the {bs}-byte block size")
        if offset < 0:
            raise ValueError(f"negative offset {offset}")

    def submit_read(self, offset: int, length: int) -> concurrent.futures.Future:
        """Start a read; the future's result is the bytes read."""
        self._check(offset, length)
        return self.ctrl._io(self, IOOpcode.READ, offset, length, None)

    def submit_write(self, offset: int, data) -> concurrent.futures.Future:
        view = memoryview(data).cast("B")
        self._check(offset, len(view))
        return self.ctrl._io(self, IOOpcode.WRITE, offset, len(view), view)

    def read(self, offset: int, length: int) -> bytes:
        return self.submit_read(offset, length).result()

    def readinto(self, offset: int, buf) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(offset, len(view))
        view[:] = data
        return len(view)

    def write(self, offset: int, data) -> None:
        self.submit_write(offset, data).result()

    def flush(self) -> None:
        self.ctrl.wait_io(self.nsid, lambda: Flush(nsid=self.nsid).to_sqe(), "Flush")

    def write_zeroes(self, offset: int, length: int, deallocate: bool = False) -> None:
        self._check(offset, length)
        bs = self.block_size
        for start, count in _chunks(offset // bs, length // bs, 0x10000):
            self.ctrl.wait_io(self.nsid, lambda: WriteZeroes(
                nsid=self.nsid, slba=start, nlb=count - 1, deac=deallocate).to_sqe(),
                "Write Zeroes")

    def discard(self, offset: int, length: int) -> None:
        """Dataset Management, deallocate (what blkdiscard / punch hole send)."""
        self._check(offset, length)
        bs = self.block_size
        ranges = [DSMRange(0, count, start)
                  for start, count in _chunks(offset // bs, length // bs, 0xFFFFFFFF)]
        for i in range(0, len(ranges), 256):
            batch = ranges[i:i + 256]
            payload = b"".join(r.pack() for r in batch)
            nr = len(batch) - 1
            self.ctrl.wait_io(self.nsid, lambda: DatasetManagement(nsid=self.nsid, nr=nr,
                                                                   ad=True).to_sqe(),
                              "Dataset Management", data_out=payload)


def _chunks(start: int, count: int, most: int) -> Iterable[tuple[int, int]]:
    while count > 0:
        n = min(count, most)
        yield start, n
        start += n
        count -= n


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
    arena_size: int = DEFAULT_ARENA
    disable_sqflow: bool = False
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


#: Bytes of ANA log read: the header, 128 group descriptors and 1024 NSIDs (what the
#: Linux host sizes its buffer to: 16 + NANAGRPID * 32 + MNAN * 4).
ANA_LOG_READ = 16 + 128 * 32 + 1024 * 4


class Controller:
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
        self.namespaces: dict[int, Namespace] = {}
        self.cntlid = 0
        self.identify: IdentifyController | None = None
        self.arena: Arena | None = None
        self.pd: PD | None = None
        self._rr = itertools.count()
        self._ka_timer = None
        self._closed = False
        self.max_transfer = 128 << 10
        self.inline_size = 0
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

    # -- set-up ----------------------------------------------------------------------
    def open_queue(self, qid: int, depth: int) -> HostQueue:
        """Set up the RDMA connection of queue ``qid`` (CM private data exchanged, receives
        posted, serviced by this controller's reactor), not yet bound by a Fabrics Connect."""
        opts = self.opts
        traddr, trsvcid = self.path
        if opts.transport == "tcp":
            return self._open_tcp_queue(qid, depth)
        cmid: CMId = self.provider.create_id()
        try:
            cmid.resolve(traddr, trsvcid, timeout=opts.connect_timeout)
            if self.pd is None:
                self.pd, self.arena = (self._share or self)._memory("rdma", cmid.context)
            inline = self.inline_size if qid else 0
            queue = HostQueue(cmid, self.pd, qid=qid, depth=depth, inline_size=inline,
                              name=f"{traddr}:{trsvcid} q{qid}")
        except BaseException:
            cmid.close()
            raise
        try:
            queue.post_all_receives()
            request = CMConnectRequest(recfmt=0, qid=qid, hrqsize=depth, hsqsize=depth - 1,
                                       cntlid=self.cntlid if qid else 0)
            try:
                accept = cmid.connect(request.pack(), timeout=opts.connect_timeout)
            except ConnectionRejected as exc:
                where = f"{traddr}:{trsvcid}"
                if not exc.private_data:
                    raise ConnectionRefusedError(
                        f"connection to {where} refused: is a target listening there, with "
                        f"provider {self.provider.name}?") from exc
                raise ConnectionRefusedError(f"{where}: " + _reject_text(exc.private_data,
                                                                          qid)) from exc
            try:
                CMAccept.unpack_from(accept)
            except ProtocolError as exc:
                raise ConnectionError(f"malformed CM accept from the target: {exc}") from exc
        except BaseException:
            queue.close()
            raise
        queue.attach(self.reactor)
        return queue

    def _memory(self, transport: str, context: Any = None) -> tuple[PD, Arena]:
        """The protection domain and arena a queue of ``transport`` uses: this controller's,
        made on first use (RDMA: on the device ``context`` of the queue's CM id; TCP: a local
        one).  A multipath controller shares its own with its paths, whatever their
        transports."""
        if self.pd is None:
            self.pd = context.alloc_pd() if transport == "rdma" else local_pd()
            self.arena = Arena(self.pd, self.opts.arena_size)
        return self.pd, self.arena

    def _open_tcp_queue(self, qid: int, depth: int) -> HostQueue:
        """The NVMe/TCP connection of queue ``qid`` (ICReq/ICResp done), attached."""
        opts = self.opts
        traddr, trsvcid = self.path
        if self.pd is None:
            self.pd, self.arena = (self._share or self)._memory("tcp")
        sock, resp = open_connection(traddr, trsvcid, hdgst=opts.hdr_digest,
                                     ddgst=opts.data_digest, timeout=opts.connect_timeout,
                                     hpda=opts.hpda)
        queue = TcpHostQueue(sock, self.pd, resp, qid=qid, depth=depth,
                             inline_size=self.inline_size if qid else 0,
                             name=f"{traddr}:{trsvcid} q{qid} tcp", hpda=opts.hpda)
        try:
            queue.attach(self.reactor)
        except BaseException:
            queue.close()
            raise
        return queue

    def fabrics_connect(self, queue: HostQueue, qid: int, sqsize: int, kato_ms: int, *,
                        authenticate: bool = True) -> int:
        """Send the Fabrics Connect for ``queue``, and authenticate the queue when the
        controller asks for it (ATR), as the Linux host does; returns the controller id.
        ``authenticate=False`` leaves that to the caller (tests)."""
        data = ConnectData(hostid=self.hostid, cntlid=DYNAMIC_CNTLID if qid == 0 else
                           self.cntlid, subnqn=self.opts.subnqn, hostnqn=self.hostnqn).pack()
        cattr = 4 if self.opts.disable_sqflow else 0
        sqe = ConnectCommand(recfmt=0, qid=qid, sqsize=sqsize, cattr=cattr,
                             kato=kato_ms).to_sqe()
        inline = qid != 0 and queue.inline_size >= CAPSULE_CONNECT_DATA
        cqe, _ = self.wait(queue, sqe, f"Connect (queue {qid})", data_out=data,
                           inline=inline)
        self.connect_result = result = cqe.result & 0xFFFFFFFF
        if authenticate and result & (CONNECT_AUTHREQ_ATR | CONNECT_AUTHREQ_ASCR):
            self._authenticate(queue, qid, result)
        return result & 0xFFFF

    def _authenticate(self, queue: HostQueue, qid: int, result: int) -> None:
        subnqn = self.opts.subnqn
        if result & CONNECT_AUTHREQ_ASCR:
            raise AuthenticationFailed(f"{subnqn} requires a secure channel (ASCR): not "
                                       "supported")
        if self.dhchap_secret is None:
            raise AuthenticationFailed(
                f"{subnqn} requires host {self.hostnqn} to authenticate: give its "
                "DH-HMAC-CHAP secret (--dhchap-secret, or dhchap_secret in the initiator "
                "configuration)")
        try:
            res = host_authenticate(
                lambda msg: self.auth_send(queue, msg),
                lambda al: self.auth_receive(queue, al),
                t_id=next(self._transactions) & 0xFFFF, hostnqn=self.hostnqn, subnqn=subnqn,
                secret=self.dhchap_secret, ctrl_secret=self.dhchap_ctrl_secret)
        except AuthError as exc:
            raise AuthenticationFailed(f"queue {qid}: DH-HMAC-CHAP authentication with "
                                       f"{subnqn} as {self.hostnqn} failed: {exc}") from exc
        except NvmeError as exc:
            raise AuthenticationFailed(f"queue {qid}: DH-HMAC-CHAP authentication with "
                                       f"{subnqn} failed: {exc}") from exc
        except (QueueDead, TimeoutError) as exc:
            # Linux nvmet ends the controller as it sends Failure1, and the end may overtake
            # the message: a dropped queue in mid-exchange is most likely a refusal
            raise AuthenticationFailed(
                f"queue {qid}: DH-HMAC-CHAP authentication with {subnqn} as {self.hostnqn} "
                f"failed: the controller ended the exchange without an answer ({exc}); a "
                "controller does that when it does not accept the host's response: check "
                "the secret") from exc
        how = (f"hmac({HASH_NAMES.get(res.hash_id, res.hash_id)}), "
               f"{DHGROUP_NAMES.get(res.dhgroup, res.dhgroup)}"
               + (", controller authenticated" if res.bidirectional else ""))
        self.authenticated[qid] = how
        log.log(logging.INFO if qid == 0 else logging.DEBUG, "qid %d: authenticated (%s)",
                qid, how)

    def auth_send(self, queue: HostQueue, message: bytes) -> None:
        """Authentication Send (DH-HMAC-CHAP) of ``message``."""
        self.wait(queue, AuthSend(tl=len(message)).to_sqe(), "Authentication Send",
                  data_out=message)

    def auth_receive(self, queue: HostQueue, al: int) -> bytes:
        """Authentication Receive of ``al`` bytes: the controller's next message."""
        _, data = self.wait(queue, AuthReceive(al=al).to_sqe(), "Authentication Receive",
                            data_in=al)
        return data

    def connect(self) -> Controller:
        self.reactor.start()
        try:
            self._establish()
        except BaseException:
            self.close()
            raise
        self.state = CtrlState.LIVE
        return self

    def _establish(self) -> None:
        """Everything ``nvme connect`` does, on the current path; also each reconnect."""
        opts = self.opts
        with self._state_lock:
            self._gen += 1          # what the lost connection left behind is stale now
        self.admin = self.open_queue(0, ADMIN_DEPTH)
        kato_ms = int(opts.keep_alive_tmo * 1000)
        if opts.subnqn == DISCOVERY_NQN:
            kato_ms = 0
        self.cntlid = self.fabrics_connect(self.admin, 0, ADMIN_DEPTH - 1, kato_ms)
        self._enable()
        self.identify = IdentifyController.unpack_from(self._identify(IdentifyCNS.CONTROLLER))
        if self.identify.cntlid != self.cntlid:
            log.warning("Identify cntlid %d differs from Connect's %d",
                        self.identify.cntlid, self.cntlid)
        if self.identify.mdts:
            self.max_transfer = min(4096 << self.identify.mdts, 8 << 20)
        else:
            self.max_transfer = 8 << 20
        self.inline_size = max(0, self.identify.ioccsz * 16 - 64)
        if kato_ms and opts.send_keep_alive:
            self._schedule_keep_alive(kato_ms)
        if opts.subnqn != DISCOVERY_NQN:
            self._setup_io(opts)
            self._start_events()

    def _enable(self) -> None:
        cap = self.property_get(Property.CAP, 8)
        cc = CC(en=True, css=0, mps=0, ams=0, shn=0, iosqes=6, iocqes=4)
        self.property_set(Property.CC, cc.to_int())
        deadline = time.monotonic() + max(0.5, ((cap >> 24) & 0xFF) * 0.5)
        while True:
            csts = CSTS.from_int(self.property_get(Property.CSTS, 4))
            if csts.cfs:
                raise ConnectionError("controller fatal status while enabling")
            if csts.rdy:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("controller did not become ready")
            time.sleep(0.01)

    def _setup_io(self, opts: ConnectOptions) -> None:
        want = max(1, opts.nr_io_queues)
        cqe, _ = self.wait(self.admin, SetFeatures(
            fid=FeatureId.NUM_QUEUES, value=NumberOfQueues(nsqr=want - 1,
                                                           ncqr=want - 1).to_int()).to_sqe(),
            "Set Features (number of queues)")
        granted = NumberOfQueues.from_int(cqe.result & 0xFFFFFFFF)
        count = min(want, granted.nsqr + 1, granted.ncqr + 1)
        depth = min(opts.queue_size, (self.identify.maxcmd or opts.queue_size))
        for qid in range(1, count + 1):
            queue = self.open_queue(qid, depth)
            self.io_queues.append(queue)
            self.fabrics_connect(queue, qid, depth - 1, 0)
        self.rescan()

    def rescan(self, nsids: Iterable[int] | None = None) -> set[int]:
        """Identify ``nsids`` (None: the active namespace list plus those known) and bring
        ``namespaces`` up to date, changing existing objects in place.  Returns the NSIDs
        that were added, removed or changed."""
        if nsids is None:
            active = ActiveNamespaceList.unpack_from(
                self._identify(IdentifyCNS.ACTIVE_NS_LIST, 0)).nsids
            nsids = set(active) | set(self.namespaces)
        changed = set()
        for nsid in sorted(n for n in nsids if n):
            ident = IdentifyNamespace.unpack_from(self._identify(IdentifyCNS.NAMESPACE, nsid))
            ns = self.namespaces.get(nsid)
            if ident.nsze == 0:                     # inactive: the all-zero page
                if ns is not None:
                    ns.active = False
                    del self.namespaces[nsid]
                    changed.add(nsid)
                continue
            read_only = bool(ident.nsattr & 1)
            if ns is None:
                self.namespaces[nsid] = Namespace(self, nsid, ident.block_size, ident.nsze,
                                                  read_only, ident.nguid, ident)
                changed.add(nsid)
            elif (ns.nblocks, ns.block_size, ns.read_only) != (ident.nsze, ident.block_size,
                                                               read_only):
                ns.block_size, ns.nblocks, ns.read_only = ident.block_size, ident.nsze, \
                    read_only
                ns.identify = ident
                changed.add(nsid)
        return changed

    # -- asynchronous events -------------------------------------------------------------
    def _start_events(self) -> None:
        """Ask for namespace attribute notices and keep an AER outstanding."""
        ana = bool(self.identify and self.identify.cmic & CMIC_ANA)
        self.wait(self.admin, SetFeatures(fid=FeatureId.ASYNC_EVENT, value=OAES_NS_ATTR | (
            OAES_ANA_CHANGE if ana else 0)).to_sqe(),
                  "Set Features (asynchronous event configuration)")
        if ana:
            self.read_ana_log()
        if self._events is None:
            self._events = concurrent.futures.ThreadPoolExecutor(1, "nvme-aen")
        self._submit_aer()

    def _submit_aer(self) -> None:
        if self._closed or self.admin is None or self.admin.dead_reason:
            return
        try:
            self.submit(self.admin, AsyncEventRequest().to_sqe(), self._on_aer)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("AER not submitted: %s", exc)

    def _on_aer(self, cqe: CQE | None, _data, error: str | None) -> None:
        """On the reactor: hand the event to the worker (it must wait for commands)."""
        if error is not None or cqe is None or self._closed:
            return
        if cqe.status != StatusCode.SUCCESS:        # 0x4006: the controller is going away
            log.debug("AER completed with %s", cqe.status)
            return
        event = AsyncEvent.from_int(cqe.result & 0xFFFFFFFF)
        try:
            self._events.submit(self._handle_event, event)
        except RuntimeError:                        # closing
            pass

    def _handle_event(self, event: AsyncEvent) -> None:
        changed: set[int] = set()
        try:
            if event.event_type == AsyncEventType.NOTICE \
                    and event.info == AsyncNotice.NS_ATTR_CHANGED:
                page = ChangedNamespaceList.unpack_from(
                    self.get_log_page(LogPageId.CHANGED_NS, 4096))   # re-arms the event
                changed = self.rescan(None if page.overflowed else page.nsids)
                log.info("namespaces changed: %s", sorted(changed) or "none")
            elif event.event_type == AsyncEventType.NOTICE \
                    and event.info == AsyncNotice.ANA_CHANGE:
                ana = self.read_ana_log()                          # re-arms the event
                log.info("ANA change: chgcnt=%d %s", ana[0],
                         {g.grpid: g.state.name.lower() for g in ana[1]})
                for listener in list(self.ana_listeners):
                    try:
                        listener(self, ana)
                    except Exception:
                        log.exception("ANA listener %r failed", listener)
            else:
                log.info("asynchronous event %s ignored", event)
        except (BlockfabricError, ConnectionError, TimeoutError) as exc:
            if not self._closed:
                log.warning("handling %s: %s", event, exc)
            return
        finally:
            self._submit_aer()
        for listener in list(self.namespace_listeners):
            try:
                listener(self, changed)
            except Exception:  # one subscriber must not starve the others
                log.exception("namespace listener %r failed", listener)

    def read_ana_log(self, rgo: bool = False) -> tuple[int, list]:
        """Read the ANA log page (LID 0x0C): (chgcnt, [AnaGroupDescriptor])."""
        _, data = self.wait(self.admin, GetLogPage(
            nsid=0xFFFFFFFF, lid=LogPageId.ANA, lsp=ANA_LSP_RGO if rgo else 0,
            numd=GetLogPage.numd_for(ANA_LOG_READ)).to_sqe(), "Get Log Page 0xc",
            data_in=ANA_LOG_READ)
        self.ana_log = unpack_ana_log(data)
        return self.ana_log

    def _identify(self, cns: int, nsid: int = 0) -> bytes:
        _, data = self.wait(self.admin, Identify(nsid=nsid, cns=cns).to_sqe(),
                            f"Identify CNS {int(cns)}", data_in=4096)
        return data

    def property_get(self, offset: int, size: int) -> int:
        cqe, _ = self.wait(self.admin, PropertyGet(attrib=1 if size == 8 else 0,
                                                   offset=offset).to_sqe(),
                           f"Property Get {offset:#x}")
        return cqe.result if size == 8 else cqe.result & 0xFFFFFFFF

    def property_set(self, offset: int, value: int) -> None:
        self.wait(self.admin, PropertySet(attrib=0, offset=offset, value=value).to_sqe(),
                  f"Property Set {offset:#x}")

    def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0,
                     rae: bool = False) -> bytes:
        _, data = self.wait(self.admin, GetLogPage(
            nsid=nsid, lid=lid, rae=rae, numd=GetLogPage.numd_for(length),
            lpo=offset).to_sqe(), f"Get Log Page {int(lid):#x}", data_in=length)
        return data

    # -- keep-alive ------------------------------------------------------------------
    def _schedule_keep_alive(self, kato_ms: int) -> None:
        """Send a Keep Alive every KATO/2; one unanswered for KATO means the target is gone
        (paused, partitioned) even though no queue has reported an error."""
        gen = self._gen
        self._ka_sent = None

        def send() -> None:
            if self._closed or gen != self._gen or self.admin is None:
                return
            if self.admin.dead_reason:
                # The queues died with nothing in flight (an idle host): no command will
                # fail to say so, so this tick starts the reconnect, as the Linux host does.
                self._lost(f"admin queue lost: {self.admin.dead_reason}")
                return
            now = time.monotonic()
            if self._ka_sent is not None:
                if now - self._ka_sent >= kato_ms / 1000:
                    self._lost(f"keep-alive unanswered for {kato_ms} ms")
                    return
            else:
                self._ka_sent = now
                try:
                    self.submit(self.admin, KeepAlive().to_sqe(), _ka_done)
                except (ConnectionError, TimeoutError) as exc:
                    self._lost(f"keep-alive not sent: {exc}")
                    return
            self._ka_timer = self.reactor.call_later(kato_ms / 2000, send)

        def _ka_done(cqe, _data, error) -> None:
            if gen != self._gen:
                return
            self._ka_sent = None
            if error or (cqe is not None and cqe.status != StatusCode.SUCCESS):
                self._lost(f"keep-alive failed: {error or cqe.status.name}")

        self.reactor.call_soon_threadsafe(
            lambda: setattr(self, "_ka_timer", self.reactor.call_later(kato_ms / 2000, send)))

    # -- command submission ------------------------------------------------------------
    def io_queue(self) -> HostQueue:
        if not self.io_queues:
            raise QueueDead("no I/O queues")
        return self.io_queues[next(self._rr) % len(self.io_queues)]

    def submit(self, queue: HostQueue, sqe: SQE, callback, *, data_out=None,
               data_in: int = 0, inline: bool = False, sgl: KeyedSGL | None = None) -> None:
        """Submit with data handled: ``data_out`` bytes go in-capsule (``inline``) or from
        the arena by keyed SGL; ``data_in`` bytes come back into the arena.  ``callback(cqe,
        data, error)`` gets the data read (bytes) for ``data_in``.  With ``sgl`` (memory the
        caller registered), the data moves straight to or from there and ``data`` is None."""
        arena = self.arena
        block = None
        if data_out is not None and inline:
            queue.submit(sqe, lambda cqe, err: callback(cqe, None, err), inline=data_out)
            return
        if sgl is not None:
            sqe.sgl = sgl
            queue.submit(sqe, lambda cqe, err: callback(cqe, None, err))
            return
        length = len(data_out) if data_out is not None else data_in
        if length:
            offset, size = arena.alloc(length)
            block = (offset, size)
            if data_out is not None:
                arena.view[offset:offset + length] = data_out
            sqe.sgl = arena.sgl(offset, length)

        def done(cqe: CQE | None, error: str | None) -> None:
            data = None
            if block is not None:
                if data_in and cqe is not None and error is None:
                    data = bytes(arena.view[block[0]:block[0] + data_in])
                arena.free(*block)
            callback(cqe, data, error)

        try:
            queue.submit(sqe, done)
        except BaseException:
            if block is not None:
                arena.free(*block)
            raise

    def wait(self, queue: HostQueue, sqe: SQE, what: str, *, data_out=None, data_in: int = 0,
             inline: bool = False, timeout: float | None = None) -> tuple[CQE, bytes | None]:
        """Submit and wait; raise NvmeError on an error status, QueueDead if the queue dies."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cb(cqe, data, error) -> None:
            fut.set_result((cqe, data, error))

        self.submit(queue, sqe, cb, data_out=data_out, data_in=data_in, inline=inline)
        if timeout is None and self.state != CtrlState.LIVE:
            timeout = self.opts.connect_timeout     # (re)connecting to a target that hangs
        try:
            cqe, data, error = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what}: no answer from the target within {timeout:g} s"
                               ) from None
        if error is not None:
            raise _queue_error(error, what)
        if cqe.status != StatusCode.SUCCESS:
            raise NvmeError(what, cqe.status, cqe.dnr, cqe.result)
        return cqe, data

    def raw(self, queue: HostQueue, capsule: bytes, timeout: float | None = 10.0) -> CQE:
        """Send ``capsule`` as is (only its cid is set) and return the response, whatever its
        status: for tools and tests that must send what a normal host never would."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        queue.submit_raw(capsule, lambda cqe, err: fut.set_result((cqe, err)), timeout)
        cqe, error = fut.result(timeout)
        if error is not None:
            raise _queue_error(error, "raw command")
        return cqe

    def _io(self, ns: Namespace, opcode: int, offset: int, length: int,
            data: memoryview | None) -> concurrent.futures.Future:
        """Read or write through an arena block, split at the transfer limit; one future
        for the whole range (its result: the bytes read, or None).  The range is not
        checked against the namespace size here: the target answers LBA out of range, and
        that real status is what the caller should see."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        arena = self.arena
        at, size = arena.alloc(length)
        view = None
        if data is not None:
            arena.view[at:at + length] = data
            view = arena.view[at:at + length]
        join = _FutureJoin(fut, 0, arena, (at, size), length if data is None else 0)
        cmds: list[IoCommand] = []
        try:
            n = join.left = self.plan_io(cmds, join, ns, opcode, offset, length,
                                         arena.mr.addr + at, arena.mr.rkey, view)
        except BaseException:
            arena.free(at, size)
            raise
        for i in range(n):
            self.issue(cmds[i])
        return fut

    def wait_io(self, nsid: int, make_sqe: Callable[[], SQE], what: str, *,
                data_out=None) -> None:
        """An I/O command with no data back (flush, write zeroes, DSM), held and re-issued
        across a reconnect like reads and writes; raise NvmeError on an error status."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._dispatch(SqeCommand(self, _FutureJoin(fut, 1), nsid, make_sqe, what,
                                  data_out))
        fut.result()

    def start_io(self, ns: Namespace, opcode: int, offset: int, length: int, addr: int,
                 rkey: int, callback: Callable[[BaseException | None], None], *,
                 data_out=None) -> int:
        """Read or write ``[offset, offset + length)`` straight from or into memory the
        caller registered with :attr:`pd` (``addr``, ``rkey``): no arena block, no copy, no
        future.  ``data_out`` (a view of that same memory, for writes) lets pieces that fit
        travel in-capsule.  ``callback(error)`` runs once, on the reactor thread, with None
        or the exception (NvmeError, ControllerLost); I/O is held across reconnects like
        every I/O command.  Returns the number of NVMe commands issued (pieces at MDTS).
        A caller that issues many keeps its :class:`IoCommand` objects and uses
        :meth:`plan_io` and :meth:`issue` instead: nothing is allocated per I/O then.

        It never waits for a command slot only if the caller keeps fewer commands in flight
        than a queue has slots (the FUSE server counts them); on the reactor thread a full
        queue raises TimeoutError (that thread would wait for itself)."""
        cmds: list[IoCommand] = []
        join = IoJoin(callback, 0)
        n = join.left = self.plan_io(cmds, join, ns, opcode, offset, length, addr, rkey,
                                     data_out)
        for i in range(n):
            self.issue(cmds[i])
        return n

    def plan_io(self, cmds: list[IoCommand], parent: Any, ns: Namespace, opcode: int,
                offset: int, length: int, addr: int, rkey: int, data=None) -> int:
        """Fill ``cmds`` (reused; grown with new :class:`IoCommand` objects of ``parent`` as
        needed) with the Read or Write pieces of ``[offset, offset + length)`` at the
        transfer limit (MDTS), and return how many there are: the first that many of
        ``cmds`` are to be issued.  ``addr``/``rkey``: registered memory of the data;
        ``data``: a view of it, for writes whose pieces may travel in-capsule."""
        bs = ns.block_size
        most = self.max_transfer
        nsid = ns.nsid
        if length <= most:                      # the common case: one command
            if not cmds:
                cmds.append(IoCommand(self, parent))
            cmd = cmds[0]
            cmd.opcode = opcode
            cmd.nsid = nsid
            cmd.slba = offset // bs
            cmd.nlb = length // bs - 1
            cmd.addr = addr
            cmd.length = length
            cmd.rkey = rkey
            cmd.data = data
            return 1
        n = 0
        for start, count in _chunks(offset, length, most):
            if count // bs > 0x10000:
                raise ValueError(f"{count} bytes is more blocks than one command carries")
            if n == len(cmds):
                cmds.append(IoCommand(self, parent))
            cmd = cmds[n]
            rel = start - offset
            cmd.opcode = opcode
            cmd.nsid = nsid
            cmd.slba = start // bs
            cmd.nlb = count // bs - 1
            cmd.addr = addr + rel
            cmd.length = count
            cmd.rkey = rkey
            cmd.data = None if data is None else data[rel:rel + count]
            n += 1
        return n

    def issue(self, cmd: IoCommand, queue: HostQueue | None = None) -> None:
        """Send ``cmd`` on ``queue`` (default: the next I/O queue, round robin), or hold it
        while the controller reconnects.  The live controller's path takes no lock."""
        if self.state is CtrlState.LIVE:
            cmd.gen = self._gen
            if queue is None:
                queues = self.io_queues
                if queues:
                    queue = queues[next(self._rr) % len(queues)]
            if queue is not None:
                try:
                    queue.submit_rw(cmd, cmd.opcode, cmd.nsid, cmd.slba, cmd.nlb, cmd.addr,
                                    cmd.length, cmd.rkey, cmd.data)
                except ConnectionError as exc:
                    self._hold(cmd, exc)
                return
        self._dispatch(cmd)

    # -- reconnecting (nvme-cli semantics: reconnect_delay, ctrl_loss_tmo) ---------------
    def _dispatch(self, req: HeldCommand) -> None:
        """Send ``req`` on an I/O queue, or hold it while the controller reconnects."""
        with self._state_lock:
            state = self.state
            if state == CtrlState.RECONNECTING:
                self._held.append(req)
                self.recovery.held += 1
                return
            req.gen = self._gen
        if state in (CtrlState.FAILED, CtrlState.CLOSED):
            self._lose([req], ControllerLost(f"controller {state.value}: "
                                             f"{self.recovery.last_reason}"))
            return
        try:
            req.send(self, self.io_queue())
        except ConnectionError as exc:
            self._hold(req, exc)

    def _lose(self, reqs: list, exc: BaseException) -> None:
        """Fail ``reqs`` for good with ``exc``, on the reactor thread while it runs (where
        every other completion of theirs runs, so that their users need no lock)."""
        if not reqs:
            return

        def fail() -> None:
            for req in reqs:
                try:
                    req.lost(exc)
                except Exception:  # one user's failure must not cost the others theirs
                    log.exception("failing a held command")
        try:
            self.reactor.call_sync(fail, timeout=10)
        except TimeoutError:
            fail()

    def _hold(self, req: HeldCommand, error: BaseException) -> None:
        """A command lost with its queue (``error``, a QueueDead or the ConnectionError
        of a send): keep it for the reconnect (or fail it, if reconnecting is over)."""
        reason = str(error)
        req.held += 1
        with self._state_lock:
            state = self.state
            stale = state == CtrlState.LIVE and req.gen != self._gen
            if state in (CtrlState.LIVE, CtrlState.RECONNECTING) and not stale:
                self._held.append(req)
                self.recovery.held += 1
                self._start_recovery(reason)
                return
        if stale:                       # lost with a queue of an earlier connection
            with self._state_lock:
                self.recovery.retried += 1
            self._dispatch(req)
            return
        self._lose([req], ControllerLost(f"controller {state.value}: {reason}"))

    def _lost(self, reason: str) -> None:
        """Any sign the target is gone (keep-alive, a queue error): start reconnecting."""
        with self._state_lock:
            self._start_recovery(reason)

    def _path_status(self, cmd: HeldCommand, word: int, result: int) -> None:
        """A path-related status (SCT 3, e.g. ANA Inaccessible) on a single path: there is
        no other path to try, so the caller gets it (a multipath controller re-routes)."""
        what = cmd.what if isinstance(cmd, SqeCommand) else \
            "Read" if cmd.opcode == _READ else "Write"
        cmd.parent.io_done(cmd, NvmeError.from_word(what, word, result))

    def reconnect_in_background(self, reason: str) -> None:
        """A path whose first connect failed: keep trying it (reconnect_delay,
        ctrl_loss_tmo) as if it had been lost, while the other paths serve."""
        with self._state_lock:
            if self._closed:
                return
            self.state = CtrlState.LIVE
            self._start_recovery(reason)

    def _tell_state(self) -> None:
        for listener in list(self.state_listeners):
            try:
                listener(self)
            except Exception:
                log.exception("state listener %r failed", listener)

    def _start_recovery(self, reason: str) -> None:
        """With ``_state_lock`` held."""
        if self.state != CtrlState.LIVE or self._closed or self._closing:
            return
        self.state = CtrlState.RECONNECTING
        self.recovery.losses += 1
        self.recovery.last_reason = reason
        tmo = self.opts.ctrl_loss_tmo
        self._loss_deadline = None if tmo < 0 else time.monotonic() + tmo
        log.warning("%s:%s %s: controller lost (%s); reconnecting every %g s for %s",
                    *self.path, self.opts.subnqn, reason, self.opts.reconnect_delay,
                    "ever" if tmo < 0 else f"{tmo:g} s")
        self._recovery_thread = threading.Thread(target=self._recover, name="nvme-reconnect",
                                                 daemon=True)
        self._recovery_thread.start()

    def _teardown_queues(self, reason: str) -> None:
        """Fail and release every queue of the lost connection, on the reactor so that no
        completion of it runs once this returns."""
        queues = ([self.admin] if self.admin else []) + self.io_queues
        self.admin, self.io_queues = None, []
        if self._ka_timer is not None:
            self._ka_timer.cancel()

        def fail_all() -> None:
            for queue in queues:
                queue.fail(reason, expected=True)
        try:
            self.reactor.call_sync(fail_all, timeout=10)
        except TimeoutError:
            fail_all()
        for queue in queues:
            queue.close()

    def _recover(self) -> None:
        """The reconnect loop: every reconnect_delay, the full connect on each path in turn,
        until one works (re-issue what was held) or ctrl_loss_tmo runs out (fail it)."""
        self._teardown_queues(self.recovery.last_reason)
        lost = self.path_index
        while not self._closed:
            delay = self.opts.reconnect_delay
            if self._loss_deadline is not None:
                delay = min(delay, max(0.0, self._loss_deadline - time.monotonic()))
            self._wake.wait(delay)
            if self._closed:
                break
            if self._loss_deadline is not None and time.monotonic() >= self._loss_deadline:
                break
            self.recovery.attempts += 1
            for step in range(len(self.paths)):
                self.path_index = (lost + step) % len(self.paths)
                try:
                    self._establish()
                except NvmeError as exc:
                    self._teardown_queues(f"reconnect failed: {exc}")
                    if exc.dnr:
                        # The target says a retry cannot help (host no longer allowed,
                        # subsystem gone): stop now, as Linux's nvmf_should_reconnect does.
                        self.recovery.last_reason = str(exc)
                        self._give_up(f"reconnect refused for good ({exc})")
                        return
                    log.info("reconnect to %s:%s failed: %s", *self.path, exc)
                    continue
                except Exception as exc:  # any other failure: drop what was built, retry
                    log.info("reconnect to %s:%s failed: %s", *self.path, exc)
                    self._teardown_queues(f"reconnect failed: {exc}")
                    continue
                self._resume(lost)
                return
        self._give_up(f"ctrl_loss_tmo ({self.opts.ctrl_loss_tmo:g} s) expired")

    def _resume(self, lost: int) -> None:
        with self._state_lock:
            if self._closed:        # close() won the race: it fails what is held
                return
            self.state = CtrlState.LIVE
            self.recovery.reconnects += 1
            if self.path_index != lost:
                self.recovery.failovers += 1
            held, self._held = self._held, []
            self.recovery.retried += len(held)
        log.warning("%s:%s %s: reconnected (controller %d); re-issuing %d held commands",
                    *self.path, self.opts.subnqn, self.cntlid, len(held))
        for req in held:
            self._dispatch(req)
        self._tell_state()

    def _give_up(self, why: str) -> None:
        with self._state_lock:
            if self.state == CtrlState.RECONNECTING:
                self.state = CtrlState.CLOSED if self._closed else CtrlState.FAILED
            held, self._held = self._held, []
            self.recovery.failed += len(held)
            reason = self.recovery.last_reason
        if not self._closed:
            log.error("%s: %s: failing %d held commands", self.opts.subnqn, why, len(held))
        self._lose(held, ControllerLost(f"controller lost: {reason}"))
        self._tell_state()

    # -- information -----------------------------------------------------------------
    def queue_stats(self) -> dict[int, dict[str, int]]:
        queues = ([self.admin] if self.admin else []) + self.io_queues
        return {q.qid: q.stats.as_dict() for q in queues}

    def recovery_stats(self) -> dict[str, int | str]:
        """State, path and reconnect counters (see :class:`RecoveryStats`)."""
        with self._state_lock:
            out = self.recovery.as_dict()
            out.update(state=self.state.value, path=format_path(*self.path),
                       held_now=len(self._held))
        return out

    # -- teardown ----------------------------------------------------------------------
    def shutdown(self, timeout: float = 2.0) -> None:
        """CC.SHN = normal, then wait for CSTS.SHST = complete (what nvme disconnect does)."""
        if self.admin is None or self.admin.dead_reason:
            return
        try:
            cc = CC(en=True, css=0, mps=0, ams=0, shn=1, iosqes=6, iocqes=4)
            self.property_set(Property.CC, cc.to_int())
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if CSTS.from_int(self.property_get(Property.CSTS, 4)).shst == 2:
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
            self.state = CtrlState.CLOSED
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

    def _give_up_held(self) -> None:
        with self._state_lock:
            held, self._held = self._held, []
        self._lose(held, ControllerLost("controller closed"))

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _queue_error(error: BaseException, what: str) -> BaseException:
    """The error a waiting caller gets for a command its queue lost: a QueueDead (or its
    WorkCompletionError, status kept) that says what was being done."""
    if isinstance(error, QueueDead):
        return error.during(what)
    return QueueDead(f"{what}: {error}")


def _secret(text: str | None, name: str) -> Secret | None:
    if text is None:
        return None
    try:
        return Secret.parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _reject_text(private: bytes, qid: int) -> str:
    try:
        rej = CMReject.unpack_from(private)
        reason = rej.reason.name if rej.reason else str(rej.sts)
    except ProtocolError:
        reason = f"unrecognised reject data {private[:8].hex()}"
    return f"target rejected queue {qid}: {reason}"


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


def discover(traddr: str, trsvcid: int = DEFAULT_PORT, **kwargs) -> list[DiscoveryLogEntry]:
    """Read the discovery log as ``nvme discover`` does: header, then every entry."""
    with connect(traddr, DISCOVERY_NQN, trsvcid, **kwargs) as ctrl:
        header = DiscoveryLogHeader.unpack_from(
            ctrl.get_log_page(LogPageId.DISCOVERY, 1024, rae=True))
        if header.numrec == 0:
            return []
        size = 1024 * (header.numrec + 1)
        page = ctrl.get_log_page(LogPageId.DISCOVERY, size)
        return list(DiscoveryLogEntry.iter_from(page, header.numrec))

"""The verbs interface every RDMA provider implements.

Modelled on pyverbs / libibverbs and rdma_cm, with the same names and numeric values, so that
code above this layer reads like verbs code and the ``verbs`` provider is a thin mapping:

* :class:`Context` (an opened device) -> :meth:`Context.alloc_pd` -> :class:`PD`
* :meth:`PD.reg_mr` over caller memory -> :class:`MR` (``addr``, ``lkey``, ``rkey``, ``access``)
* :meth:`Context.create_cq` -> :class:`CQ` with a waitable :meth:`CQ.fileno`
* connection management: :meth:`Provider.listen` -> :class:`Listener` ->
  :meth:`Listener.get_request` -> :class:`CMId` (passive); :meth:`Provider.create_id` ->
  :meth:`CMId.resolve` -> :meth:`CMId.connect` (active).  A :class:`CMId` owns one RC
  :class:`QP` made with :meth:`CMId.create_qp`.
* work requests (:class:`SendWR`, :class:`RecvWR` with :class:`SGE` lists) and work
  completions (:class:`WC`) carrying the real verbs statuses.

Nothing here blocks without a timeout, and every object that a reactor waits on has a
``fileno()``: a poll loop per queue group can service the provider and the command logic
without thread hand-offs (see docs/design.md).  Objects are context managers; ``close()`` is
idempotent.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

# --------------------------------------------------------------------------- enums
# Values are libibverbs' (include/infiniband/verbs.h) and librdmacm's (rdma_cma.h).


class Access(enum.IntFlag):
    """ibv_access_flags: what a memory region allows."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8


class WrOpcode(enum.IntEnum):
    """ibv_wr_opcode: what a send-queue work request does."""

    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    SEND_WITH_INV = 9


class WcOpcode(enum.IntEnum):
    """ibv_wc_opcode: what a completed work request was."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WcStatus(enum.IntEnum):
    """ibv_wc_status: how a work request ended."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


class WcFlags(enum.IntFlag):
    """ibv_wc_flags."""

    GRH = 1
    WITH_IMM = 2
    WITH_INV = 8


class SendFlags(enum.IntFlag):
    """ibv_send_flags."""

    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8


class QPState(enum.IntEnum):
    """ibv_qp_state."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class CMEventType(enum.IntEnum):
    """rdma_cm_event_type (the ones a connection sees)."""

    ADDR_RESOLVED = 0
    ADDR_ERROR = 1
    ROUTE_RESOLVED = 2
    ROUTE_ERROR = 3
    CONNECT_REQUEST = 4
    CONNECT_RESPONSE = 5
    CONNECT_ERROR = 6
    UNREACHABLE = 7
    REJECTED = 8
    ESTABLISHED = 9
    DISCONNECTED = 10
    DEVICE_REMOVAL = 11
    TIMEWAIT_EXIT = 15


#: Events after which a connection is over, whatever it was doing: its owner tears it down.
CONNECTION_ENDED = frozenset((CMEventType.DISCONNECTED, CMEventType.DEVICE_REMOVAL,
                              CMEventType.CONNECT_ERROR, CMEventType.UNREACHABLE,
                              CMEventType.REJECTED))


#: Providers that batch work per *pass* of a thread's event loop (the soft provider corks
#: the thread's sends until the pass ends, then sends each connection's in one sendmsg):
#: ``(begin, end)`` pairs, where ``begin(thread_id)`` returns True when it opened a pass
#: that ``end(thread_id)`` then closes.  Event loops (``blockfabric.fabric.reactor``) call
#: them around each wake-up; a thread that does not is simply not batched.
PASS_HOOKS: list[tuple[Callable[[int], bool], Callable[[int], object]]] = []


# --------------------------------------------------------------------------- plain data


@dataclass(slots=True)
class SGE:
    """ibv_sge: a piece of local registered memory (``addr`` is a virtual address)."""

    addr: int
    length: int
    lkey: int


@dataclass(slots=True)
class SendWR:
    """ibv_send_wr.  A list of these passed to :meth:`QP.post_send` is one posted chain.

    SEND_WITH_INV: real devices invalidate only memory windows and fast-registered MRs, which
    this interface does not make; naming an rkey from :meth:`PD.reg_mr` fails the peer's
    receive (rxe: REM_INV_REQ_ERR, its QP to ERR).  The soft provider delivers the rkey in
    ``WC.invalidated_rkey`` and leaves the MR valid.  Error statuses are the verbs ones, but
    devices pick different codes for some errors (a SEND too long for the receive, a bad lkey):
    the contract tests name the sets real devices use.
    """

    wr_id: int = 0
    opcode: WrOpcode = WrOpcode.SEND
    sg_list: Sequence[SGE] = ()
    send_flags: SendFlags = SendFlags.SIGNALED
    remote_addr: int = 0      # RDMA_WRITE / RDMA_READ
    rkey: int = 0             # RDMA_WRITE / RDMA_READ
    invalidate_rkey: int = 0  # SEND_WITH_INV
    imm_data: int = 0         # *_WITH_IMM
    #: None, or (opt-in, as :attr:`RecvWR.resolved`) False: the provider may keep a note
    #: of what its SGE resolved to (the soft provider: for a SEND of one SGE, the registered
    #: bytes from its address on) and reuse it on later posts of this WR.  Opcode, flags,
    #: the number of SGEs and the SGE's length are read at every post; its address and key
    #: are not: to point the WR elsewhere, set this back to False first.  The note holds
    #: views of the memory: set it back to False (or None) before closing what backs the
    #: region.
    resolved: Any = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class RecvWR:
    """ibv_recv_wr."""

    wr_id: int = 0
    sg_list: Sequence[SGE] = ()
    #: None, or (opt-in, for an owner that posts the same WR again and again) False: the
    #: provider may keep a note here (the soft provider: the memory views it resolved to,
    #: reused while the region stays registered and the WR keeps its ``sg_list``, of as
    #: many SGEs).  Its SGEs are not read again: to change them, set this back to False
    #: first (or give the WR a new list).  The note holds views of the memory: set it
    #: back to False (or None) before closing what backs the region.
    resolved: Any = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class WC:
    """ibv_wc: one work completion."""

    wr_id: int
    status: WcStatus
    opcode: WcOpcode
    byte_len: int = 0
    qp_num: int = 0
    wc_flags: WcFlags = WcFlags(0)
    invalidated_rkey: int = 0
    imm_data: int = 0
    vendor_err: int = 0


#: A completion as a CQ in raw mode hands it out (the soft provider's ``set_raw``):
#: ``(wr_id, status, byte_len)``, no object made per completion; status a WcStatus, or 0
#: for success.
RawWC = tuple[int, int, int]


@dataclass(slots=True)
class QPCap:
    """ibv_qp_cap: queue depths and SGE counts, enforced at post time."""

    max_send_wr: int = 128
    max_recv_wr: int = 128
    max_send_sge: int = 4
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclass(slots=True)
class CMEvent:
    """One rdma_cm event on a :class:`CMId`."""

    type: CMEventType
    status: int = 0
    private_data: bytes = b""


@dataclass(slots=True)
class DeviceInfo:
    """What :meth:`Provider.devices` reports of one device."""

    name: str
    provider: str
    node_guid: str = ""
    ports: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------- objects


class _Closable(abc.ABC):
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object; idempotent."""


class MR(_Closable):
    """A registered memory region over caller memory.

    ``buf`` is a memoryview of exactly the registered bytes, for local access by the owner;
    remote peers reach the memory only through ``rkey`` and only as ``access`` allows.
    """

    addr: int
    length: int
    lkey: int
    rkey: int
    access: Access
    buf: memoryview


class PD(_Closable):
    """A protection domain: MRs and QPs of one PD can be used together."""

    @abc.abstractmethod
    def reg_mr(self, buffer, access: Access = Access.LOCAL_WRITE) -> MR:
        """Register a writable buffer (bytearray, mmap, or a memoryview of either)."""


class CQ(_Closable):
    """A completion queue with completion-channel semantics.

    ``fileno()`` becomes readable when completions may be waiting after :meth:`req_notify`
    was called (spurious wake-ups are allowed); :meth:`ack_events` drains it.  :meth:`poll`
    never blocks.
    """

    @abc.abstractmethod
    def poll(self, max_entries: int = 16) -> list[WC]:
        """Return up to ``max_entries`` completions, oldest first, without blocking."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A file descriptor to wait on for completions."""

    @abc.abstractmethod
    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the channel for the next completion."""

    @abc.abstractmethod
    def ack_events(self) -> int:
        """Consume pending channel events (drain the fd); return how many."""


class QP(_Closable):
    """A reliable-connected queue pair, created on a :class:`CMId`."""

    qp_num: int
    cap: QPCap
    #: Bytes of frames the peer may leave unread before the connection is cut (0: the
    #: provider's default).  The soft provider queues them in memory; an HCA has no such
    #: queue, and the verbs provider ignores this.
    max_unsent: int = 0

    @property
    @abc.abstractmethod
    def state(self) -> QPState:
        """The current QP state (RTS when connected, ERR after a fatal error)."""

    @abc.abstractmethod
    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        """Post one work request or a chain; raises RdmaError(errno=ENOMEM) past the depth,
        EINVAL on a malformed WR; in the ERR state the WRs complete with WR_FLUSH_ERR."""

    @abc.abstractmethod
    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        """Post one receive or a chain, with the same rules as :meth:`post_send`."""

    def post_write_send(self, write: SendWR, send: SendWR, addr: int, length: int, lkey: int,
                        remote_addr: int, rkey: int) -> None:
        """An RDMA WRITE of ``length`` bytes at local ``addr`` (under ``lkey``) to the
        peer's ``remote_addr`` (under ``rkey``), then ``send``, as one chain: ``write``'s
        one SGE and remote address are aimed at those, then ``post_send([write, send])``.
        What a target answers a read with, per I/O.  Like ibv_wr_rdma_write and
        ibv_wr_set_sge, a provider may take the numbers as they are and never read them
        back from ``write`` (the soft provider does, on its per-I/O path); the same
        checks and errors as post_send either way."""
        sge = write.sg_list[0]
        sge.addr = addr
        sge.length = length
        sge.lkey = lkey
        write.remote_addr = remote_addr
        write.rkey = rkey
        self.post_send((write, send))

    def push(self) -> None:
        """Let the peer start on what this thread posted so far, now, rather than at the
        end of the reactor's pass (a provider that batches a pass's work requests into one
        send: the soft provider).  An HCA rings its doorbell at every post: nothing to do."""


class Context(_Closable):
    """An opened RDMA device."""

    name: str

    @property
    def device_key(self) -> object:
        """Equal for every context of one device in this process: what a protection domain
        allocated on one of them is valid with.  A provider whose CM ids each hold their own
        handle of a shared device (verbs) says so here; by default a context is its own."""
        return id(self)

    @abc.abstractmethod
    def alloc_pd(self) -> PD:
        ...

    @abc.abstractmethod
    def create_cq(self, depth: int = 256) -> CQ:
        ...


class CMId(_Closable):
    """An rdma_cm identifier: one end of one connection.

    Active side: ``resolve()``, then ``context`` is the device to allocate on, then
    ``create_qp()``, then ``connect()``.  Passive side: returned by
    :meth:`Listener.get_request` with ``private_data`` set; ``create_qp()`` then ``accept()``
    or ``reject()``.  Later events (DISCONNECTED) arrive through :meth:`get_event`.

    Private data (``private_data`` here, the return of :meth:`connect`, and
    ``ConnectionRejected.private_data``) starts with exactly the bytes the peer sent.  The soft
    provider hands over just those; rdma_cm on a real device hands over the whole field, the
    rest zeros (56 B connect, 196 B accept, 148 B reject), since the wire does not carry the
    length.  So read fixed-size structures from the front, as NVMe-oF does.
    """

    context: Context
    qp: QP | None
    private_data: bytes          # the peer's connect (passive) or accept (active) data
    local_address: tuple[str, int]
    peer_address: tuple[str, int]

    @abc.abstractmethod
    def resolve(self, address: str, port: int, timeout: float = 5.0,
                source: str | None = None) -> None:
        """Resolve the address and route (active side); sets ``context``."""

    @abc.abstractmethod
    def create_qp(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap | None = None,
                  sq_sig_all: bool = False) -> QP:
        ...

    @abc.abstractmethod
    def connect(self, private_data: bytes = b"", timeout: float = 5.0,
                retry_count: int = 7, rnr_retry_count: int = 7) -> bytes:
        """Connect; return the peer's accept private data.

        Raises ConnectionRejected (with the peer's reject private data) or RdmaTimeout."""

    @abc.abstractmethod
    def accept(self, private_data: bytes = b"") -> None:
        """Accept a connect request (passive side); the QP moves to RTS."""

    @abc.abstractmethod
    def reject(self, private_data: bytes = b"") -> None:
        """Reject a connect request, sending ``private_data`` to the peer."""

    @abc.abstractmethod
    def disconnect(self) -> None:
        """Start an orderly disconnect; the QP goes to ERR and posted work is flushed."""

    @abc.abstractmethod
    def get_event(self, timeout: float | None = 0) -> CMEvent | None:
        """The next CM event for this id, waiting up to ``timeout`` seconds (None: forever)."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """A file descriptor that is readable when :meth:`get_event` may return an event."""


class Listener(_Closable):
    """A listening rdma_cm id bound to an address and port."""

    local_address: tuple[str, int]

    @abc.abstractmethod
    def get_request(self, timeout: float | None = 0) -> CMId | None:
        """The next incoming connect request, or None when none arrived in ``timeout``."""

    @abc.abstractmethod
    def fileno(self) -> int:
        ...

    def deadline(self) -> float | None:
        """When (``time.monotonic()``) :meth:`get_request` has timed work to do even if
        :meth:`fileno` stays quiet (expiring half-received requests, ending a pause); None:
        none.  The owner calls ``get_request(0)`` then."""
        return None


#: Connection requests a listener holds before its owner takes them, at most, and for how
#: long (seconds) one may stay half-received.
MAX_PENDING_REQUESTS = 128
REQUEST_TIMEOUT = 5.0


class Provider(abc.ABC):
    """One RDMA implementation (``soft`` or ``verbs``)."""

    name: str

    @abc.abstractmethod
    def devices(self) -> list[DeviceInfo]:
        ...

    @abc.abstractmethod
    def owns_address(self, address: str) -> bool:
        """True when this provider can serve ``address`` (``auto`` selection uses it)."""

    @abc.abstractmethod
    def listen(self, address: str, port: int, backlog: int = 128, *,
               max_pending: int = MAX_PENDING_REQUESTS,
               request_timeout: float = REQUEST_TIMEOUT) -> Listener:
        """A listener; ``max_pending`` and ``request_timeout`` bound what peers can make it
        hold before its owner sees their requests."""

    @abc.abstractmethod
    def create_id(self) -> CMId:
        """A fresh active-side identifier."""

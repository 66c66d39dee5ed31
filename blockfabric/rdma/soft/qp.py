"""The RC queue pair of the soft provider: requester and responder over one TCP stream.

Everything that touches a QP's state holds its lock; the progress engine reads frames in
:meth:`SoftQP.on_readable`, callers post from their own threads and transmit directly (no
hand-off) while the socket takes the bytes; what it does not take waits in ``_outq`` and is
written by the engine when the socket is writable.  Payloads go from registered memory to
the socket (``sendmsg`` of MR memoryviews) and from the socket into registered memory
(``recv_into``/``recvmsg_into`` of MR memoryviews): no intermediate copies.

The peer is not trusted.  Every header is checked by :func:`wire.decode`, and here against
the connection's state: a request must carry the next PSN (another only while go-back-N
after an RNR NAK, or in ERR); an ACK, NAK, RNR NAK or READ_RESP must name a request that
went out *whole* (every byte of it taken by the kernel: ``_Entry.end`` against
``_tx_sent``) and that can take that answer.  A violation ends the connection, logged once.
Because a send WR completes only once its bytes are out, and a failure that completes WRs
with bytes still queued cuts the connection first, no completed WR's memory is referenced
by the provider any more (receives: an error aborts the payload being placed).  Bytes the
peer leaves unread are bounded by :attr:`SoftQP.max_unsent`.

Why one module of ~1000 lines: the requester and the responder share every field of the
connection (PSNs, the send queue, the staged receive, the lock), and the per-I/O path runs
through both halves in one pass; split, each 4 KiB I/O would pay cross-module attribute
reads and calls on its hottest path (issue 14), and the RC rules would be read in two places.
"""

from __future__ import annotations

import array
import errno as _errno
import fcntl
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import time
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Sequence

from blockfabric.errors import RdmaError
from blockfabric.rdma.base import (QP, WC, Access, QPCap, QPState, RecvWR, SendFlags, SendWR,
                                   WcFlags, WcOpcode, WcStatus, WrOpcode)
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame, FrameFlags

if TYPE_CHECKING:
    from blockfabric.rdma.base import SGE, RawWC
    from blockfabric.rdma.soft.cm import SoftCMId
    from blockfabric.rdma.soft.cq import SoftCQ
    from blockfabric.rdma.soft.device import Group, SoftContext
    from blockfabric.rdma.soft.memory import SoftMR, SoftPD

log = logging.getLogger(__name__)

M = wire.PSN_MASK
HDR = wire.HEADER_SIZE
_pack = wire.pack
_hdr = wire.HEADER.pack         # (MAGIC, VERSION, type, flags, psn, length, key, extra, ack,
_MAGIC, _VERSION = wire.MAGIC, wire.VERSION     # addr): wire.pack without its call
_decode = wire.decode
_unpack_header = wire.HEADER.unpack_from
# The per-I/O SEND's header read in one go (_parse): magic, version, type and flags as one
# little-endian word, psn, length, key and extra as one (both zero in a SEND), ack, addr.
_unpack_fast = struct.Struct("<IIIQIQ").unpack_from
_W_SEND = wire.MAGIC | wire.VERSION << 8 | int(Frame.SEND) << 16
_W_SEND_ACK = _W_SEND | int(FrameFlags.ACK) << 24
_MAX_MESSAGE = wire.MAX_MESSAGE
_now = time.monotonic
_get_ident = threading.get_ident
IOV_BATCH = 512                 # below IOV_MAX (1024)
STAGE = 1 << 16                 # per connection: received frames (and discarded payloads)
STAGE_FIRST = 1 << 12           # ... starting this small: a queue that only connects (and
                                # may never send a capsule) costs little; it grows to STAGE
                                # the first time one receive fills it
STRAIGHT_IN = 1 << 16           # a payload with this much still to come skips staging
CORK_BYTES = 1 << 15            # a pass sends early once this much waits for its end
READ_ROUNDS = 2                 # receives per connection per readable event, at most
RNR_FIRST, RNR_MAX = 0.001, 0.05  # RNR timer: 1 ms, doubling per retry up to 50 ms
DEFAULT_ACK_TIMEOUT = 2.0       # s per transport retry; RETRY_EXC_ERR after (retry_count+1)x
DEFAULT_MAX_UNSENT = 1 << 30    # bytes a peer may leave unread, unless the owner says
QUEUED_BUFFER_COST = 128        # what one queued buffer costs beyond its bytes (objects)

# Enum members bound once: an attribute of an Enum class costs ~90 ns a read in 3.11,
# and the per-I/O paths compare opcodes and states several times each.
_OP_READ = WrOpcode.RDMA_READ
_OP_WRITE = WrOpcode.RDMA_WRITE
_OP_WRITE_IMM = WrOpcode.RDMA_WRITE_WITH_IMM
_OP_SEND = WrOpcode.SEND
_OP_SEND_INV = WrOpcode.SEND_WITH_INV
_OP_SEND_IMM = WrOpcode.SEND_WITH_IMM
_ERR = QPState.ERR
_RTS = QPState.RTS
_WC_READ = WcOpcode.RDMA_READ
_WC_WRITE = WcOpcode.RDMA_WRITE
_WC_RECV = WcOpcode.RECV
_WC_SEND = WcOpcode.SEND
_WC_OK = WcStatus.SUCCESS
_WC_OF = {_OP_SEND: WcOpcode.SEND, _OP_SEND_IMM: WcOpcode.SEND,
          _OP_SEND_INV: WcOpcode.SEND, _OP_WRITE: _WC_WRITE,
          _OP_WRITE_IMM: _WC_WRITE, _OP_READ: _WC_READ}
# Flag bits as plain ints: ``int & IntFlag`` runs enum code in Python, per work request.
_SIGNALED, _INLINE = int(SendFlags.SIGNALED), int(SendFlags.INLINE)
_FENCE = int(SendFlags.FENCE)
_NOT_FAST = _INLINE | _FENCE    # flags the per-I/O paths leave to the general one
_LOCAL_WRITE = int(Access.LOCAL_WRITE)
_REMOTE_READ, _REMOTE_WRITE = int(Access.REMOTE_READ), int(Access.REMOTE_WRITE)
_F_IMM, _F_INV, _F_ACK = int(FrameFlags.WITH_IMM), int(FrameFlags.WITH_INV), int(FrameFlags.ACK)
_F_SHM = int(FrameFlags.SHM)
_F_ACK_REQ = int(FrameFlags.ACK_REQ)
_SEND, _WRITE, _READ_REQ = int(Frame.SEND), int(Frame.WRITE), int(Frame.READ_REQ)
_SHARE, _FORGET = int(Frame.SHARE), int(Frame.FORGET)
_NOT_ACK = 0xFF & ~_F_ACK       # header flag bits other than ACK
_READ_RESP, _ACK, _NAK = int(Frame.READ_RESP), int(Frame.ACK), int(Frame.NAK)
_RNR_NAK, _DREQ, _CONN_RTU = int(Frame.RNR_NAK), int(Frame.DREQ), int(Frame.CONN_RTU)
# what the payload in flight is for, when it has all arrived
RX_DISCARD, RX_RECV, RX_WRITE, RX_READ = range(4)
# same-host connections (shared regions, see share()): what one peer may make this side map
MAX_SHARES = 64                 # regions mapped at once (more are declined: the socket path)
# (a host needs its arena and FUSE buffers: 115 MiB by default; pages of a peer's memfd that
# this side's copies fault in are charged to this side's memory cgroup, so a bound on them)
MAX_SHARED_BYTES = 1 << 30      # all its regions together (1 GiB; more are declined)
MAX_FDS_WAITING = 16            # descriptors received ahead of their SHARE frames
_FDS_SPACE = socket.CMSG_SPACE(MAX_FDS_WAITING * array.array("i").itemsize)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)    # (an IntFlag: ``int & IntFlag`` runs enum code)


class _Entry:
    """One send-queue slot: posted, maybe transmitted, not yet completed."""

    __slots__ = ("psn", "wr_id", "opcode", "byte_len", "signaled", "status", "frame", "views",
                 "rnr", "sent", "size", "end", "src")

    psn: int | None                 # None: it failed its local checks (never sent)
    wr_id: int
    opcode: WcOpcode
    byte_len: int
    signaled: bool
    status: int                     # a WcStatus; 0 when it passed its local checks
    frame: list[bytes | memoryview]     # header and payload views (unset: psn None)
    views: list[memoryview] | list[bytes]
    rnr: int                        # RNR NAKs it met (may be unset: none)
    sent: bool
    size: int                       # its frame's bytes
    end: int                        # _tx_queued when its frame was queued whole
    src: memoryview | None          # a READ through a shared region: the bytes it reads


def _advance(views: list, n: int) -> list:
    """The part of ``views`` left after the first ``n`` bytes."""
    i = 0
    while n >= len(views[i]):
        n -= len(views[i])
        i += 1
        if i == len(views):
            return []
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def _place(views: list, data: memoryview) -> list:
    """Copy ``data`` into the start of ``views``; the views left after it."""
    n = len(data)
    at = 0
    i = 0
    while at < n:
        v = views[i]
        k = min(len(v), n - at)
        v[:k] = data[at:at + k]
        at += k
        if k < len(v):
            return [v[k:], *views[i + 1:]]
        i += 1
    return views[i:]


def _cut(views: list, n: int) -> list:
    """The views covering the first ``n`` bytes."""
    out = []
    for v in views:
        if n <= 0:
            break
        if len(v) <= n:
            out.append(v)
        else:
            out.append(v[:n])
        n -= len(v)
    return out


class SoftQP(QP):
    """``max_unsent`` (see :class:`QP`) counts each queued buffer QUEUED_BUFFER_COST more
    than its bytes; 0 means DEFAULT_MAX_UNSENT."""

    def __init__(self, cmid: "SoftCMId", pd: "SoftPD[SoftContext]", send_cq: "SoftCQ",
                 recv_cq: "SoftCQ", cap: QPCap | None, sq_sig_all: bool) -> None:
        self.ctx = pd.ctx
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap if cap is not None else QPCap()
        self._sq_max, self._rq_max = self.cap.max_send_wr, self.cap.max_recv_wr
        self.sig_all = sq_sig_all
        self.qp_num = self.ctx.new_qp_num()
        self.cmid = cmid
        self._state = QPState.INIT
        self._lock = threading.RLock()
        self.sock: socket.socket | None = None
        self._fd = -1
        self._dead = False
        self.closed = False
        self._outq: deque = deque()
        self._blocked = False
        #: on the dirty list of the pass that queued frames here: that thread's ident (0: not)
        self._dirty = 0
        self._tx_queued = 0      # bytes handed to the socket queue since the start ...
        self._tx_sent = 0        # ... and how many of them the kernel took
        self._last_ack: bytes | None = None     # the ACK at the tail of _outq, if any
        #: this side waits on the peer's ACK (a READ behind requests it has not acknowledged):
        #: the pass's end asks for it (an ACK frame flagged ACK_REQ) ...
        self._want_ack = False
        self._asked = M          # ... unless it asked already since its last request
        self._ack_asked = False  # the peer asked: the ACK owed does not wait for traffic
        self._rtu_due = False    # passive side: the peer's CONN_RTU comes first
        # requester
        self._sq: deque[_Entry] = deque()
        self._next_psn = 0
        self._hold = False       # waiting out an RNR timer
        self._stall = False      # a WR failed local checks: send nothing after it
        self._fence = False      # ... or a fenced WR waits for a READ before it (_release)
        self._fenced: set[int] = set()     # PSNs of fenced WRs not sent yet
        self.rnr_deadline = 0.0
        self.rnr_retry = 7
        self.retry_count = 7
        self.ack_timeout = DEFAULT_ACK_TIMEOUT
        self._last_progress = 0.0
        self._acked = M          # the last PSN completed by the peer's answer
        self._swept = M          # ... as check_timeout last saw it
        #: the last request whose data moves after its post (None: none, or it was
        #: answered): an RDMA WRITE sent through the socket (to a region not shared, or
        #: shared only since), a READ answered later; a copy at a post waits for it
        #: (_copy_now)
        self._later_psn: int | None = None
        # responder
        self._rq: deque[tuple] = deque()
        self._exp_psn = 0
        self._done_psn = M
        self._rx_psn = M         # the SEND or WRITE whose payload is arriving
        self._ack_due = False
        self.ack_group: Group | None = None  # the reactor group its owed ACK waits with, if any
        self.posted = 0.0        # when the owner last posted send work (defer_ack)
        self._rnr_sent = False   # go-back-N: later PSNs are dropped until the NAKed one
        # frame reader
        self._stage = bytearray(STAGE_FIRST)  # frames as they arrive; [_spos, _sfill) unparsed
        self._smv = memoryview(self._stage)
        self._spos = self._sfill = 0
        self._rviews: list | None = None
        self._rleft = 0
        self._rkind = RX_DISCARD
        self._rwc: WC | RawWC | None = None
        self._rentry: _Entry | None = None
        # same-host connection (a unix socket): shared regions, both ways
        self.shm = False
        self._peer: dict[int, tuple] = {}   # the peer's rkey -> (addr, end, access, view)
        self._peer_bytes = 0
        self._shared: set[int] = set()      # rkeys of this side's regions the peer maps
        self._fds_in: deque[int] = deque()  # descriptors received, for the SHAREs to come
        self._fds_out: list[int] = []       # ... to send, with the next bytes that go out

    # ------------------------------------------------------------------ lifecycle
    @property
    def waiting(self) -> bool:
        """Work requests wait for the peer's answer (for the reactor's busy-poll)."""
        return bool(self._sq) and not self._dead

    @property
    def state(self) -> QPState:
        return self._state

    @property
    def shared_regions(self) -> int:
        """How many of the peer's regions this side maps (same-host connections)."""
        return len(self._peer)

    def start(self, sock: socket.socket, rnr_retry: int, retry_count: int,
              ack_timeout: float, *, passive: bool = False) -> None:
        """Connected: hand the socket to the device's engine and go to RTS."""
        with self._lock:
            self._rtu_due = passive
            self.rnr_retry = rnr_retry
            self.retry_count = retry_count
            self.ack_timeout = ack_timeout
            self.sock = sock
            self._fd = sock.fileno()
            sock.setblocking(False)
            self._state = _RTS
            self._last_progress = _now()
            self.shm = sock.family == socket.AF_UNIX
            self.ctx.register(self)
            if self.shm:
                for mr in self.pd.shared():
                    self.share(mr)

    # ------------------------------------------------------------------ shared regions
    def share(self, mr: SoftMR) -> None:
        """Offer ``mr`` (a shared slab registered for remote access) to a same-host peer: a
        SHARE frame, its memfd with the next bytes sent (a duplicate, so the slab may close
        meanwhile).  Past MAX_SHARES regions the rest keep to the socket."""
        with self._lock:
            slab = mr.slab
            if (not self.shm or self._dead or mr.closed or slab is None or slab.memfd < 0
                    or mr.rkey in self._shared or len(self._shared) >= MAX_SHARES):
                return
            self._fds_out.append(os.dup(slab.memfd))
            self._shared.add(mr.rkey)
            self._control(_pack(_SHARE, 0, mr.length, mr.rkey, mr.bits, mr.addr))

    def forget(self, mr: SoftMR) -> None:
        """``mr`` closed: the peer unmaps it (FORGET).  A copy the peer started before
        reaches only the region's own pages, which nothing else uses."""
        with self._lock:
            if mr.rkey in self._shared:
                self._shared.discard(mr.rkey)
                if not self._dead:
                    self._control(_pack(_FORGET, 0, 0, mr.rkey))

    def _control(self, frame: bytes) -> None:
        """A SHARE or FORGET frame: queued behind everything before it, sent now."""
        self._tx_queued += HDR
        self._outq.append(frame)
        if not self._blocked:
            self._flush()

    def _rx_share(self, length: int, key: int, access: int, addr: int) -> None:
        """The peer's region, mapped once its descriptor passes every check: a memfd sealed
        against shrinking (so no page of the mapping can go away: no SIGBUS), at least as
        long as the region, writable.  Past this connection's limits (MAX_SHARES regions,
        MAX_SHARED_BYTES) it is declined: requests to it keep to the socket."""
        if not self.shm:
            raise wire.WireError("a shared region offered on a connection between hosts")
        if not self._fds_in:
            raise wire.WireError(f"shared region {key:#x} came without its descriptor")
        fd = self._fds_in.popleft()
        try:
            if key in self._peer or not length:
                raise wire.WireError(f"shared region {key:#x} of {length} B: empty, or a "
                                     "key shared already")
            if len(self._peer) >= MAX_SHARES or self._peer_bytes + length > MAX_SHARED_BYTES:
                return                  # declined (the finally closes the descriptor)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                st = os.fstat(fd)
            except OSError as exc:
                raise wire.WireError(f"shared region {key:#x}: not a sealed memfd "
                                     f"({exc.strerror})") from exc
            if not seals & fcntl.F_SEAL_SHRINK or not stat.S_ISREG(st.st_mode) \
                    or st.st_size < length:
                raise wire.WireError(f"shared region {key:#x}: its memfd is not sealed "
                                     f"against shrinking, or shorter than {length} B")
            if st.st_blksize != mmap.PAGESIZE:
                # hugetlbfs (MFD_HUGETLB): a hole its owner punches frees the pages and
                # their reservation, and a copy into it here could then die of SIGBUS (the
                # shrink seal does not stop a punched hole; on shmem the page comes back)
                raise wire.WireError(f"shared region {key:#x}: its memfd is not of "
                                     f"{mmap.PAGESIZE}-byte pages (huge pages?)")
            try:
                m = mmap.mmap(fd, length)
            except (OSError, ValueError) as exc:
                raise wire.WireError(f"shared region {key:#x}: cannot map it ({exc})") from exc
        finally:
            os.close(fd)
        self._peer[key] = (addr, addr + length, access, memoryview(m))
        self._peer_bytes += length

    def _rx_forget(self, key: int) -> None:
        got = self._peer.pop(key, None)
        if got is None:
            return                      # a region declined (or never offered): nothing mapped
        self._peer_bytes -= got[1] - got[0]
        got[3].release()        # the mapping goes with the last view a WR still holds

    def _unshare_all(self) -> None:
        """The connection is gone: every descriptor and mapping of it let go."""
        for fd in (*self._fds_in, *self._fds_out):
            os.close(fd)
        self._fds_in.clear()
        self._fds_out.clear()
        for got in self._peer.values():
            got[3].release()
        self._peer.clear()
        self._peer_bytes = 0
        self._shared.clear()

    def _recv_shm(self, views: list) -> int:
        """recvmsg_into ``views`` on a same-host connection: descriptors that came with the
        bytes wait for their SHARE frames (at most MAX_FDS_WAITING; more, or a truncated
        set, ends the connection, since a SHARE would then find the wrong one)."""
        n, anc, flags, _ = self.sock.recvmsg_into(views, _FDS_SPACE)  # type: ignore[union-attr]
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
                self._fds_in.extend(fds)
        if flags & _MSG_CTRUNC or len(self._fds_in) > MAX_FDS_WAITING:
            raise wire.WireError(f"more than {MAX_FDS_WAITING} descriptors ahead of their "
                                 "SHARE frames")
        return n

    def disconnect(self) -> None:
        with self._lock:
            if self.sock is not None and not self._dead:
                if self._ack_due:       # a deferred ACK: what was executed completes there
                    self._queue_ack()
                self._tx_queued += HDR
                self._outq.append(_pack(Frame.DREQ))
                if not self._blocked:
                    self._flush()       # what a pass queued, then the DREQ
                self._die("local disconnect")
            else:
                self._to_error()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.sock is not None:
                self._die("QP destroyed")

    def _die(self, reason: object, loud: bool = False) -> None:
        """The connection is gone (closed, reset, timed out, disconnected, or cut for what the
        peer did: ``loud``, logged): QP to ERR, flush, and a DISCONNECTED event on the CM
        id."""
        if self._dead:
            return
        self._sever(reason, loud)
        self._to_error()
        self.cmid.on_disconnected(reason)

    def _sever(self, reason: object, loud: bool) -> None:
        """Close the socket; nothing queued will be sent, nothing more is read."""
        self._dead = True
        if loud:
            peer = "%s:%s" % tuple(self.cmid.peer_address[:2])
            log.warning("soft RDMA: connection with %s (qp %#x) closed: %s", peer,
                        self.qp_num, reason)
        self.ctx.unregister(self, self._fd)
        try:
            self.sock.close()  # type: ignore[union-attr]  # (only a started QP dies)
        except OSError:
            pass
        self._outq.clear()
        self._abort_rx()
        if self.shm:
            self._unshare_all()

    def fail(self, exc: BaseException) -> None:
        """The engine caught ``exc`` while handling this connection: end it, and only it."""
        with self._lock:
            tb = exc.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = (f" at {tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}"
                     if tb is not None else "")
            self._die(f"internal error {type(exc).__name__}: {exc}{where}", loud=True)

    def _unreference(self, why: str) -> None:
        """Work requests are about to complete otherwise than by the peer's answer: if frames
        still queued for the socket point into registered memory, cut the connection first,
        so that no completed WR's memory is sent later (after its owner reused it)."""
        if self._dead or not self._outq:
            return
        if not self._blocked:
            self._flush()               # frames a pass queued: out now, if the socket takes them
            if self._dead or not self._outq:
                return
        for buf in self._outq:
            if type(buf) is memoryview and type(buf.obj) is not bytes:
                self._sever(why, False)
                self.cmid.on_disconnected(why)
                return

    def _abort_rx(self) -> None:
        """Stop placing the payload being received (an error completes its WR): the rest
        of it is read into scratch; a receive it was for completes flushed."""
        if self._rkind == RX_DISCARD:
            return
        if self._rwc is not None:
            wc, self._rwc = self._rwc, None
            if type(wc) is tuple:           # a raw CQ's entry (SoftCQ.set_raw)
                wc = WC(wc[0], WcStatus.SUCCESS, WcOpcode.RECV)
            self.recv_cq.push(WC(wc.wr_id, WcStatus.WR_FLUSH_ERR,  # type: ignore[union-attr]
                                 wc.opcode, 0, self.qp_num))  # type: ignore[union-attr]  # (a WC now)
        self._rentry = None
        self._rviews = None
        self._rkind = RX_DISCARD

    def _to_error(self) -> None:
        if self._state == _ERR:
            return
        # ERR before the frames queued so far go out (a NAK among them): a peer that has
        # the NAK must find this QP in ERR already
        self._state = _ERR
        self._unreference("queue pair in error with frames unsent")
        self._hold = False
        self._fence = False
        self._fenced.clear()
        self.ctx.rnr_waiters.discard(self)
        self._abort_rx()
        self._flush_sq()
        self._flush_rq()

    def _flush_sq(self) -> None:
        sq, push, qpn = self._sq, self.send_cq.push, self.qp_num
        while sq:
            e = sq.popleft()
            push(WC(e.wr_id, WcStatus.WR_FLUSH_ERR, e.opcode, 0, qpn))

    def _flush_rq(self) -> None:
        rq, push, qpn = self._rq, self.recv_cq.push, self.qp_num
        while rq:
            push(WC(rq.popleft()[0], WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0, qpn))

    # ------------------------------------------------------------------ posting
    def _resolve(self, sg_list: Sequence[SGE], local_write: bool
                 ) -> tuple[list[memoryview], int, int]:
        """(views, total, status): SGEs -> memoryviews of registered memory, or a local error
        status as the HCA would report it."""
        lkeys, pd = self.ctx.lkeys, self.pd
        views: list[memoryview] = []
        total = 0
        for sge in sg_list:
            mr = lkeys.get(sge.lkey)
            addr, length = sge.addr, sge.length
            if (mr is None or mr.pd is not pd or addr < mr.addr or addr + length > mr.end
                    or length < 0 or (local_write and not mr.bits & _LOCAL_WRITE)):
                return [], 0, WcStatus.LOC_PROT_ERR
            if length:
                off = addr - mr.addr
                views.append(mr.buf[off:off + length])
            total += length
        if total > wire.MAX_MESSAGE:
            return [], 0, WcStatus.LOC_LEN_ERR
        return views, total, 0

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        if isinstance(wrs, SendWR):
            c = wrs.resolved
            if c and c[0] is self:
                # A SEND posted again (a host's capsule, per I/O) as its first post noted
                # (_note_send): of the WR, only what an opted-in owner may change is read
                # again (SendWR.resolved), and checked; anything else takes the paths below.
                _, sg, mr, view, vlen, flags, signaled, whole, most = c
                if (wrs.opcode is _OP_SEND and wrs.send_flags is flags and wrs.sg_list is sg
                        and len(sg) == 1 and not mr.closed):
                    length = sg[0].length
                    if length != vlen:      # (else the view of the first post's length)
                        view = whole[:length] if 0 < length <= most else None
                    if view is not None:
                        with self._lock:
                            sq = self._sq
                            if (self._state is _RTS and not (self._hold or self._stall)
                                    and len(sq) < self._sq_max):
                                self._post_view(sq, wrs.wr_id, view, length, signaled)
                                return
            wrs = (wrs,)
        cap = self.cap
        with self._lock:
            sq = self._sq
            if len(wrs) == 1 and self._state is _RTS and not (self._hold or self._stall):
                # One WR (the host's capsule, per I/O): the general path below for one,
                # without its list and loops; anything out of the ordinary (a full queue,
                # a bad WR) falls through to it, which says why.
                wr = wrs[0]
                if wr.opcode is _OP_SEND and self._post_send1(sq, cap, wr):
                    return
                if (len(sq) < cap.max_send_wr and len(wr.sg_list) <= cap.max_send_sge
                        and wr.opcode in _WC_OF and not int(wr.send_flags) & _FENCE):
                    self.posted = now = _now()
                    if not sq:
                        self._last_progress = now
                    e = self._build(wr, cap, self._ack_due)
                    if e.psn is not None and not e.size:
                        self._read_done(e)          # read through a shared region
                        return
                    sq.append(e)
                    if e.psn is None:
                        self._stall = True          # (as below)
                        if sq[0] is e:
                            self._retire()
                        return
                    e.sent = True
                    size = e.size
                    e.end = self._tx_queued + size
                    self._xmit(e.frame, size)
                    return
            elif (len(wrs) == 2 and self._state is _RTS and not (self._hold or self._stall)
                    and self._post_pair(sq, cap, wrs[0], wrs[1])):
                return
            if self._state == _ERR:
                for wr in wrs:
                    self.send_cq.push(WC(wr.wr_id, WcStatus.WR_FLUSH_ERR,
                                         _WC_OF.get(wr.opcode, WcOpcode.SEND), 0, self.qp_num))
                return
            if self._state != _RTS:
                raise RdmaError(f"post_send on a QP in state {self._state.name}",
                                errno=_errno.EINVAL)
            if len(sq) + len(wrs) > cap.max_send_wr:
                raise RdmaError(f"send queue full ({cap.max_send_wr} WRs)", errno=_errno.ENOMEM)
            for wr in wrs:
                if len(wr.sg_list) > cap.max_send_sge or wr.opcode not in _WC_OF:
                    raise RdmaError(f"bad send WR {wr.wr_id}: opcode {wr.opcode}, "
                                    f"{len(wr.sg_list)} SGEs (max {cap.max_send_sge})",
                                    errno=_errno.EINVAL)
                if int(wr.send_flags) & _INLINE and wr.opcode is not _OP_READ:
                    # (_build checks it too, but a chain must fail before any WR is built)
                    total = sum(sge.length for sge in wr.sg_list)
                    if total > cap.max_inline_data:
                        raise RdmaError(f"bad send WR {wr.wr_id}: {total} B inline > "
                                        f"max_inline_data {cap.max_inline_data}",
                                        errno=_errno.EINVAL)
            self.posted = now = _now()
            if not sq:
                self._last_progress = now
            go = not (self._hold or self._stall)
            bufs: list = []
            end = self._tx_queued
            for wr in wrs:
                fenced = int(wr.send_flags) & _FENCE
                if fenced and go and self._reading():
                    # it waits for the RDMA READs before it to have their data, and every
                    # WR after it waits with it (_release sends them once they do)
                    go = False
                    self._stall = self._fence = True
                # the first request that goes out now carries the ACK this side owes
                e = self._build(wr, cap, go and self._ack_due, go)
                if e.psn is not None and not e.size:
                    self._read_done(e)              # read through a shared region
                    continue
                sq.append(e)
                if e.psn is None:
                    # stop here until it reaches the head and moves the QP to ERR (_retire):
                    # no later WR, of this post or of one before that, goes on the wire
                    self._stall = True
                    go = False
                elif go:
                    bufs.extend(e.frame)
                    e.sent = True
                    end += e.size
                    e.end = end
                elif fenced:
                    self._fenced.add(e.psn)
            if bufs:
                self._xmit(bufs, end - self._tx_queued)
            if sq and sq[0].psn is None:
                self._retire()

    def _carry(self, sq: deque) -> tuple[int, int]:
        """A request is posted now (its time noted): the header flags and ack field that
        carry the cumulative ACK this side owes (no longer owed then), else (0, 0)."""
        self.posted = now = _now()
        if not sq:
            self._last_progress = now
        if self._ack_due:
            self._ack_due = False
            if self.ack_group is not None:     # it waited for this request (defer_ack)
                self.ack_group.carried(self)
            return _F_ACK, self._done_psn
        return 0, 0

    def _post_send1(self, sq: deque, cap: QPCap, wr: SendWR) -> bool:
        """The SEND of every I/O (a host's capsule, a target's response to a write): one
        SGE read from registered memory, not inline.  Checked, then built and sent as
        _build does, with no step the general path takes for other WRs (and noted, for an
        owner that opted in: SendWR.resolved).  False, with nothing done, for any other
        SEND or one that fails a check (the general path then says why)."""
        sg = wr.sg_list
        if len(sg) != 1 or len(sq) >= self._sq_max or cap.max_send_sge < 1:
            return False
        flags = int(wr.send_flags)
        sge = sg[0]
        mr = self.ctx.lkeys.get(sge.lkey)
        addr, total = sge.addr, sge.length
        if (flags & _NOT_FAST or mr is None or mr.pd is not self.pd or addr < mr.addr
                or addr + total > mr.end or total <= 0 or total > _MAX_MESSAGE):
            return False
        self._send_from(sq, wr, flags, mr, addr - mr.addr, total)
        return True

    def _note_send(self, wr: SendWR, mr: SoftMR, off: int, length: int,
                   signaled: bool) -> None:
        """Note for an opted-in SEND (one SGE of ``length`` bytes at ``off`` in ``mr``,
        checked) what its later posts reuse (see post_send): the view of those bytes (a
        post of the same length takes it as it is), and the region's bytes from there on
        (a post of another length, up to them, takes a slice)."""
        whole = mr.buf[off:]
        wr.resolved = (self, wr.sg_list, mr, whole[:length], length, wr.send_flags, signaled,
                       whole, min(len(whole), _MAX_MESSAGE))

    def _post_view(self, sq: deque, wr_id: int, view: memoryview, length: int,
                   signaled: bool, ftype: int = _SEND, opcode: WcOpcode = _WC_SEND,
                   rkey: int = 0, raddr: int = 0) -> int:
        """Post a SEND (or an RDMA WRITE: ``ftype``, ``opcode``, ``rkey``, ``raddr``) of
        ``view`` (``length`` bytes of registered memory, checked; the lock held, room on
        ``sq``): its entry, and its frame carrying the ACK this side owes, out with the pass
        (at once when there is none).  Returns its PSN."""
        self.posted = now = _now()
        if not sq:
            self._last_progress = now
        psn = self._next_psn
        self._next_psn = (psn + 1) & M
        if self._ack_due:
            self._ack_due = False
            if self.ack_group is not None:     # it waited for this request (defer_ack)
                self.ack_group.carried(self)
            hdr = _hdr(_MAGIC, _VERSION, ftype, _F_ACK, psn, length, rkey, 0, self._done_psn,
                       raddr)
        else:
            hdr = _hdr(_MAGIC, _VERSION, ftype, 0, psn, length, rkey, 0, 0, raddr)
        e = _Entry()        # (status and rnr unset: read only after psn None, an RNR NAK)
        e.psn, e.wr_id, e.opcode, e.byte_len, e.signaled = psn, wr_id, opcode, length, signaled
        e.frame = [hdr, view]
        e.sent = True
        e.size = size = HDR + length
        e.end = tq = self._tx_queued + size
        sq.append(e)
        if self._dirty == _get_ident():
            # listed in this thread's pass already: out at its end (_xmit's usual case)
            self._tx_queued = tq
            q = self._outq
            q.append(hdr)
            q.append(view)
            queued = tq - self._tx_sent + QUEUED_BUFFER_COST * len(q)
            if queued >= CORK_BYTES or self.max_unsent and queued > self.max_unsent:
                self._pressed()
            return psn
        self._xmit(e.frame, size)
        return psn

    def _post_pair(self, sq: deque, cap: QPCap, write: SendWR, send: SendWR) -> bool:
        """The target's answer to a read, per I/O: an RDMA WRITE of the data, then the SEND
        of the response, each of one SGE read from registered memory, neither inline.  Both
        checked first, then built as one frame list and sent: what the general path of
        post_send and two _build calls do for this chain.  False, with nothing done, for any
        other chain or one that fails a check (the general path then says why)."""
        if (write.opcode is not _OP_WRITE or send.opcode is not _OP_SEND
                or len(sq) + 2 > cap.max_send_wr or cap.max_send_sge < 1):
            return False
        wsg, ssg = write.sg_list, send.sg_list
        wflags, sflags = int(write.send_flags), int(send.send_flags)
        if len(wsg) != 1 or len(ssg) != 1 or (wflags | sflags) & _NOT_FAST:
            return False
        lkeys, pd = self.ctx.lkeys, self.pd
        a, b = wsg[0], ssg[0]
        ma, mb = lkeys.get(a.lkey), lkeys.get(b.lkey)
        alen, blen, aaddr, baddr = a.length, b.length, a.addr, b.addr
        if (ma is None or mb is None or ma.pd is not pd or mb.pd is not pd
                or aaddr < ma.addr or aaddr + alen > ma.end or alen <= 0
                or baddr < mb.addr or baddr + blen > mb.end or blen <= 0
                or alen > _MAX_MESSAGE or blen > _MAX_MESSAGE):
            return False
        off = aaddr - ma.addr
        data = ma.buf[off:off + alen]
        if self._peer and self._copy_now() and \
                self._to_peer(write.rkey, write.remote_addr, [data], alen):
            if self._dead:      # a long copy's push found the peer gone: the general path
                return False    # flushes both (as post_write_send)
            # The data is in the peer's shared region already: the rest as post_write_send
            self._answer(sq, write.wr_id, wflags, alen, send, sflags, mb, baddr - mb.addr,
                         blen)
            return True
        # Through the socket: the WRITE (carrying the ACK owed), then the SEND, one pass
        self._later_psn = self._post_view(sq, write.wr_id, data, alen,
                                          self.sig_all or bool(wflags & _SIGNALED), _WRITE,
                                          _WC_WRITE, write.rkey, write.remote_addr)
        self._send_from(sq, send, sflags, mb, baddr - mb.addr, blen)
        return True

    def _shared_write_done(self, wr_id: int, length: int) -> None:
        """A signaled RDMA WRITE whose data was copied into the peer's shared region at its
        post: it completes, in order, once everything posted before it has (at once when
        nothing is outstanding), as the SEND after it carries the proof.  An unsignaled one
        takes no send-queue entry at all: its data is in place already and it has no
        completion to give (nor a flush to report: unlike an HCA's unacknowledged WRITE,
        it cannot be undone by an error now)."""
        sq = self._sq
        if sq:
            prev = sq[-1]
            w = _Entry()
            w.wr_id, w.opcode, w.byte_len, w.signaled = wr_id, _WC_WRITE, length, True
            w.psn, w.end = prev.psn, prev.end
            w.status = w.rnr = w.size = 0
            w.views, w.frame, w.sent = [], [], True
            sq.append(w)
        else:
            self.send_cq.push(WC(wr_id, _WC_OK, _WC_WRITE, length, self.qp_num))

    def post_write_send(self, write: SendWR, send: SendWR, addr: int, length: int, lkey: int,
                        remote_addr: int, rkey: int) -> None:
        """:meth:`QP.post_write_send`.  For a SEND its first post noted (an opted-in
        owner's: see post_send) and a WRITE with nothing out of the ordinary (room on the
        send queue, no inline data, no fence), with no read of ``write``'s SGE and no step
        of the general path (what _post_pair does for this chain): over a same-host
        connection whose peer shares the target region, the data is copied into it now and
        only the SEND goes on the wire; to a region this side does not map (a peer on
        another host), the WRITE and the SEND go through the socket.  Anything else takes
        the general path, which says what is wrong."""
        c = send.resolved
        if c and c[0] is self:
            _, sg, smr, view, vlen, sflags, signaled, whole, most = c
            ma = self.ctx.lkeys.get(lkey)
            blen = sg[0].length if len(sg) == 1 else 0
            if blen != vlen:
                view = whole[:blen] if 0 < blen <= most else None
            wflags = int(write.send_flags)
            if (send.opcode is _OP_SEND and send.send_flags is sflags and send.sg_list is sg
                    and not smr.closed and write.opcode is _OP_WRITE
                    and not wflags & _NOT_FAST and ma is not None
                    and ma.pd is self.pd and ma.addr <= addr and addr + length <= ma.end
                    and 0 < length <= _MAX_MESSAGE and view is not None):
                with self._lock:
                    sq = self._sq
                    if (self._state is _RTS and not (self._hold or self._stall)
                            and len(sq) + 2 <= self._sq_max):
                        got = self._peer.get(rkey) if self._peer else None
                        off = addr - ma.addr
                        if got is None:
                            # a region this side does not map (another host's): the WRITE
                            # through the socket, carrying the ACK owed, then the SEND
                            self._later_psn = self._post_view(
                                sq, write.wr_id, ma.buf[off:off + length], length,
                                self.sig_all or bool(wflags & _SIGNALED), _WRITE, _WC_WRITE,
                                rkey, remote_addr)
                            self._post_view(sq, send.wr_id, view, blen, signaled)
                            return
                        if (got[2] & _REMOTE_WRITE and got[0] <= remote_addr
                                and remote_addr + length <= got[1]
                                and (self._later_psn is None or self._copy_now())):
                            if length >= CORK_BYTES:
                                self.push()     # what the pass queued leaves first
                            if not self._dead:  # (that send may have found the peer gone)
                                at = remote_addr - got[0]
                                got[3][at:at + length] = ma.buf[off:off + length]
                                if self.sig_all or wflags & _SIGNALED:
                                    self._shared_write_done(write.wr_id, length)
                                self._post_view(sq, send.wr_id, view, blen, signaled)
                                return
        QP.post_write_send(self, write, send, addr, length, lkey, remote_addr, rkey)

    def _answer(self, sq: deque, write_id: int, wflags: int, length: int, send: SendWR,
                sflags: int, mr: SoftMR, off: int, blen: int) -> None:
        """The last step of a read answer whose WRITE (``write_id``, ``length`` bytes) was
        copied into the peer's shared region, its checks made (_post_pair's): the WRITE
        completes as _shared_write_done says (it takes no PSN and sends nothing: its data
        is in place already), and ``send`` goes out, of ``blen`` bytes at ``off`` in
        ``mr`` (noted, for an owner that opted in)."""
        if self.sig_all or wflags & _SIGNALED:
            self._shared_write_done(write_id, length)
        self._send_from(sq, send, sflags, mr, off, blen)

    def _send_from(self, sq: deque, send: SendWR, sflags: int, mr: SoftMR, off: int,
                   blen: int) -> None:
        """A SEND of one SGE, checked (_post_send1's, _post_pair's): ``blen`` bytes at
        ``off`` in ``mr``, noted for an owner that opted in."""
        signaled = self.sig_all or bool(sflags & _SIGNALED)
        if send.resolved is not None:
            self._note_send(send, mr, off, blen, signaled)
        self._post_view(sq, send.wr_id, mr.buf[off:off + blen], blen, signaled)

    def _peer_view(self, rkey: int, raddr: int, total: int, need: int) -> memoryview | None:
        """The bytes [raddr, raddr+total) of the peer's shared region ``rkey``, if it is one
        this side maps, they fit it and it grants ``need``; else None (the socket path,
        where the peer checks the request as any)."""
        got = self._peer.get(rkey)
        if got is None or not got[2] & need or raddr < got[0] or raddr + total > got[1] \
                or not total:
            return None
        off = raddr - got[0]
        return got[3][off:off + total]

    def _to_peer(self, rkey: int, raddr: int, views: list, total: int) -> bool:
        """An RDMA WRITE through the peer's shared region (see :meth:`_peer_view`; the peer
        checks it again on the header, as it would the payload): the data copied now, at
        the post.  False: it goes through the socket."""
        dst = self._peer_view(rkey, raddr, total, _REMOTE_WRITE)
        if dst is None:
            return False
        if total >= CORK_BYTES:
            self.push()     # what the pass queued leaves first, not after this long copy
        off = 0
        for v in views:
            n = len(v)
            dst[off:off + n] = v
            off += n
        return True

    def _copy_now(self) -> bool:
        """Whether an RDMA READ or WRITE through a shared region may copy at its post: no
        request whose data moves later waits for its answer, neither an RDMA WRITE this
        side sent through the socket (to a region not shared, or while held behind an RNR
        NAK), which the peer has yet to place, nor a READ answered later, which has yet to
        read.  So a copy never overtakes them: a READ sees every WRITE posted before it,
        a WRITE lands after every WRITE posted before it, and no READ posted before a
        WRITE sees that WRITE's data, as a responder executes them in order."""
        w = self._later_psn
        if w is None:
            return True
        if (self._acked - w) & M >= 0x80000000:
            return False
        self._later_psn = None
        return True

    def _read_done(self, e: _Entry) -> None:
        """An RDMA READ whose data :meth:`_build` copied from the peer's shared region:
        it completes in order, behind what was posted before it (taking that one's PSN, it
        completes with it), or at once when nothing is outstanding."""
        if self._dead:      # a long copy's push found the peer gone: flushed, as the rest
            self.send_cq.push(WC(e.wr_id, WcStatus.WR_FLUSH_ERR, _WC_READ, 0, self.qp_num))
            return
        sq = self._sq
        if sq:
            prev = sq[-1]
            e.psn, e.end = prev.psn, prev.end
            sq.append(e)
            # The peer may hold its ACK of those for traffic (ACK_DELAY) that waits for
            # this READ's answer: ask for it.
            psn = prev.psn
            if psn is not None and self._asked != psn:
                self._asked = psn
                self._want_ack = True
                if not self._dirty:
                    ident = _get_ident()
                    dirty = self.ctx.corks.get(ident)
                    if dirty is None:
                        self._ask_ack()
                    else:
                        self._dirty = ident
                        dirty.append(self)
        elif e.signaled:
            self.send_cq.push(WC(e.wr_id, _WC_OK, _WC_READ, e.byte_len, self.qp_num))

    def _build(self, wr: SendWR, cap: QPCap, ack: bool = False, now: bool = True) -> _Entry:
        """A send-queue entry with its frame; ``psn`` None when local checks failed.  With
        ``ack``, the header carries the cumulative ACK this side owes (and no longer owes
        it: the caller sends the frame in this pass).  ``now``: it goes out at once, so an
        RDMA WRITE or READ may go through a shared region (not one held behind others)."""
        op = wr.opcode
        e = _Entry()
        e.src = None
        e.wr_id = wr.wr_id
        e.opcode = _WC_OF[op]
        flags = int(wr.send_flags)
        e.signaled = self.sig_all or bool(flags & _SIGNALED)
        e.rnr = 0
        e.sent = False
        views: list[memoryview] | list[bytes]       # (bytes: an inline copy)
        status: int                     # a WcStatus, or 0
        sg = wr.sg_list
        if len(sg) == 1 and op != _OP_READ:
            # _resolve of one SGE read from (no LOCAL_WRITE needed), inline: the per-I/O case
            sge = sg[0]
            mr = self.ctx.lkeys.get(sge.lkey)
            addr, total = sge.addr, sge.length
            if (mr is None or mr.pd is not self.pd or addr < mr.addr or addr + total > mr.end
                    or total < 0):
                views, total, status = [], 0, WcStatus.LOC_PROT_ERR
            elif total > wire.MAX_MESSAGE:
                views, total, status = [], 0, WcStatus.LOC_LEN_ERR
            else:
                off = addr - mr.addr
                views = [mr.buf[off:off + total]] if total else []
                status = 0
        else:
            views, total, status = self._resolve(sg, op == _OP_READ)
        e.byte_len = total
        e.views = views
        e.status = status
        if status:
            e.psn = None
            e.frame = None  # type: ignore[assignment]  # (psn None: it is never sent)
            return e
        if flags & _INLINE and op != _OP_READ:
            if total > cap.max_inline_data:
                raise RdmaError(f"{total} B inline > max_inline_data {cap.max_inline_data}",
                                errno=_errno.EINVAL)
            views = [b"".join(views)] if views else []   # inline: the WR carries a copy
        if op == _OP_READ and now and self._peer and total and self._copy_now():
            src = self._peer_view(wr.rkey, wr.remote_addr, total, _REMOTE_READ)
            if src is not None:
                # The peer's region is mapped here: the READ copies now, sends nothing
                # and takes no PSN, and completes in order (see _read_done).
                if total >= CORK_BYTES:
                    self.push()     # (as _to_peer)
                if not self._dead:  # (else _read_done flushes it: the peer is gone)
                    _place(views, src)
                e.psn = e.size = 0
                e.frame = []
                e.src = None
                e.sent = True
                return e
        psn = e.psn = self._next_psn
        self._next_psn = (psn + 1) & M
        e.size = HDR if op == _OP_READ else HDR + total
        if ack:
            self._ack_due = False
            flags, done = _F_ACK, self._done_psn
            if self.ack_group is not None:     # it waited for this request (defer_ack)
                self.ack_group.carried(self)
        else:
            flags = done = 0
        # (a frame sent again after an RNR NAK carries this ACK again: an older cumulative
        # ACK than the peer has seen completes nothing, and is allowed)
        if op == _OP_SEND:              # the per-I/O opcodes first
            e.frame = [_hdr(_MAGIC, _VERSION, _SEND, flags, psn, total, 0, 0, done, 0), *views]
        elif op == _OP_WRITE or op == _OP_WRITE_IMM:
            if now and self._peer and self._copy_now() and \
                    self._to_peer(wr.rkey, wr.remote_addr, views, total):
                e.size = HDR
                flags |= _F_SHM
                views = []
            else:
                self._later_psn = psn       # its data goes through the socket
            if op == _OP_WRITE:
                e.frame = [_hdr(_MAGIC, _VERSION, _WRITE, flags, psn, total, wr.rkey, 0, done,
                                wr.remote_addr), *views]
            else:
                e.frame = [_pack(_WRITE, psn, total, wr.rkey, wr.imm_data, wr.remote_addr,
                                 flags | _F_IMM, done), *views]
        elif op == _OP_READ:
            if now and self._peer:
                e.src = self._peer_view(wr.rkey, wr.remote_addr, total, _REMOTE_READ)
                if e.src is not None:
                    flags |= _F_SHM     # copied from the region when the answer comes
            self._later_psn = psn       # its data moves when the answer comes
            e.frame = [_hdr(_MAGIC, _VERSION, _READ_REQ, flags, psn, total, wr.rkey, 0, done,
                            wr.remote_addr)]
        elif op == _OP_SEND_INV:
            e.frame = [_pack(_SEND, psn, total, 0, wr.invalidate_rkey, 0, flags | _F_INV,
                             done), *views]
        else:                           # _OP_SEND_IMM (post_send checked the opcode)
            e.frame = [_pack(_SEND, psn, total, 0, wr.imm_data, 0, flags | _F_IMM, done),
                       *views]
        return e

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        if isinstance(wrs, RecvWR):
            # One WR (a receive reposted, per I/O), its views resolved before and still
            # good (see _post_recvs): its receive-queue entry appended again as it was.
            c = wrs.resolved
            if c and c[0] is self:
                _, sg, mr, entry = c
                if (wrs.sg_list is sg and len(sg) == 1 and not mr.closed
                        and entry[0] == wrs.wr_id):
                    with self._lock:
                        if self._state is not _ERR and len(self._rq) < self._rq_max:
                            self._rq.append(entry)
                            return
            wrs = (wrs,)
        self._post_recvs(wrs)

    def _post_recvs(self, wrs: Sequence[RecvWR]) -> None:
        cap = self.cap
        with self._lock:
            if self._state == _ERR:
                for wr in wrs:
                    self.recv_cq.push(WC(wr.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, 0,
                                         self.qp_num))
                return
            rq = self._rq
            if len(rq) + len(wrs) > self._rq_max:
                raise RdmaError(f"receive queue full ({cap.max_recv_wr} WRs)",
                                errno=_errno.ENOMEM)
            entries: list[tuple | None] = []
            append = entries.append
            fresh = False
            for wr in wrs:
                # The entry a WR of one SGE made when last posted on this QP, while it keeps
                # that one-SGE list (whose SGEs an opted-in owner leaves as they are: RecvWR)
                # and its region is still registered (a closed region is never reached
                # through an old view); else its views resolved afresh.  (All checked
                # before any is posted: a bad one posts none.)
                c = wr.resolved
                if c and c[0] is self:
                    _, sg, mr, entry = c
                    if (wr.sg_list is sg and len(sg) == 1 and not mr.closed
                            and entry[0] == wr.wr_id):
                        append(entry)
                        continue
                if len(wr.sg_list) > cap.max_recv_sge:
                    raise RdmaError(f"recv WR {wr.wr_id}: {len(wr.sg_list)} SGEs > "
                                    f"{cap.max_recv_sge}", errno=_errno.EINVAL)
                append(None)            # (resolved below, once all passed this check)
                fresh = True
            for i, wr in enumerate(wrs) if fresh else ():
                if entries[i] is not None:
                    continue
                sg = wr.sg_list
                views, total, status = self._resolve(sg, True)
                entry = entries[i] = (wr.wr_id, views, total, status)
                c = wr.resolved
                if c is not None and not status and len(sg) == 1:      # opted in
                    wr.resolved = (self, sg, self.ctx.lkeys[sg[0].lkey], entry)
            rq.extend(entries)  # type: ignore[arg-type]  # (each None replaced above)

    # ------------------------------------------------------------------ transmit
    def _xmit(self, bufs: list, size: int) -> None:
        """Send now from the caller's thread (``size``: the bytes of ``bufs``); queue what the
        socket does not take, up to ``max_unsent``."""
        if self._dead:
            # The post that built these found the peer gone on its way (a long copy's push
            # sent what the pass had queued, and that failed): the QP is in ERR and flushed
            # already, so what this post appended since is flushed too, not left for good.
            self._flush_sq()
            return
        self._tx_queued += size
        q = self._outq
        corks = self.ctx.corks
        if corks:
            ident = _get_ident()
            dirty = corks.get(ident)
            if dirty is not None:       # in a pass: out at its end, with everything else
                q.extend(bufs)
                if not self._dirty:
                    self._dirty = ident
                    dirty.append(self)
                # (one test for the usual case: little queued, no limit below CORK_BYTES)
                queued = self._tx_queued - self._tx_sent + QUEUED_BUFFER_COST * len(q)
                if queued >= CORK_BYTES or self.max_unsent and queued > self.max_unsent:
                    self._pressed()
                return
        if not q and len(bufs) <= IOV_BATCH:
            try:
                n = self.sock.sendmsg(bufs)  # type: ignore[union-attr]  # (started: a socket)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                self._die(exc)
                return
            self._tx_sent += n
            if n == size:                   # all taken (the usual case): nothing to queue
                return
            for b in bufs:
                if n >= len(b):
                    n -= len(b)
                    continue
                q.append(memoryview(b)[n:] if n else b)
                n = 0
            if not q:
                return
        else:
            q.extend(bufs)
            if self._blocked:   # the socket is full: the engine flushes when it is writable
                bufs = None  # type: ignore[assignment]  # (from here: whether to flush)
        if bufs is not None:
            self._flush()
        self._check_unsent()

    def _pressed(self) -> None:
        """A pass has queued CORK_BYTES or ``max_unsent`` here: what it queued goes out
        now (a long pass: the peer starts on this much), and a peer that reads none of it
        is cut off at the bound."""
        if self._tx_queued - self._tx_sent >= CORK_BYTES and not self._blocked:
            self._flush()
        self._check_unsent()

    def _check_unsent(self) -> None:
        q = self._outq
        if q:
            unsent = self._tx_queued - self._tx_sent + QUEUED_BUFFER_COST * len(q)
            limit = self.max_unsent or DEFAULT_MAX_UNSENT
            if unsent > limit and not self._dead:
                self._die(f"the peer does not read: {unsent} bytes of frames unsent, more "
                          f"than {limit}", loud=True)

    def _flush(self) -> None:
        q = self._outq
        sock: socket.socket = self.sock  # type: ignore[assignment]  # (started: a socket)
        while q and not self._dead:
            try:
                if self._fds_out:       # a SHARE's descriptor: with these bytes, or before
                    n = sock.sendmsg(list(islice(q, IOV_BATCH)), [(
                        socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self._fds_out))])
                    if n:
                        for fd in self._fds_out:
                            os.close(fd)
                        self._fds_out.clear()
                else:
                    n = sock.sendmsg(list(islice(q, IOV_BATCH)))
            except BlockingIOError:
                break
            except OSError as exc:
                self._die(exc)
                return
            self._tx_sent += n
            if self._tx_sent == self._tx_queued:
                q.clear()       # the socket took all of it: no per-buffer accounting
                break
            while q:
                size = len(q[0])
                if n < size:
                    if n:
                        q[0] = memoryview(q[0])[n:]
                    break
                n -= size
                q.popleft()
        want = bool(q) and not self._dead
        if want != self._blocked:
            self._blocked = want
            self.ctx.want_write(self._fd, want)

    def end_pass(self) -> None:
        """The pass that queued frames here is over: the acknowledgement owed, then
        everything out in one sendmsg (what the socket does not take waits for EPOLLOUT).
        An acknowledgement that would leave alone (no other frame for this peer) may wait
        for traffic instead, up to the reactor's ACK_DELAY (see SoftContext.defer_ack)."""
        with self._lock:
            self._dirty = 0
            if self._dead:
                return
            if self._ack_due and (self._outq or self._ack_asked or self._want_ack
                                  or not self.ctx.defer_ack(self)):
                self._queue_ack()
            if self._want_ack:
                self._ask_ack()
            elif self._outq and not self._blocked:  # (an ACK deferred: nothing to send)
                self._flush()

    def push(self) -> None:
        """What the pass has queued here goes out now, with the ACK owed; the pass goes on
        (the QP stays listed in it), and what it queues later leaves at its end."""
        if not (self._dirty and self._outq):
            return
        with self._lock:
            if self._dead or not self._outq:
                return
            if self._ack_due:
                self._queue_ack()
            if not self._blocked:
                self._flush()

    def send_owed_ack(self) -> None:
        """The delay an acknowledgement could wait for traffic is over: send it, unless a
        request carried it meanwhile."""
        with self._lock:
            if self._ack_due and not self._dead:
                self._queue_ack()
                if not self._blocked:
                    self._flush()

    def _ask_ack(self) -> None:
        """Ask the peer for its acknowledgement now: this side's ACK (its cumulative one
        again when none is owed) flagged ACK_REQ, with whatever is queued."""
        self._want_ack = False
        self._ack_due = self._ack_asked = False     # (the frame acknowledges all executed)
        ack = _pack(_ACK, self._done_psn, flags=_F_ACK_REQ)
        q = self._outq
        if q and q[-1] is self._last_ack:
            q[-1] = ack         # (the same cumulative ACK, now asking too)
        else:
            self._tx_queued += HDR
            q.append(ack)
        self._last_ack = None   # (a later ACK does not replace it: it asks)
        if not self._blocked:
            self._flush()

    def _queue_ack(self) -> None:
        self._ack_due = False
        self._ack_asked = False
        ack = _pack(_ACK, self._done_psn)
        q = self._outq
        if q and q[-1] is self._last_ack:
            q[-1] = ack         # ACKs are cumulative: the newer one says it all
        else:
            self._tx_queued += HDR
            q.append(ack)
        self._last_ack = ack

    def _owe_ack(self) -> None:
        """A request was executed: acknowledge it at the end of this pass (at once when
        there is no pass: never left owed)."""
        self._ack_due = True
        if not self._dirty:
            ident = _get_ident()
            dirty = self.ctx.corks.get(ident)
            if dirty is None:
                self._queue_ack()
                if not self._blocked:
                    self._flush()
                return
            self._dirty = ident
            dirty.append(self)

    def on_writable(self) -> None:
        with self._lock:
            if not self._dead:
                self._last_progress = _now()
                self._flush()

    # ------------------------------------------------------------------ receive
    def on_readable(self) -> None:
        """Read what arrived: one ``recv_into`` the staging buffer (again only while it came
        back full), every complete frame parsed from it and small payloads copied from it
        into their registered memory; a large payload not yet staged (STRAIGHT_IN bytes or
        more left) is received straight into its memory."""
        with self._lock:
            if self._dead:
                return
            sock: socket.socket = self.sock  # type: ignore[assignment]  # (not _dead: a socket)
            stage = self._smv
            try:
                for _ in range(READ_ROUNDS):    # then the other connections get their turn
                    if self._rleft >= STRAIGHT_IN and self._spos == self._sfill:
                        if not self._recv_payload(sock):
                            return          # the socket is drained
                        continue
                    fill = self._sfill
                    if self._spos:          # keep only the unparsed tail, at the front
                        left = fill - self._spos
                        if left:
                            stage[:left] = stage[self._spos:fill]
                        self._spos = 0
                        fill = self._sfill = left
                    room = len(stage) - fill
                    n = self._recv_shm([stage[fill:]]) if self.shm else \
                        sock.recv_into(stage[fill:], room)
                    if n == 0:
                        raise ConnectionResetError("peer closed the connection")
                    self._sfill = fill + n
                    self._parse()
                    if self._dead or n < room:
                        return
                    if len(stage) < STAGE:  # traffic: the full-size staging from now on
                        stage = self._grow_stage()
            except BlockingIOError:
                pass
            except OSError as exc:
                self._die(exc)
            except wire.WireError as exc:
                self._die(f"protocol violation: {exc}", loud=True)

    def _grow_stage(self) -> memoryview:
        """Staging at its full size, the unparsed bytes kept where they were."""
        stage = bytearray(STAGE)
        stage[:self._sfill] = self._smv[:self._sfill]
        self._stage, self._smv = stage, memoryview(stage)
        return self._smv

    def _parse(self) -> None:
        """Consume every complete frame (and the staged part of a payload) from staging."""
        stage = self._smv
        pos, end = self._spos, self._sfill
        rq = self._rq
        cq = self.recv_cq
        # (the per-I/O frame's path: an owner of raw completions, its peer's CONN_RTU seen;
        # before that, _on_header sees every frame)
        fast = cq.raw and not self._rtu_due
        append = cq._q.append
        try:
            while pos < end:
                left = self._rleft
                if left:
                    take = end - pos
                    if take > left:
                        take = left
                    views = self._rviews
                    if views is not None:
                        v = views[0]
                        if len(v) >= take and len(views) == 1:
                            v[:take] = stage[pos:pos + take]
                            if len(v) > take:
                                self._rviews = [v[take:]]
                        else:
                            self._rviews = _place(views, stage[pos:pos + take])
                    pos += take
                    self._rleft = left = left - take
                    if left:
                        break               # the rest of it is still on its way
                    self._end_payload()
                    continue
                if end - pos < HDR:
                    break
                # The per-I/O frame (a capsule, a response: a SEND with no flag but ACK, staged
                # whole, in order, into a receive of one view, for an owner of raw
                # completions) placed and completed here; anything else, or anything this
                # finds not so, goes to _on_header, which says what is wrong with it (the
                # ACK it carried, taken here first, is then taken again: a no-op).  Magic,
                # version, type and flags are one word; key and extra one more.  A length
                # that fits in staging is below MAX_MESSAGE (STAGE is far smaller).
                if fast:
                    word, psn, length, keys, ack, addr = _unpack_fast(stage, pos)
                    if ((word == _W_SEND and not ack) or word == _W_SEND_ACK) and not (
                            keys or addr) and 0 < length <= end - pos - HDR \
                            and self._state is not _ERR:
                        if word != _W_SEND and ack != self._acked:
                            self._ack_upto(ack)
                        # (after an ACK, a WR that failed its checks at the head of the
                        # send queue goes first: _on_header retires it)
                        if rq and psn == self._exp_psn and (word == _W_SEND or not (
                                self._sq and self._sq[0].psn is None)):
                            wr_id, views, total, status = rq[0]
                            if not status and length <= total and len(views) == 1:
                                at = pos + HDR
                                views[0][:length] = stage[at:at + length]
                                rq.popleft()            # (only once placed: a copy that
                                pos = at + length       # failed leaves it to be flushed)
                                self._rnr_sent = False
                                self._exp_psn = (psn + 1) & M
                                self._rx_psn = self._done_psn = psn
                                if self._dirty:
                                    self._ack_due = True
                                else:
                                    self._owe_ack()
                                append((wr_id, 0, length))
                                if not cq.listed:
                                    cq.note()
                                continue
                self._on_header(pos)
                pos += HDR
                if self._dead:
                    return
        finally:
            self._spos = pos

    def _recv_payload(self, sock: socket.socket) -> bool:
        """Receive the payload in progress straight into its memory (or, discarded, into
        staging); False when the socket had less than asked."""
        views = self._rviews
        want = self._rleft
        if views is None:
            want = min(want, len(self._stage))
            n = self._recv_shm([self._smv[:want]]) if self.shm else \
                sock.recv_into(self._smv, want)
        elif self.shm:
            n = self._recv_shm(views)
        elif len(views) == 1:
            n = sock.recv_into(views[0])
        else:
            n = sock.recvmsg_into(views)[0]
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        self._last_progress = _now()    # (a long payload arriving: progress, as an answer)
        self._rleft -= n
        if self._rleft == 0:
            self._end_payload()
        elif views is not None:
            self._rviews = _advance(views, n)
        return n == want

    def _expect(self, views: list | None, length: int, kind: int) -> None:
        self._rviews, self._rleft, self._rkind = views, length, kind
        if not length:
            self._end_payload()

    def _discard(self, length: int) -> None:
        self._expect(None, length, RX_DISCARD)

    def _on_header(self, at: int) -> None:
        # The per-I/O frames (a SEND, a WRITE, no flag but ACK; a bare ACK) are checked
        # here, inline: a subset of what wire.decode accepts, with the same values; anything
        # else (other types, flags, fields) goes through decode, which says what is wrong.
        magic, version, ftype, flags, psn, length, key, extra, ack, addr = \
            _unpack_header(self._stage, at)
        if ftype == _ACK:
            if (magic != _MAGIC or version != _VERSION or flags & ~_F_ACK_REQ or length
                    or key or extra or ack or addr):
                _decode(self._stage, at)        # (it raises: says what is wrong)
        elif (magic != _MAGIC or version != _VERSION or extra
                or (flags & _NOT_ACK and (ftype != _WRITE or flags & _NOT_ACK != _F_SHM))
                or length > _MAX_MESSAGE or (ack and not flags & _F_ACK)
                or not (ftype == _WRITE or (ftype == _SEND and not key and not addr))):
            ftype, flags, psn, length, key, extra, addr, ack = _decode(self._stage, at)
        if self._rtu_due and ftype != _CONN_RTU:
            raise wire.WireError(f"frame type {ftype} before the CONN_RTU that comes first")
        if flags & _F_ACK and self._state != _ERR:
            # the peer's request carries its ACK of ours (validated like an ACK frame)
            self._ack_upto(ack)
            sq = self._sq
            if sq and sq[0].psn is None:
                self._retire()
                if self._dead:
                    return
        if ftype == _SEND or ftype == _WRITE or ftype == _READ_REQ:
            if psn != self._exp_psn or self._state == _ERR:
                # go-back-N after an RNR NAK, or a responder in ERR: drop silently (as IB);
                # otherwise requests come in order, and this one is not the next
                if not (self._rnr_sent or self._state == _ERR):
                    raise wire.WireError(f"request PSN {psn}, expected {self._exp_psn}")
                if ftype != _READ_REQ:
                    self._discard(length)
                return
            self._rnr_sent = False
            if ftype == _SEND:
                self._rx_send(psn, flags, length, extra)
            elif ftype == _WRITE:
                self._rx_write(psn, flags, length, key, extra, addr)
            else:
                self._rx_read_req(psn, flags, length, key, addr)
        elif ftype == _READ_RESP:
            self._rx_read_resp(psn, flags, length)
        elif self._state == _ERR and _ACK <= ftype <= _RNR_NAK:
            return              # answers to what was flushed
        elif ftype == _ACK:
            self._ack_upto(psn)
            sq = self._sq
            if sq and sq[0].psn is None:
                self._retire()
            if flags & _F_ACK_REQ and self._ack_due:
                # the peer waits on what this side owes: at the end of this pass, or now
                self._ack_asked = True
                if not self._dirty:
                    self._owe_ack()
        elif ftype == _NAK:
            self._answered(psn, "NAK")
            self._fail_head(WcStatus(key))
        elif ftype == _RNR_NAK:
            self._on_rnr(psn)
        elif ftype == _DREQ:
            self._die("peer disconnected")
        elif ftype == _CONN_RTU and self._rtu_due:
            self._rtu_due = False
        elif ftype == _SHARE:
            self._rx_share(length, key, extra, addr)
        elif ftype == _FORGET:
            self._rx_forget(key)
        else:
            raise wire.WireError(f"unexpected frame type {ftype} on a connected QP")

    # responder ---------------------------------------------------------
    def _take_recv(self, psn: int, length: int) -> tuple | None:
        """The next posted receive, or None after answering RNR / failing the QP."""
        rq = self._rq
        if not rq:
            self._xmit([_pack(Frame.RNR_NAK, psn)], HDR)
            self._rnr_sent = True
            self._discard(length)
            return None
        return rq.popleft()

    def _responder_error(self, psn: int, length: int, nak_status: WcStatus,
                         recv: tuple | None = None, local_status: WcStatus | None = None) -> None:
        """NAK the request, report the receive (if any) as failed, QP to ERR, drop payload."""
        self._xmit([_pack(Frame.NAK, psn, 0, nak_status)], HDR)
        if recv is not None:
            self.recv_cq.push(WC(recv[0], local_status,  # type: ignore[arg-type]  # (with recv)
                                 WcOpcode.RECV, 0, self.qp_num))
        self._to_error()
        self._discard(length)

    def _rx_send(self, psn: int, flags: int, length: int, extra: int) -> None:
        rq = self._rq
        recv = rq.popleft() if rq else self._take_recv(psn, length)
        if recv is None:
            return
        wr_id, views, total, status = recv
        if status:
            self._responder_error(psn, length, WcStatus.REM_OP_ERR, recv, status)
            return
        if length > total:
            self._responder_error(psn, length, WcStatus.REM_INV_REQ_ERR, recv,
                                  WcStatus.LOC_LEN_ERR)
            return
        self._exp_psn = (psn + 1) & M
        if self.recv_cq.raw:
            self._rwc = (wr_id, 0, length)      # an owner of raw completions: no WC
        else:
            wc = WC(wr_id, _WC_OK, _WC_RECV, length, self.qp_num)
            if flags & _F_INV:
                wc.wc_flags = WcFlags.WITH_INV
                wc.invalidated_rkey = extra
            elif flags & _F_IMM:
                wc.wc_flags = WcFlags.WITH_IMM
                wc.imm_data = extra
            self._rwc = wc
        self._rx_psn = psn
        if not length:
            self._expect(None, 0, RX_RECV)
            return
        self._rkind = RX_RECV
        self._rleft = length
        self._rviews = _cut(views, length) if len(views) != 1 else \
            [views[0][:length] if len(views[0]) > length else views[0]]

    def _rkey_mr(self, key: int, addr: int, length: int, need: int) -> SoftMR | None:
        """The MR that ``key`` grants ``need`` on [addr, addr+length), else None."""
        mr = self.ctx.rkeys.get(key)
        if (mr is None or mr.pd is not self.pd or not mr.bits & need or addr < mr.addr
                or addr + length > mr.end):
            return None
        return mr

    def _rx_write(self, psn: int, flags: int, length: int, key: int, extra: int,
                  addr: int) -> None:
        shm = flags & _F_SHM
        if shm:
            # the requester copied the data into the region already: checked as if it came
            # here (a NAK if this side would not have taken it), nothing follows the header
            if self._shared_mr(psn, key, addr, length, _REMOTE_WRITE) is None:
                return
        elif length:
            # _rkey_mr, inline: the per-I/O case (a read's data arriving at the host)
            mr = self.ctx.rkeys.get(key)
            if (mr is None or mr.pd is not self.pd or not mr.bits & _REMOTE_WRITE
                    or addr < mr.addr or addr + length > mr.end):
                self._responder_error(psn, length, WcStatus.REM_ACCESS_ERR)
                return
        self._rwc = None
        if flags & _F_IMM:
            recv = self._take_recv(psn, 0 if shm else length)
            if recv is None:
                return
            # (an owner of raw completions gets its tuple, as for a SEND: _rx_send)
            self._rwc = (recv[0], 0, length) if self.recv_cq.raw else \
                WC(recv[0], WcStatus.SUCCESS, WcOpcode.RECV_RDMA_WITH_IMM, length,
                   self.qp_num, WcFlags.WITH_IMM, imm_data=extra)
        self._exp_psn = (psn + 1) & M
        self._rx_psn = psn
        if shm or not length:
            self._expect(None, 0, RX_WRITE)
            return
        off = addr - mr.addr  # type: ignore[union-attr]  # _expect, inline (length: an mr)
        self._rviews = [mr.buf[off:off + length]]  # type: ignore[union-attr]
        self._rleft = length
        self._rkind = RX_WRITE

    def _shared_mr(self, psn: int, key: int, addr: int, length: int, need: int
                   ) -> SoftMR | None:
        """The region a request flagged SHM names, checked as any (REM_ACCESS_ERR), and
        shared with this peer (REM_INV_REQ_ERR: a requester cannot have copied otherwise);
        None after the NAK."""
        if not self.shm:
            raise wire.WireError("shared-memory request on a connection between hosts")
        mr = self._rkey_mr(key, addr, length, need)
        if mr is None:
            self._responder_error(psn, 0, WcStatus.REM_ACCESS_ERR)
        elif key not in self._shared:
            self._responder_error(psn, 0, WcStatus.REM_INV_REQ_ERR)
            mr = None
        return mr

    def _rx_read_req(self, psn: int, flags: int, length: int, key: int, addr: int) -> None:
        shm = flags & _F_SHM
        if shm:
            # the requester copies from the region once this answer says it may
            mr = self._shared_mr(psn, key, addr, length, _REMOTE_READ)
            if mr is None:
                return
        else:
            mr = self._rkey_mr(key, addr, length, _REMOTE_READ) if length else None
            if length and mr is None:
                self._responder_error(psn, 0, WcStatus.REM_ACCESS_ERR)
                return
        self._exp_psn = (psn + 1) & M
        self._done_psn = psn
        self._ack_due = False           # the response acknowledges everything up to psn
        hdr = _pack(Frame.READ_RESP, psn, length, flags=shm)
        if length and not shm:          # (shared: the requester copies, nothing follows)
            off = addr - mr.addr  # type: ignore[union-attr]  # (length: mr was found)
            self._xmit([hdr, mr.buf[off:off + length]], HDR + length)  # type: ignore[union-attr]
        else:
            self._xmit([hdr], HDR)

    def _end_payload(self) -> None:
        kind = self._rkind
        self._rviews = None
        if kind == RX_RECV or kind == RX_WRITE:
            # executed only now that every byte is in place: an ACK never runs ahead of the
            # data (the requester may then free or reuse what it sent)
            self._done_psn = self._rx_psn
            if self._dirty:             # owed at the end of this pass already
                self._ack_due = True
            else:
                self._owe_ack()
            rwc = self._rwc
            if rwc is not None:
                self._rwc = None
                cq = self.recv_cq           # push, inline
                cq._q.append(rwc)
                if not cq.listed:
                    cq.note()
        elif kind == RX_READ:
            e: _Entry = self._rentry  # type: ignore[assignment]  # (RX_READ: the READ answered)
            self._rentry = None
            sq = self._sq
            sq.popleft()
            self._acked = e.psn  # type: ignore[assignment]  # (a READ that was sent: a psn)
            if e.signaled:
                self.send_cq.push(WC(e.wr_id, WcStatus.SUCCESS, _WC_READ, e.byte_len,
                                     self.qp_num))
            if sq and sq[0].psn == e.psn:   # shared-memory WRITEs posted right behind it
                self._ack_upto(e.psn)     # type: ignore[arg-type]
            self._retire()
            if self._fence and self._state is _RTS and not self._dead:
                self._release(False)            # a fenced WR may go now

    # requester ---------------------------------------------------------
    def _rx_read_resp(self, psn: int, flags: int, length: int) -> None:
        shm = flags & _F_SHM
        if self._state == _ERR:
            if not shm:
                self._discard(length)
            return
        e = self._answered(psn, "read response")
        if e.opcode != _WC_READ or length != e.byte_len or e.end > self._tx_sent \
                or (shm and e.src is None):
            raise wire.WireError(f"read response for PSN {psn} of {length} bytes, which is "
                                 "no whole READ request of that length (through shared "
                                 "memory only if asked so)")
        self._rentry = e
        if shm:                         # the data is in the shared region: copied now
            src, e.src = e.src, None
            _place(e.views, src)        # type: ignore[arg-type]  # (checked above)
            self._expect(None, 0, RX_READ)
            return
        self._expect(list(e.views), length, RX_READ)

    def _answered(self, psn: int, what: str) -> _Entry:
        """The request a NAK, RNR NAK or READ_RESP for ``psn`` answers: everything before it
        is acknowledged by it, and it must be at the head, its header sent.  An answer is
        progress for the transport timer even when it completes nothing yet (a READ's data
        still arriving), as every response packet restarts an HCA's."""
        self._last_progress = _now()
        self._ack_upto((psn - 1) & M)
        sq = self._sq
        e = sq[0] if sq else None
        if e is None or e.psn != psn or not e.sent or e.end - e.size + HDR > self._tx_sent:
            raise wire.WireError(f"{what} for PSN {psn}, a request never sent")
        return e

    def _ack_upto(self, psn: int) -> None:
        """Complete every WR up to ``psn`` (READs complete with their data).  Each must have
        gone out whole: a peer acknowledging what it cannot have received, or past a READ
        it has not answered, is lying, and the connection ends (WireError).  (What it
        completes is the progress check_timeout looks for: _acked moves.)"""
        sq, cq, qpn = self._sq, self.send_cq, self.qp_num
        append, raw = cq._q.append, cq.raw
        sent = self._tx_sent
        while sq:
            e = sq[0]
            # e.psn <= psn in serial-number arithmetic (wire.psn_le, inline)
            if e.psn is None or (psn - e.psn) & M >= 0x80000000:
                break
            if not e.sent or e.end > sent or (e.opcode == _WC_READ and e.size):
                raise wire.WireError(f"acknowledgement of PSN {psn}: request {e.psn} was "
                                     + ("never sent whole" if e.opcode != _WC_READ
                                        else "a READ not answered"))
            sq.popleft()
            self._acked = e.psn
            if e.signaled:              # push, inline
                append((e.wr_id, 0, e.byte_len) if raw else
                       WC(e.wr_id, _WC_OK, e.opcode, e.byte_len, qpn))
                if not cq.listed:
                    cq.note()
        if (self._acked - psn) & M >= 0x80000000:
            raise wire.WireError(f"acknowledgement of PSN {psn}, never sent")

    def _retire(self) -> None:
        """A WR that failed local checks completes with its error once it reaches the head."""
        sq = self._sq
        if sq and sq[0].psn is None:
            e = sq.popleft()
            self.send_cq.push(WC(e.wr_id, WcStatus(e.status), e.opcode, 0, self.qp_num))
            self._to_error()

    def _fail_head(self, status: WcStatus) -> None:
        self._unreference("a request failed with frames unsent")
        if self._sq:
            e = self._sq.popleft()
            self.send_cq.push(WC(e.wr_id, status, e.opcode, 0, self.qp_num))
        self._to_error()

    def _on_rnr(self, psn: int) -> None:
        e = self._answered(psn, "RNR NAK")
        if e.opcode == _WC_READ or (e.opcode == _WC_WRITE
                                    and not e.frame[0][wire.FLAGS_AT] & _F_IMM):
            raise wire.WireError(f"RNR NAK for PSN {psn}, which consumes no receive")
        e.rnr = rnr = getattr(e, "rnr", 0) + 1     # (unset until its first: _post_view)
        if self.rnr_retry != 7 and rnr > self.rnr_retry:
            self._fail_head(WcStatus.RNR_RETRY_EXC_ERR)
            return
        self._hold = True
        self.rnr_deadline = _now() + min(RNR_FIRST * (1 << min(rnr - 1, 16)), RNR_MAX)
        self.ctx.rnr_waiters.add(self)
        self.ctx.timer_pending()

    def rnr_replay(self) -> None:
        """RNR timer expired: go back to the NAKed request and send everything again."""
        with self._lock:
            if self._state != _RTS or not self._hold:
                return
            self._hold = False
            self._last_progress = _now()
            self._release(True)

    def _reading(self) -> bool:
        """An RDMA READ on the send queue still waits for its data (what a fence waits for:
        a READ copied from a shared region at its post has it already)."""
        for e in self._sq:
            if e.opcode is _WC_READ and e.size:
                return True
        return False

    def _release(self, replay: bool) -> None:
        """Send the send queue's WRs in order: every one again after an RNR NAK
        (``replay``), else those not sent yet; up to a WR that failed its local checks
        (it moves the QP to ERR when it reaches the head), or a fenced WR with a READ
        before it still waiting for its data (it goes once that READ has it: _end_payload
        calls this again)."""
        bufs: list = []
        end = self._tx_queued
        reads = False
        for e in self._sq:
            if e.psn is None:
                break
            if e.sent and not replay:
                if e.opcode is _WC_READ and e.size:
                    reads = True
                continue
            if reads and e.psn in self._fenced:
                break
            self._fenced.discard(e.psn)
            bufs.extend(e.frame)
            e.sent = True
            end += e.size
            e.end = end
            if e.opcode is _WC_READ and e.size:
                reads = True
        else:
            if self._fence:             # everything out: nothing waits for a READ now
                self._fence = self._stall = False
        if bufs:
            self._xmit(bufs, end - self._tx_queued)

    def check_timeout(self, now: float) -> None:
        """Transport timer: a peer that stops answering (its QP in ERR, say) fails the head
        WR with RETRY_EXC_ERR after ``ack_timeout * (retry_count + 1)``, as an HCA does."""
        if not self._sq or self._hold or self._state != _RTS:
            return
        if self._acked != self._swept:
            # the peer answered a request since the last sweep (_ack_upto reads no clock)
            self._swept = self._acked
            self._last_progress = now
            return
        if now - self._last_progress <= self.ack_timeout * (self.retry_count + 1):
            return
        with self._lock:
            if self._sq and not self._hold and self._state == _RTS:
                self._fail_head(WcStatus.RETRY_EXC_ERR)

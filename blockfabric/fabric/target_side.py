"""The target's end of an NVMe-oF RDMA queue (NVMe-oF RDMA transport binding).

What this layer does, and nothing more: it keeps one receive slot posted per SQ entry, turns
each received capsule into a :class:`Command`, moves data as the command's SGL says (RDMA READ
from the host's keyed buffer, or a copy out of the capsule for in-capsule data), and sends
the response capsule, chained after the RDMA WRITEs that carry read data (RC ordering puts
the data before the CQE).  What a command *means* is the handler's business (the controller
in ``blockfabric.target``).

Transport-level rules enforced here, as Linux nvmet-rdma enforces them:

* a receive shorter than a 64-byte SQE is a fatal queue error (the host is broken);
* more outstanding commands than the queue has slots is a fatal queue error;
* a malformed SGL gets its NVMe status (``ProtocolError.status``) with DNR;
* in-capsule data only for host-to-controller commands, only inside what was received
  (offset + length beyond it: SGL invalid offset);
* any failed work completion (a bad host rkey, a vanished peer) breaks only this queue.

The per-I/O path allocates nothing: a Read or Write on an I/O queue is decoded from the
capsule as ints (:mod:`blockfabric.protocol.rw`, with the very checks of the full decode;
whatever those would refuse goes through the full decode and gets its status from it), and
each command slot answers with work requests and SGEs it made once and only updates.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from blockfabric.fabric.endpoint import (INDEX_MASK, KIND_READ, KIND_RECV, KIND_SEND,
                                         KIND_SHIFT, KIND_WRITE, Endpoint, wr_id)
from blockfabric.protocol import (CQE_SIZE, SQE, SQE_SIZE, KeyedSGL, OffsetSGL, ProtocolError,
                                  StatusCode)
from blockfabric.protocol.capsule import (FLAGS_FUSE_MASK, FLAGS_PSDT_MASK, PSDT_SGL,
                                          pack_cqe_into)
from blockfabric.protocol.opcodes import FABRICS_OPCODE, IOOpcode
from blockfabric.protocol.rw import CQE_FIELDS, RW_FIELDS
from blockfabric.protocol.sgl import TYPE_KEYED, TYPE_KEYED_INVALIDATE, TYPE_OFFSET
from blockfabric.rdma import PD, SGE, WC, CMId, SendFlags, SendWR, WcStatus, WrOpcode

if TYPE_CHECKING:
    from blockfabric.rdma.base import RawWC

log = logging.getLogger(__name__)

_unpack_rw = RW_FIELDS.unpack_from    # protocol.rw.unpack_rw, without its call
#: a success CQE: result, sq_head, sq_id, cid, status word (capsule.pack_cqe_into's layout)
_pack_cqe = CQE_FIELDS.pack_into
_SUCCESS = int(WcStatus.SUCCESS)
_OP_READ = int(IOOpcode.READ)
_OP_WRITE = int(IOOpcode.WRITE)
_WR_SEND = WrOpcode.SEND
_FLAGS_CHECKED = FLAGS_FUSE_MASK | FLAGS_PSDT_MASK
_UNSIGNALED = SendFlags(0)


class Handler(Protocol):
    """What the transport calls; implemented by the target's queue/controller logic."""

    def handle(self, cmd: Command) -> None: ...
    # (the queue: a TargetQueue, or the NVMe/TCP queue of blockfabric.fabric.tcp_target)
    def queue_broken(self, queue: Any, reason: str) -> None: ...


class CapsuleQueue(Protocol):
    """What the capsule decoding of :class:`TargetQueue` (``_on_capsule``,
    ``_check_inline``, ``take_inline``, ``fetch``) uses of its queue: a TargetQueue, and the
    NVMe/TCP queue (:class:`~blockfabric.fabric.tcp_target.TcpTargetQueue`), which borrows
    that code."""

    name: str
    qid: int
    depth: int
    inline_size: int
    sqhd: int
    dispatch: Callable[[Command], None]
    commands: list[Command]
    recv_views: list[memoryview]
    _free: list[int]

    @property
    def handler(self) -> Handler: ...

    def _check_inline(self, cmd: Command, sqe: SQE, inline_len: int) -> None: ...
    def take_inline(self, cmd: Command, dest: memoryview, at: int, length: int) -> None: ...
    def fetch_to(self, cmd: Command, addr: int, length: int, lkey: int,
                 done: Callable[[Command], None]) -> None: ...
    def respond(self, cmd: Command, status: int = ..., *, dnr: bool = ..., result: int = ...,
                data: Sequence[SGE] = ..., cid: int | None = ...) -> None: ...


class Command:
    """One received command, from its capsule until its response SEND completes.

    A slot of its queue: made once per slot with the slot's work requests (the response
    SEND, the RDMA WRITE of read data, the RDMA READ of write data) and their SGEs, which
    each use only updates.  Every command has its ``opcode``, ``cid`` and ``nsid`` and its SGL
    as plain ints (``sgl_type`` None: no SGL was decoded, the capsule was refused).  A Read
    or Write on an I/O queue (``rw``) is decoded by :func:`~blockfabric.protocol.rw.unpack_rw`
    into ``slba`` and ``cdw12`` and builds no :class:`SQE`; :attr:`sqe` decodes one from the
    capsule when something asks for it (it cannot fail: the fast checks are the full
    decode's).  Everything else is decoded in full, into :attr:`sqe` at once."""

    __slots__ = ("queue", "index", "recv_index", "_sqe", "inline_len", "on_fetched",
                 "on_released", "responded", "user", "opcode", "cid", "nsid", "rw", "slba",
                 "cdw12", "sgl_type", "sgl_addr", "sgl_key", "data_length", "ns", "started",
                 "send_wr", "data_wr", "data_sge", "read_wr", "read_sge", "chain_send",
                 "chain_data", "chain_read")

    #: the response SEND: made by :meth:`arm`, before the slot's first command (None until
    #: then, which only :meth:`TargetQueue._on_capsule` looks at)
    send_wr: SendWR

    def __init__(self, queue: TargetQueue, index: int) -> None:
        self.queue = queue
        self.index = index
        self.recv_index = -1
        self._sqe: SQE | None = None
        self.inline_len = 0                 # bytes received after the SQE
        self.on_fetched: Callable[[Command], None] | None = None
        self.on_released: Callable[[Command], None] | None = None
        self.responded = False
        self.user: Callable[[Command], None] | None = None   # undo, if it never completes
        self.opcode = self.cid = self.nsid = 0
        self.rw = False
        self.slba = self.cdw12 = 0
        self.sgl_type: int | None = None
        self.sgl_addr = self.sgl_key = self.data_length = 0
        self.ns: Any = None                 # the handler's: the namespace it pinned
        self.started = 0                    # the handler's: perf_counter_ns at the start
        # The slot's work requests, made with its first command (:meth:`arm`): a queue
        # whose peer never proves to be a host costs no more than it did.
        self.send_wr = None  # type: ignore[assignment]  # (see send_wr: until arm())

    def arm(self) -> None:
        """Make the slot's work requests (once, before its first command)."""
        index = self.index
        queue = self.queue
        self.send_wr = queue.opt_in(SendWR(wr_id(KIND_SEND, index), WrOpcode.SEND,
                                           [queue.send_pool.sge(index, CQE_SIZE)],
                                           SendFlags.SIGNALED))
        self.data_sge = SGE(0, 0, 0)
        self.data_wr = SendWR(wr_id(KIND_WRITE, index), WrOpcode.RDMA_WRITE, [self.data_sge],
                              _UNSIGNALED)
        self.read_sge = SGE(0, 0, 0)
        self.read_wr = SendWR(wr_id(KIND_READ, index), WrOpcode.RDMA_READ, [self.read_sge],
                              SendFlags.SIGNALED)
        self.chain_send = [self.send_wr]
        self.chain_data = [self.data_wr, self.send_wr]
        self.chain_read = [self.read_wr]

    @property
    def sqe(self) -> SQE:
        """The SQE of a command handed to the handler (only a capsule refused before it
        decoded, which no handler sees, has none: None)."""
        sqe = self._sqe
        if sqe is None and self.rw:
            sqe = self._sqe = SQE.unpack_from(self.queue.recv_views[self.recv_index])
        return sqe  # type: ignore[return-value]  # (see above: None only if refused)

    @property
    def sgl(self) -> KeyedSGL | OffsetSGL | None:
        """SGL1 as a descriptor object (for what is not on the per-I/O path)."""
        t = self.sgl_type
        if t is None:
            return None
        if t == TYPE_OFFSET:
            return OffsetSGL(self.sgl_addr, self.data_length)
        return KeyedSGL(self.sgl_addr, self.data_length, self.sgl_key,
                        t == TYPE_KEYED_INVALIDATE)

    @property
    def inline(self) -> memoryview:
        """The in-capsule data received after the SQE."""
        return self.queue.recv_views[self.recv_index][SQE_SIZE:SQE_SIZE + self.inline_len]

    def fetch(self, view: memoryview, sge: SGE, done: Callable[[Command], None]) -> None:
        """Bring the host's data for this command into local registered memory."""
        self.queue.fetch(self, view, sge, done)

    def respond(self, status: int = StatusCode.SUCCESS, *, dnr: bool = False,
                result: int = 0, data: Sequence[SGE] = ()) -> None:
        self.queue.respond(self, status, dnr=dnr, result=result, data=data)


def data_direction(sqe: SQE) -> int:
    """NVMe opcode bits 1:0 (fctype for Fabrics): 1 host-to-controller, 2 controller-to-host."""
    if sqe.opcode == FABRICS_OPCODE:
        return sqe.fctype & 3
    return sqe.opcode & 3


class TargetQueue(Endpoint):
    """The RDMA side of one target queue: ``depth`` receive slots and command contexts."""

    #: One queue's share of a reactor pass: every queue gets its turn in each pass.
    pass_limit = 64

    def __init__(self, cmid: CMId, pd: PD, *, qid: int, depth: int, inline_size: int,
                 handler: Handler, max_send_sge: int = 4, name: str | None = None,
                 recv_now: int | None = None) -> None:
        self.qid = qid
        self.depth = depth
        self.inline_size = inline_size
        self.handler = handler
        #: what runs a decoded command: the handler's ``handle``, until whoever serves the
        #: queue puts something more direct here (the controller's, once connected)
        self.dispatch: Callable[[Command], None] = handler.handle
        self.sqhd = 0
        self.sq_flow = True
        super().__init__(cmid, pd, recv_count=depth, recv_size=SQE_SIZE + inline_size,
                         send_count=depth, send_size=CQE_SIZE, max_send_wr=depth * 4,
                         max_send_sge=max_send_sge, name=name or f"q{qid}",
                         recv_now=recv_now)
        # Like the receive slots, command contexts for the whole depth only once the peer has
        # proved to be a host (post_more_receives): before that one receive, one command.
        first = depth if recv_now is None else max(1, min(depth, recv_now))
        self.commands = [Command(self, i) for i in range(first)]
        self._free = list(range(first - 1, -1, -1))
        self._cqe_views = self.send_pool.views

    def post_more_receives(self) -> None:
        super().post_more_receives()
        have = len(self.commands)
        if have < self.depth and not self.closed:
            self.commands.extend(Command(self, i) for i in range(have, self.depth))
            self._free[:0] = range(self.depth - 1, have - 1, -1)

    # -- completions -----------------------------------------------------------------
    raw_completions = True

    def handle(self, wcs: list[WC]) -> int:
        return self.handle_raw([(wc.wr_id, wc.status, wc.byte_len) for wc in wcs])

    def handle_raw(self, wcs: list[RawWC]) -> int:
        """:meth:`Endpoint.handle` with each completion's handling in this frame (no call
        per completion): a capsule, a response SEND done (its command free again), data
        fetched by an RDMA READ; a failed one breaks the queue."""
        commands = self.commands
        for n, (wid, status, length) in enumerate(wcs):
            if self.closed:
                return n
            try:
                if status != _SUCCESS:
                    self._fail(status, wid >> KIND_SHIFT)
                elif wid >> KIND_SHIFT == KIND_RECV:
                    self._on_capsule(wid & INDEX_MASK, length)
                elif wid >> KIND_SHIFT == KIND_SEND:
                    cmd = commands[wid & INDEX_MASK]
                    if cmd.on_released is not None:
                        released, cmd.on_released = cmd.on_released, None
                        released(cmd)
                    self._free.append(cmd.index)
                elif wid >> KIND_SHIFT == KIND_READ:
                    self._fetched(commands[wid & INDEX_MASK])
            except Exception as exc:
                self.completion_failed(wid, exc)
        return len(wcs)

    @staticmethod
    def _fetched(cmd: Command) -> None:
        done = cmd.on_fetched
        if done is not None:
            cmd.on_fetched = None
            done(cmd)

    def on_completion(self, wc: WC) -> None:
        self.handle_raw([(wc.wr_id, wc.status, wc.byte_len)])

    def on_fault(self, reason: str) -> None:
        if not self.closed:
            self.handler.queue_broken(self, reason)

    def _fail(self, wc_status: int, kind: int) -> None:
        if self.closed:
            return
        status = WcStatus(wc_status).name if wc_status in WcStatus._value2member_map_ \
            else str(wc_status)
        if wc_status == WcStatus.WR_FLUSH_ERR:
            reason = "queue flushed (peer disconnected or queue in error)"
        else:
            reason = f"work completion {status} on a {_KIND_NAMES.get(kind, kind)}"
        self.handler.queue_broken(self, reason)

    def _on_capsule(self: CapsuleQueue, recv_index: int, length: int) -> None:
        if length < SQE_SIZE:
            self.handler.queue_broken(self, f"received {length} bytes, shorter than an SQE")
            return
        free = self._free
        if not free:
            self.handler.queue_broken(self, f"host exceeded the queue depth of {self.depth}")
            return
        cmd = self.commands[free.pop()]
        if cmd.send_wr is None:
            cmd.arm()
        cmd.recv_index = recv_index
        cmd.responded = False
        cmd.on_fetched = cmd.on_released = cmd.user = None
        cmd._sqe = None
        sqhd = self.sqhd + 1
        self.sqhd = sqhd if sqhd < self.depth else 0
        inline_len = cmd.inline_len = length - SQE_SIZE
        capsule = self.recv_views[recv_index]
        opcode, flags, cid, nsid, addr, word, slba, cdw12 = _unpack_rw(capsule)
        # The Read/Write fast path: the checks SQE.unpack_from and _check_sgl make, on ints.
        # Anything they would refuse (or any other command) takes the full decode below,
        # which refuses it with the very status it always did.
        if (opcode == _OP_READ or opcode == _OP_WRITE) and self.qid \
                and flags & _FLAGS_CHECKED == PSDT_SGL:
            kind = word >> 56
            if kind == TYPE_KEYED or kind == TYPE_KEYED_INVALIDATE:
                cmd.data_length = word & 0xFFFFFF
                cmd.sgl_key = (word >> 24) & 0xFFFFFFFF
            elif kind == TYPE_OFFSET and opcode == _OP_WRITE and \
                    addr + (word & 0xFFFFFFFF) <= min(inline_len, self.inline_size):
                cmd.data_length = word & 0xFFFFFFFF
                cmd.sgl_key = 0
            else:
                kind = None
            if kind is not None:
                cmd.rw = True
                cmd.opcode = opcode
                cmd.cid = cid
                cmd.nsid = nsid
                cmd.slba = slba
                cmd.cdw12 = cdw12
                cmd.sgl_type = kind
                cmd.sgl_addr = addr
                self.dispatch(cmd)
                return
        cmd.rw = False
        cmd.opcode = opcode
        cmd.nsid = nsid
        cmd.cid = 0
        cmd.sgl_type = None
        try:
            sqe = cmd._sqe = SQE.unpack_from(capsule)
            cmd.cid = cid
            sgl = sqe.sgl
            if sgl.type_byte == TYPE_OFFSET:
                cmd.sgl_type = TYPE_OFFSET
                cmd.sgl_addr = sgl.offset  # type: ignore[union-attr]  # (TYPE_OFFSET: an OffsetSGL)
                cmd.sgl_key = 0
                cmd.data_length = sgl.length
                self._check_inline(cmd, sqe, inline_len)
            else:
                cmd.sgl_type = sgl.type_byte
                cmd.sgl_addr = sgl.addr  # type: ignore[union-attr]  # (not TYPE_OFFSET: a KeyedSGL)
                cmd.sgl_key = sgl.key  # type: ignore[union-attr]
                cmd.data_length = sgl.length
        except ProtocolError as exc:
            log.debug("%s: cid %s: %s", self.name, exc.cid, exc)
            self.respond(cmd, exc.status, dnr=exc.dnr, result=exc.result or 0,
                         cid=exc.cid if exc.cid is not None else cmd.cid)
            return
        self.dispatch(cmd)

    def _check_inline(self: CapsuleQueue, cmd: Command, sqe: SQE, inline_len: int) -> None:
        if data_direction(sqe) != 1:
            raise ProtocolError("in-capsule data on a command that does not write",
                                StatusCode.INVALID_FIELD, True, cid=cmd.cid)
        if cmd.sgl_addr + cmd.data_length > min(inline_len, self.inline_size):
            raise ProtocolError(f"in-capsule SGL {cmd.sgl_addr}+{cmd.data_length} beyond "
                                f"the {inline_len} bytes received",
                                StatusCode.SGL_INVALID_OFFSET, True, cid=cmd.cid)

    # -- data movement ---------------------------------------------------------------
    def fetch(self: CapsuleQueue, cmd: Command, view: memoryview, sge: SGE,
              done: Callable[[Command], None]) -> None:
        """RDMA READ the first ``sge.length`` bytes (at most the SGL's) of the host's keyed
        buffer into ``sge`` (or copy in-capsule data into ``view``), then call ``done(cmd)``
        on the reactor thread."""
        if cmd.sgl_type == TYPE_OFFSET:
            n = min(cmd.data_length, sge.length)
            self.take_inline(cmd, view, 0, n)
            done(cmd)
            return
        self.fetch_to(cmd, sge.addr, sge.length, sge.lkey, done)

    def fetch_to(self, cmd: Command, addr: int, length: int, lkey: int,
                 done: Callable[[Command], None]) -> None:
        """RDMA READ ``length`` bytes of the host's keyed buffer (the command's SGL is keyed)
        to local ``addr`` under ``lkey``; ``done(cmd)`` runs once they are there."""
        _aim(cmd.read_wr, cmd.read_sge, addr, length, lkey, cmd)
        cmd.on_fetched = done
        self.post_send(cmd.chain_read)

    def take_inline(self: CapsuleQueue, cmd: Command, dest: memoryview, at: int,
                    length: int) -> None:
        """Copy ``length`` bytes of the command's in-capsule data (offset SGL) to
        ``dest[at:]``."""
        start = SQE_SIZE + cmd.sgl_addr
        dest[at:at + length] = self.recv_views[cmd.recv_index][start:start + length]

    def respond(self, cmd: Command, status: int = StatusCode.SUCCESS, *, dnr: bool = False,
                result: int = 0, data: Sequence[SGE] = (), cid: int | None = None) -> None:
        """Re-post the capsule's receive slot, then post the read data (RDMA WRITE,
        unsignaled) and the response SEND in one chain."""
        if cmd.responded or self.closed:
            return
        cmd.responded = True
        self.repost(cmd.recv_index)
        pack_cqe_into(self._cqe_views[cmd.index], 0, cmd.cid if cid is None else cid, status,
                      result=result, sq_head=self.sqhd if self.sq_flow else 0xFFFF,
                      sq_id=self.qid, dnr=dnr)
        t = cmd.sgl_type
        if not data or status != StatusCode.SUCCESS or \
                (t != TYPE_KEYED and t != TYPE_KEYED_INVALIDATE):
            self._post_response(cmd, cmd.chain_send)
        elif len(data) == 1:
            sge = data[0]
            self._post_data(cmd, sge.addr, sge.length, sge.lkey)
        else:
            # Several pieces (an admin page padded with zeros): made here, not per I/O.
            wrs: list[SendWR] = []
            remote = cmd.sgl_addr
            for sge in data:
                wrs.append(SendWR(wr_id(KIND_WRITE, cmd.index), WrOpcode.RDMA_WRITE, [sge],
                                  _UNSIGNALED, remote_addr=remote, rkey=cmd.sgl_key))
                remote += sge.length
            wrs.append(cmd.send_wr)
            self._post_response(cmd, wrs)

    def respond_ok(self, cmd: Command, addr: int = 0, length: int = 0, lkey: int = 0) -> None:
        """:meth:`respond` with success, in fewer steps: with ``length``, the bytes at local
        ``addr`` (under ``lkey``) RDMA-written to the host's keyed buffer first (a read)."""
        if cmd.responded or self.closed:
            return
        cmd.responded = True
        qp = self.qp
        qp.post_recv(self._recv_wrs[cmd.recv_index])        # self.repost, inline
        _pack_cqe(self._cqe_views[cmd.index], 0, 0, self.sqhd if self.sq_flow else 0xFFFF,
                  self.qid, cmd.cid, 0)
        t = cmd.sgl_type
        if t == TYPE_KEYED and length:
            # _post_data and _post_response, inline: the slot's RDMA WRITE then its SEND
            send = cmd.send_wr
            if send.invalidate_rkey or send.opcode != _WR_SEND:
                send.opcode = _WR_SEND
                send.invalidate_rkey = 0
            qp.post_write_send(cmd.data_wr, send, addr, length, lkey, cmd.sgl_addr,
                               cmd.sgl_key)
        elif length and t == TYPE_KEYED_INVALIDATE:
            self._post_data(cmd, addr, length, lkey)
        else:
            self._post_response(cmd, cmd.chain_send)

    def _post_data(self, cmd: Command, addr: int, length: int, lkey: int) -> None:
        """The slot's RDMA WRITE of one local piece, then its SEND, in one chain."""
        _aim(cmd.data_wr, cmd.data_sge, addr, length, lkey, cmd)
        self._post_response(cmd, cmd.chain_data)

    def _post_response(self, cmd: Command, wrs: list[SendWR]) -> None:
        """Post ``wrs``, whose last is the slot's SEND (with invalidate, as the SGL asked).
        The slot's work requests are only updated, never made: a work request is the
        provider's to read only while post_send runs (verbs semantics), and a slot is not
        reused before its SEND completed, so no posted chain ever sees them change."""
        send = cmd.send_wr
        if cmd.sgl_type == TYPE_KEYED_INVALIDATE:
            send.opcode = WrOpcode.SEND_WITH_INV
            send.invalidate_rkey = cmd.sgl_key
        elif send.invalidate_rkey or send.opcode != _WR_SEND:
            send.opcode = _WR_SEND
            send.invalidate_rkey = 0
        self.post_send(wrs)

    @property
    def outstanding(self) -> int:
        return len(self.commands) - len(self._free)


def _aim(wr: SendWR, sge: SGE, addr: int, length: int, lkey: int, cmd: Command) -> None:
    """Point a slot's RDMA READ or WRITE: local ``addr``/``length``/``lkey``, the host's
    keyed buffer of ``cmd``'s SGL."""
    sge.addr = addr
    sge.length = length
    sge.lkey = lkey
    wr.remote_addr = cmd.sgl_addr
    wr.rkey = cmd.sgl_key


_KIND_NAMES = {KIND_RECV: "receive", KIND_SEND: "response send", KIND_READ: "RDMA READ",
               KIND_WRITE: "RDMA WRITE"}

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
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

from blockfabric.fabric.endpoint import (INDEX_MASK, KIND_READ, KIND_RECV, KIND_SEND,
                                         KIND_SHIFT, KIND_WRITE, Endpoint, wr_id)
from blockfabric.protocol import (CQE_SIZE, SQE, SQE_SIZE, KeyedSGL, OffsetSGL, ProtocolError,
                                  StatusCode)
from blockfabric.protocol.capsule import pack_cqe_into
from blockfabric.protocol.opcodes import FABRICS_OPCODE
from blockfabric.rdma import PD, SGE, WC, CMId, SendFlags, SendWR, WcStatus, WrOpcode

log = logging.getLogger(__name__)



class Handler(Protocol):
    """What the transport calls; implemented by the target's queue/controller logic."""

    def handle(self, cmd: Command) -> None: ...
    def queue_broken(self, queue: TargetQueue, reason: str) -> None: ...


class Command:
    """One received command, from its capsule until its response SEND completes."""

    __slots__ = ("queue", "index", "recv_index", "sqe", "inline", "sgl", "on_fetched",
                 "on_released", "responded", "user")

    def __init__(self, queue: TargetQueue, index: int) -> None:
        self.queue = queue
        self.index = index
        self.recv_index = -1
        self.sqe: SQE | None = None
        self.inline: memoryview | None = None
        self.sgl: KeyedSGL | OffsetSGL | None = None
        self.on_fetched: Callable[[Command], None] | None = None
        self.on_released: Callable[[Command], None] | None = None
        self.responded = False
        self.user: object = None

    @property
    def cid(self) -> int:
        return self.sqe.cid if self.sqe is not None else 0

    @property
    def data_length(self) -> int:
        """Bytes the SGL describes (0 for none)."""
        return self.sgl.length if self.sgl is not None else 0

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
        self.sqhd = 0
        self.sq_flow = True
        super().__init__(cmid, pd, recv_count=depth, recv_size=SQE_SIZE + inline_size,
                         send_count=depth, send_size=CQE_SIZE, max_send_wr=depth * 4,
                         max_send_sge=max_send_sge, name=name or f"q{qid}",
                         recv_now=recv_now)
        self.commands = [Command(self, i) for i in range(depth)]
        self._free = list(range(depth - 1, -1, -1))
        self._cqe_views = self.send_pool.views

    # -- completions -----------------------------------------------------------------
    def on_completion(self, wc: WC) -> None:
        kind = wc.wr_id >> KIND_SHIFT
        index = wc.wr_id & INDEX_MASK
        if wc.status != WcStatus.SUCCESS:
            self._fail(wc, kind)
            return
        if kind == KIND_RECV:
            self._on_capsule(index, wc.byte_len)
        elif kind == KIND_SEND:
            self._release(self.commands[index])
        elif kind == KIND_READ:
            cmd = self.commands[index]
            done, cmd.on_fetched = cmd.on_fetched, None
            if done is not None:
                done(cmd)

    def on_fault(self, reason: str) -> None:
        if not self.closed:
            self.handler.queue_broken(self, reason)

    def _fail(self, wc: WC, kind: int) -> None:
        if self.closed:
            return
        status = WcStatus(wc.status).name if wc.status in WcStatus._value2member_map_ \
            else str(wc.status)
        if wc.status == WcStatus.WR_FLUSH_ERR:
            reason = "queue flushed (peer disconnected or queue in error)"
        else:
            reason = f"work completion {status} on a {_KIND_NAMES.get(kind, kind)}"
        self.handler.queue_broken(self, reason)

    def _on_capsule(self, recv_index: int, length: int) -> None:
        if length < SQE_SIZE:
            self.handler.queue_broken(self, f"received {length} bytes, shorter than an SQE")
            return
        if not self._free:
            self.handler.queue_broken(self, f"host exceeded the queue depth of {self.depth}")
            return
        cmd = self.commands[self._free.pop()]
        cmd.recv_index = recv_index
        cmd.responded = False
        cmd.on_fetched = cmd.on_released = None
        cmd.user = None
        cmd.sqe = None
        self.sqhd = (self.sqhd + 1) % self.depth
        capsule = self.recv_views[recv_index][:length]
        try:
            cmd.sqe = SQE.unpack_from(capsule)
            cmd.sgl = cmd.sqe.sgl
            cmd.inline = capsule[SQE_SIZE:]
            self._check_sgl(cmd, length - SQE_SIZE)
        except ProtocolError as exc:
            log.debug("%s: cid %s: %s", self.name, exc.cid, exc)
            self.respond(cmd, exc.status, dnr=exc.dnr, result=exc.result or 0,
                         cid=exc.cid if exc.cid is not None else cmd.cid)
            return
        self.handler.handle(cmd)

    def _check_sgl(self, cmd: Command, inline_len: int) -> None:
        sgl = cmd.sgl
        if isinstance(sgl, OffsetSGL):
            if data_direction(cmd.sqe) != 1:
                raise ProtocolError("in-capsule data on a command that does not write",
                                    StatusCode.INVALID_FIELD, True, cid=cmd.cid)
            if sgl.offset + sgl.length > min(inline_len, self.inline_size):
                raise ProtocolError(f"in-capsule SGL {sgl.offset}+{sgl.length} beyond the "
                                    f"{inline_len} bytes received",
                                    StatusCode.SGL_INVALID_OFFSET, True, cid=cmd.cid)

    # -- data movement ---------------------------------------------------------------
    def fetch(self, cmd: Command, view: memoryview, sge: SGE,
              done: Callable[[Command], None]) -> None:
        """RDMA READ the first ``sge.length`` bytes (at most the SGL's) of the host's keyed
        buffer into ``sge`` (or copy in-capsule data into ``view``), then call ``done(cmd)``
        on the reactor thread."""
        sgl = cmd.sgl
        if isinstance(sgl, OffsetSGL):
            n = min(sgl.length, sge.length)
            view[:n] = cmd.inline[sgl.offset:sgl.offset + n]
            done(cmd)
            return
        cmd.on_fetched = done
        self.post_send(SendWR(wr_id(KIND_READ, cmd.index), WrOpcode.RDMA_READ,
                              [sge], SendFlags.SIGNALED, remote_addr=sgl.addr, rkey=sgl.key))

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
        wrs: list[SendWR] = []
        sgl = cmd.sgl
        if data and status == StatusCode.SUCCESS and isinstance(sgl, KeyedSGL):
            remote = sgl.addr
            for sge in data:
                wrs.append(SendWR(wr_id(KIND_WRITE, cmd.index), WrOpcode.RDMA_WRITE, [sge],
                                  SendFlags(0), remote_addr=remote, rkey=sgl.key))
                remote += sge.length
        send = SendWR(wr_id(KIND_SEND, cmd.index), WrOpcode.SEND,
                      [self.send_pool.sge(cmd.index, CQE_SIZE)], SendFlags.SIGNALED)
        if isinstance(sgl, KeyedSGL) and sgl.invalidate:
            send.opcode = WrOpcode.SEND_WITH_INV
            send.invalidate_rkey = sgl.key
        wrs.append(send)
        self.post_send(wrs)

    def _release(self, cmd: Command) -> None:
        released, cmd.on_released = cmd.on_released, None
        if released is not None:
            released(cmd)
        self._free.append(cmd.index)

    @property
    def outstanding(self) -> int:
        return self.depth - len(self._free)


_KIND_NAMES = {KIND_RECV: "receive", KIND_SEND: "response send", KIND_READ: "RDMA READ",
               KIND_WRITE: "RDMA WRITE"}

"""Device context, PD, MR, CQ and QP of the verbs provider, each a thin wrapper over pyverbs.

One pyverbs ``Context`` is opened per device and shared by every CM id, PD and CQ on it
(a listener's children included); it closes when the last of them is closed, so closing one
connection never pulls the device out from under another.  Nothing here blocks.
"""

from __future__ import annotations

import collections
import ctypes
import select
import threading
import weakref
from typing import Callable, Sequence

from blockfabric.errors import RdmaError
from blockfabric.rdma import base
from blockfabric.rdma.base import (SGE, WC, Access, QPCap, QPState, RecvWR, SendWR, WcFlags,
                                   WcOpcode, WcStatus, WrOpcode)
from blockfabric.rdma.verbs import _native
from blockfabric.rdma.verbs._native import rdma_error

_COMPLETES_AS = {WrOpcode.RDMA_WRITE: WcOpcode.RDMA_WRITE,
                 WrOpcode.RDMA_WRITE_WITH_IMM: WcOpcode.RDMA_WRITE,
                 WrOpcode.SEND: WcOpcode.SEND, WrOpcode.SEND_WITH_IMM: WcOpcode.SEND,
                 WrOpcode.SEND_WITH_INV: WcOpcode.SEND, WrOpcode.RDMA_READ: WcOpcode.RDMA_READ}

# QPs by number, so that a CQ can name the opcode of a failed completion (verbs leaves
# wc.opcode undefined unless the status is success).
_qps: "weakref.WeakValueDictionary[int, VerbsQP]" = weakref.WeakValueDictionary()


class Device:
    """One opened device, reference counted by everything allocated on it."""

    def __init__(self, registry: dict[str, "Device"], lock: threading.Lock, name: str):
        self._pv = _native.load()
        self._registry = registry
        self._lock = lock
        self.name = name
        try:
            self.ctx = self._pv.device.Context(name=name)
        except self._pv.PyverbsError as exc:
            raise rdma_error(f"cannot open RDMA device {name}", exc) from exc
        self.refs = 0
        attr = self.ctx.query_device()
        self.max_rd_atom = min(16, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom)

    def acquire(self) -> "Device":
        with self._lock:
            self.refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            if self.refs > 0:
                return
            if self._registry.get(self.name) is self:
                del self._registry[self.name]
        self.ctx.close()


class _Released:
    """close() that runs once and then drops the device reference."""

    _closed = False
    _device: Device

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
        finally:
            self._device.release()

    def _release(self) -> None:
        raise NotImplementedError


class VerbsContext(_Released, base.Context):
    """A handle on a shared :class:`Device`; closing the handle drops one reference."""

    def __init__(self, device: Device):
        self._device = device.acquire()
        self.name = device.name

    @property
    def device_key(self) -> object:
        """Every handle of one opened device: a PD of one is a PD of all (each CM id has
        its own handle, so ``id(context)`` would be one per connection)."""
        return ("verbs", id(self._device))

    def alloc_pd(self) -> "VerbsPD":
        return VerbsPD(self._device)

    def create_cq(self, depth: int = 256) -> "VerbsCQ":
        return VerbsCQ(self._device, depth)

    def _release(self) -> None:
        pass


class VerbsPD(_Released, base.PD):
    def __init__(self, device: Device):
        self._pv = _native.load()
        try:
            self.pd = self._pv.pd.PD(device.ctx)
        except self._pv.PyverbsError as exc:
            raise rdma_error("ibv_alloc_pd failed", exc) from exc
        self._device = device.acquire()

    def reg_mr(self, buffer, access: Access = Access.LOCAL_WRITE) -> "VerbsMR":
        return VerbsMR(self, buffer, Access(access))

    def _release(self) -> None:
        self.pd.close()


class VerbsMR(base.MR):
    """An MR over the caller's memory: pyverbs registers the address, ``buf`` views it.

    The ctypes array built over the buffer keeps a buffer export alive, so the bytearray cannot
    be resized and the mmap cannot be closed while the memory is registered.
    """

    def __init__(self, pd: VerbsPD, buffer, access: Access):
        pv = _native.load()
        self._base = memoryview(buffer)
        view = self._base.cast("B")
        if view.readonly:
            raise RdmaError("reg_mr needs writable memory (bytearray, mmap, memoryview)",
                            errno=22)
        self._pin: ctypes.Array[ctypes.c_char] | None = (
            ctypes.c_char * view.nbytes).from_buffer(view)
        self.addr = ctypes.addressof(self._pin)
        self.length = view.nbytes
        try:
            self._mr = pv.mr.MR(pd.pd, self.length, int(access), address=self.addr)
        except pv.PyverbsError as exc:
            self._pin = None
            raise rdma_error(f"ibv_reg_mr({self.length} B, {access!r}) failed", exc) from exc
        self.lkey = self._mr.lkey
        self.rkey = self._mr.rkey
        self.access = access
        self.buf = view
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mr.close()
        self._pin = None
        # let the owner close or resize its memory again (views exported to users keep it)
        self.buf.release()
        self._base.release()


class VerbsCQ(_Released, base.CQ):
    """A CQ with its own completion channel; the channel's fd is the one to wait on."""

    def __init__(self, device: Device, depth: int):
        pv = self._pv = _native.load()
        try:
            self._chan, self._fd = _native.create_with_fd(
                lambda: pv.cq.CompChannel(device.ctx), "anon_inode:[infinibandevent]")
            self.cq = pv.cq.CQ(device.ctx, depth, None, self._chan, 0)
        except pv.PyverbsError as exc:
            raise rdma_error("ibv_create_cq failed", exc) from exc
        self._device = device.acquire()

    def poll(self, max_entries: int = 16) -> list[WC]:
        try:
            _, wcs = self.cq.poll(max_entries)
        except self._pv.PyverbsError as exc:
            raise rdma_error("ibv_poll_cq failed", exc) from exc
        return [_to_wc(wc) for wc in wcs]

    def fileno(self) -> int:
        return self._fd

    def req_notify(self, solicited_only: bool = False) -> None:
        self.cq.req_notify(bool(solicited_only))

    def ack_events(self) -> int:
        n = 0
        while select.select([self._fd], [], [], 0)[0]:
            try:
                self._chan.get_cq_event(self.cq)
            except self._pv.PyverbsError as exc:
                if _native.is_eagain(exc):
                    break
                raise rdma_error("ibv_get_cq_event failed", exc) from exc
            n += 1
        if n:
            self.cq.ack_events(n)
        return n

    def _release(self) -> None:
        self.cq.close()
        self._chan.close()


_STATUSES = {int(s): s for s in WcStatus}


def _to_wc(wc) -> WC:
    """Never raises: a completion this interface cannot name (a newer ibv_wc_status) fails
    its WR as GENERAL_ERR, so a whole polled batch is never lost to one of them."""
    status = _STATUSES.get(wc.status, WcStatus.GENERAL_ERR)
    flags = WcFlags(wc.wc_flags & (WcFlags.GRH | WcFlags.WITH_IMM | WcFlags.WITH_INV))
    opcode = None
    if status is WcStatus.SUCCESS:
        try:
            opcode = WcOpcode(wc.opcode)
        except ValueError:
            pass
    qp = _qps.get(wc.qp_num)
    if qp is not None:
        opcode = qp.retire(wc.wr_id, opcode)
    return WC(wr_id=wc.wr_id, status=status, opcode=opcode or WcOpcode.SEND,
              byte_len=wc.byte_len, qp_num=wc.qp_num, wc_flags=flags,
              invalidated_rkey=wc.imm_data if flags & WcFlags.WITH_INV else 0,
              imm_data=wc.imm_data if flags & WcFlags.WITH_IMM else 0,
              vendor_err=wc.vendor_err)


def external_qp(existing: "VerbsQP | None", pd: base.PD, send_cq: base.CQ, recv_cq: base.CQ,
                cap: QPCap | None, sq_sig_all: bool,
                to_init: "Callable[[VerbsQP], None]") -> "VerbsQP":
    """A CM id's create_qp: a QP of our own on ``pd``, moved to INIT by ``to_init`` (from
    rdma_init_qp_attr, here or in the poll-group coordinator); closed again if that fails."""
    if not (isinstance(pd, VerbsPD) and isinstance(send_cq, VerbsCQ)
            and isinstance(recv_cq, VerbsCQ)):
        raise RdmaError("create_qp: PD and CQs must come from the verbs provider", errno=22)
    if existing is not None:
        raise RdmaError("create_qp: this CM id already has a QP", errno=17)
    qp = VerbsQP(pd, send_cq, recv_cq, cap or QPCap(), sq_sig_all)
    try:
        to_init(qp)
    except Exception:
        qp.close()
        raise
    return qp


class VerbsQP(base.QP):
    """An external RC QP: created here, driven to RTS by the CM id with rdma_init_qp_attr."""

    def __init__(self, pd: VerbsPD, send_cq: VerbsCQ, recv_cq: VerbsCQ, cap: QPCap,
                 sq_sig_all: bool):
        pv = self._pv = _native.load()
        qcap = pv.qp.QPCap(max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr,
                           max_send_sge=cap.max_send_sge, max_recv_sge=cap.max_recv_sge,
                           max_inline_data=cap.max_inline_data)
        init = pv.qp.QPInitAttr(qp_type=pv.e.IBV_QPT_RC, scq=send_cq.cq, rcq=recv_cq.cq,
                                cap=qcap, sq_sig_all=int(bool(sq_sig_all)))
        try:
            self.qp = pv.qp.QP(pd.pd, init)
        except pv.PyverbsError as exc:
            raise rdma_error("ibv_create_qp failed", exc) from exc
        self.qp_num = self.qp.qp_num
        self.cap = cap
        # posted, not yet completed work, oldest first: (wr_id, what it completes as).  Keeps
        # the depths asked for (devices round them up) and names the opcode of a failed
        # completion, which verbs leaves undefined.
        self._sq: collections.deque = collections.deque()
        self._rq: collections.deque = collections.deque()
        # The host posts from its callers' threads while the reactor retires completions:
        # both deques change under this lock only, and a post records its WRs before a
        # completion of them can be retired (else retire misses them, and they stay).
        self._wr_lock = threading.Lock()
        self._closed = False
        _qps[self.qp_num] = self

    @property
    def state(self) -> QPState:
        if self._closed:
            return QPState.ERR
        attr, _ = self.qp.query(self._pv.e.IBV_QP_STATE)
        return QPState(attr.qp_state)

    def modify(self, attr, mask: int, what: str) -> None:
        try:
            self.qp.modify(attr, mask)
        except self._pv.PyverbsError as exc:
            raise rdma_error(f"ibv_modify_qp to {what} failed", exc) from exc

    def to_error(self) -> None:
        """Move to ERR (posted work is flushed), as the kernel does on a disconnect."""
        if self._closed:
            return
        attr = self._pv.qp.QPAttr(qp_state=self._pv.e.IBV_QPS_ERR)
        self.modify(attr, self._pv.e.IBV_QP_STATE, "ERR")

    def retire(self, wr_id: int, opcode: WcOpcode | None) -> WcOpcode | None:
        """Account for one completion; return its opcode.

        Completions come in order per queue; a signaled send completion also retires the
        unsignaled sends posted before it.
        """
        with self._wr_lock:
            from_rq = (opcode is not None and opcode >= WcOpcode.RECV) or (
                opcode is None and self._rq and self._rq[0][0] == wr_id)
            queue = self._rq if from_rq else self._sq
            if not any(w == wr_id for w, _ in queue):
                return opcode
            while queue:
                w, op = queue.popleft()
                if w == wr_id:
                    return opcode if opcode is not None else op
            return opcode

    def _sges(self, sg_list: Sequence[SGE]) -> list:
        sge = self._pv.wr.SGE
        # pyverbs refuses a WR without an SGE; a zero-length SGE is what verbs means by none
        return [sge(s.addr, s.length, s.lkey) for s in sg_list] or [sge(0, 0, 0)]

    def _send_wr(self, w: SendWR):
        sges = self._sges(w.sg_list)
        # ibv_send_wr keeps imm_data and invalidate_rkey in one union; pyverbs names only
        # imm_data and stores it unswapped, so it carries the rkey to invalidate as well
        imm = w.invalidate_rkey if w.opcode == WrOpcode.SEND_WITH_INV else w.imm_data
        p = self._pv.wr.SendWR(wr_id=w.wr_id, opcode=int(w.opcode), num_sge=len(sges),
                               imm_data=imm, sg=sges, send_flags=int(w.send_flags))
        if w.opcode in (WrOpcode.RDMA_WRITE, WrOpcode.RDMA_WRITE_WITH_IMM, WrOpcode.RDMA_READ):
            p.set_wr_rdma(w.rkey, w.remote_addr)
        return p

    def _recv_wr(self, w: RecvWR):
        sges = self._sges(w.sg_list)
        return self._pv.wr.RecvWR(wr_id=w.wr_id, num_sge=len(sges), sg=sges)

    def _post(self, wrs, one: type, build, post, queue: collections.deque, depth: int,
              max_sge: int, what: str) -> None:
        """Check the chain against the QP's cap, then post it with one call.

        A chain that does not fit is refused whole, before anything is posted.
        """
        wrs = [wrs] if isinstance(wrs, one) else list(wrs)
        if not wrs:
            return
        if any(len(w.sg_list) > max_sge for w in wrs):
            raise RdmaError(f"{what}: more than {max_sge} SGEs in a work request", errno=22)
        built = [build(w) for w in wrs]
        for wr, nxt in zip(built, built[1:]):
            wr.next_wr = nxt
        with self._wr_lock:
            if len(queue) + len(wrs) > depth:
                raise RdmaError(f"{what}: queue full ({len(queue)} of {depth} posted)",
                                errno=12)
            entries = [(w.wr_id, _COMPLETES_AS[WrOpcode(w.opcode)] if one is SendWR
                        else WcOpcode.RECV) for w in wrs]
            queue.extend(entries)
            try:
                post(built[0])
            except self._pv.PyverbsError as exc:
                for _ in entries:            # nothing of a failed chain is counted
                    queue.pop()
                raise rdma_error(f"{what} failed", exc) from exc

    def post_send(self, wrs: SendWR | Sequence[SendWR]) -> None:
        self._post(wrs, SendWR, self._send_wr, self.qp.post_send, self._sq,
                   self.cap.max_send_wr, self.cap.max_send_sge, "ibv_post_send")

    def post_recv(self, wrs: RecvWR | Sequence[RecvWR]) -> None:
        self._post(wrs, RecvWR, self._recv_wr, self.qp.post_recv, self._rq,
                   self.cap.max_recv_wr, self.cap.max_recv_sge, "ibv_post_recv")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.qp.close()

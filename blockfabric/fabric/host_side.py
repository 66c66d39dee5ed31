"""The host's end of an NVMe-oF RDMA queue.

Each queue has ``depth`` command slots.  A slot owns a registered capsule buffer (64-byte SQE
plus room for in-capsule data), the SEND work request and SGE that post it (made once, reused
for every command of the slot) and a command identifier: the slot index in the low 12 bits
and a 4-bit generation above it (as the Linux host does), so a stale or forged CQE for a
reused slot is recognised and dropped.  A command completes when *both* its SEND has
completed and its response capsule has arrived (the Linux host's two references), so a
slot's buffer is never reused while the provider may still read it.

One callback shape: a command's *owner* (an object the submitter keeps) gets
``owner.complete(raw, error)`` once, on the reactor thread: ``raw`` is the response capsule
as the tuple ``(result, sq_head, sq_id, cid, status word)`` and ``error`` None, or ``raw``
None and ``error`` the :class:`~blockfabric.errors.QueueDead` the queue died of (a
:class:`~blockfabric.errors.WorkCompletionError`, with the completion's status, when a work
request failed).  :meth:`HostQueue.submit_rw` packs a
Read or Write straight into the slot's send buffer (:mod:`blockfabric.protocol.rw`): nothing
is built per command.  :meth:`HostQueue.submit` takes any :class:`SQE` and a plain callback,
for everything that is not a read or a write.

Threads: submission may come from any thread (the FUSE loop, benchmark workers, the
namespace calls); completions are serviced by the controller's reactor thread.  The
reactor's own path takes no lock: a slot is taken from the free list (a list pop), filled and
posted by its taker alone, and completed by the reactor alone.  A submitter on another thread
takes the queue lock, so that :meth:`HostQueue.fail` (which takes it too) never misses a slot
being taken, and waits there for a free slot; the reactor signals it only when someone waits.

Why one module of ~500 lines: the slots, their two-reference completion and the queue's
failure are one state machine, and the per-I/O path (:meth:`HostQueue.submit_rw`,
:meth:`HostQueue.handle_raw`, ``_complete``) reads slot fields inline; split, every I/O would
pay calls and attribute reads across modules (issue 14).
"""

from __future__ import annotations

import logging
import struct
import threading
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.errors import QueueDead, WorkCompletionError
from blockfabric.fabric.endpoint import (INDEX_MASK, KIND_RECV, KIND_SEND, KIND_SHIFT,
                                         Endpoint, wr_id)
from blockfabric.protocol import CQE, CQE_SIZE, SQE, SQE_SIZE, OffsetSGL
from blockfabric.protocol.capsule import PSDT_SGL
from blockfabric.protocol.rw import RW_SQE, pack_rw_into
from blockfabric.protocol.sgl import TYPE_KEYED, TYPE_OFFSET
from blockfabric.protocol.status import status_code
from blockfabric.rdma import (CONNECTION_ENDED, PD, WC, CMId, QPState, RecvWR, SendFlags,
                              SendWR, WcStatus, WrOpcode)

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.rdma.base import RawWC

log = logging.getLogger(__name__)

SLOT_BITS = 12
SLOT_MASK = (1 << SLOT_BITS) - 1
GEN_MASK = 0xF
#: A batch of at least this many responses that answers every command in flight is
#: handled in two halves, the commands the first half issued pushed out in between
#: (HostQueue.handle_raw; on NVMe/TCP, TcpHostQueue._receive).
SPLIT_MIN = 4
#: the status field's SCT/SC bits in the CQE's last u16 (bit 0 is the phase tag)
STATUS_BITS = 0x7FF << 1
_KEYED = TYPE_KEYED << 56
_OFFSET = TYPE_OFFSET << 56
_rw_pack_into = RW_SQE.pack_into    # pack_rw_into without its call (the reactor's path)
_CQE_RAW = struct.Struct("<QHHHH")
_unpack_cqe = _CQE_RAW.unpack_from
_get_ident = threading.get_ident
#: a response as the host reads it: (result, sq_head, sq_id, cid, status word)
RawCQE = tuple[int, int, int, int, int]

Callback = Callable[[CQE | None, QueueDead | None], None]


def cqe_of(raw: RawCQE) -> CQE:
    """The :class:`CQE` of a raw response tuple (for callers that want the object)."""
    result, sq_head, sq_id, cid, word = raw
    return CQE(result, sq_head, sq_id, cid, status_code(word >> 1), bool(word & 0x8000),
               bool(word & 0x4000), (word >> 12) & 3, word & 1)


class _CallbackOwner:
    """The owner of a command submitted with a plain ``callback(cqe, error)``."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callback) -> None:
        self.callback = callback

    def complete(self, raw: RawCQE | None, error: QueueDead | None) -> None:
        self.callback(None if raw is None else cqe_of(raw), error)


class Slot:
    __slots__ = ("index", "gen", "cid", "owner", "sent", "raw", "busy", "seq", "view", "sge",
                 "wr")

    def __init__(self, index: int, view: memoryview, wr: SendWR) -> None:
        self.index = index
        self.gen = 0
        self.cid = index
        self.owner: Any = None      # what gets complete(raw, error)
        self.sent = False
        self.raw: RawCQE | None = None
        self.busy = False
        self.seq = 0            # submission order on this queue, to count overtakes
        self.view = view        # the slot's registered send buffer (capsule)
        self.wr = wr            # its SEND, reused: only the SGE's length changes (and
        self.sge = wr.sg_list[0]    # the provider may note the rest: SendWR.resolved)


def inline_mismatch(data: Any, length: int) -> str:
    return f"{len(data)} bytes of in-capsule data for a command of {length}"


class QueueStats:
    """Counters a caller can read to see what the queue did.  Each is written by one
    thread only (the reactor, or a submitter holding the queue lock), so none is lost."""

    __slots__ = ("submitted_loop", "submitted_other", "completed", "max_inflight",
                 "out_of_order", "errors", "_last_seq", "_depth", "_free")

    def __init__(self, depth: int, free: list[int]) -> None:
        self.submitted_loop = self.submitted_other = self.completed = 0
        self.max_inflight = self.out_of_order = self.errors = 0
        self._last_seq = -1
        self._depth = depth
        self._free = free

    @property
    def submitted(self) -> int:
        return self.submitted_loop + self.submitted_other

    @property
    def inflight(self) -> int:
        return self._depth - len(self._free)

    def as_dict(self) -> dict[str, int]:
        return {"submitted": self.submitted, "completed": self.completed,
                "inflight": self.inflight, "max_inflight": self.max_inflight,
                "out_of_order": self.out_of_order, "errors": self.errors}


class HostQueue(Endpoint):
    """One host queue: ``depth`` command slots and ``depth`` posted response receives."""

    def __init__(self, cmid: CMId, pd: PD, *, qid: int, depth: int, inline_size: int,
                 name: str | None = None) -> None:
        if depth > 1 << SLOT_BITS:
            raise ValueError(f"queue depth {depth} exceeds {1 << SLOT_BITS}")
        self.qid = qid
        self.depth = depth
        self.inline_size = inline_size
        super().__init__(cmid, pd, recv_count=depth, recv_size=CQE_SIZE,
                         send_count=depth, send_size=SQE_SIZE + inline_size,
                         max_send_wr=depth, max_send_sge=2, name=name or f"q{qid}")
        pool = self.send_pool
        self._init_slots([Slot(i, pool.views[i],
                               self.opt_in(SendWR(wr_id(KIND_SEND, i), WrOpcode.SEND,
                                                  [pool.sge(i, SQE_SIZE)], SendFlags.SIGNALED)))
                          for i in range(depth)])
        self.on_cm_event = self._on_cm_event

    def _init_slots(self, slots: list[Slot]) -> None:
        """The command slots and their accounting, whatever moves the capsules (the NVMe/TCP
        queue calls this too)."""
        self.slots = slots
        self._free = list(range(len(slots) - 1, -1, -1))
        #: the free slots' indexes (the same list: read it, never change it, from outside)
        self.free_slots = self._free
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._waiters = 0           # submitters waiting for a slot (under the lock)
        self._loop_ident: int | None = None     # the reactor thread, once attached
        self.stats = QueueStats(len(slots), self._free)
        self.dead_reason: str | None = None
        #: what the queue died of (``dead_reason`` is its text), given to every owner
        self.dead_error: QueueDead | None = None

    def attach(self, reactor: Reactor) -> None:
        super().attach(reactor)
        self._note_loop(reactor)

    def _note_loop(self, reactor: Reactor) -> None:
        """Remember the reactor's thread: submissions from it take the lock-free path."""
        thread = getattr(reactor, "thread", None)
        self._loop_ident = thread.ident if thread is not None else None

    def _on_cm_event(self) -> None:
        """The target ended the connection (DREQ) or the device went away: fail what is
        outstanding now.  Linux nvmet, for one, disconnects right after a failed
        authentication, and may do so before its answer is sent; on the verbs provider
        nothing else would tell a host that has no work request outstanding (the receives
        flush only once the event has been read).  What already arrived is taken first."""
        while not self.closed:
            event = self.cmid.get_event(0)
            if event is None:
                return
            if event.type in CONNECTION_ENDED:
                self.service()
                self.fail("the target disconnected", expected=self.closed)
                return

    # -- submission ------------------------------------------------------------------
    def submit_rw(self, owner: Any, opcode: int, nsid: int, slba: int, nlb: int, addr: int,
                  length: int, rkey: int, data: Any = None) -> int:
        """Send a Read (0x02) or Write (0x01) of ``nlb + 1`` blocks at ``slba``: the data
        moves by RDMA to or from ``length`` bytes at ``addr`` under ``rkey`` (memory the
        caller registered), or, for a write whose ``data`` (a view of those bytes) fits,
        travels in the capsule.  ``owner.complete(raw, error)`` runs once, on the reactor.
        Returns the cid.  Nothing is allocated for it: the SQE is packed into the slot's
        send buffer and the slot's own SEND is posted again."""
        if data is not None and length <= self.inline_size and len(data) != length:
            raise ValueError(inline_mismatch(data, length))    # (before a slot is taken)
        if _get_ident() != self._loop_ident:
            with self._lock:
                slot = self._take_locked(owner, None)
                return self._post_rw(slot, opcode, nsid, slba, nlb, addr, length, rkey, data,
                                     True)
        if self.dead_reason is not None:
            raise QueueDead(self.dead_reason)
        free = self._free
        if not free:
            raise self._full()
        # The reactor's path: _take, _post_rw, _count and _post in one frame (a Python call
        # costs more than any of their lines).
        slot = self.slots[free.pop()]
        gen = (slot.gen + 1) & GEN_MASK
        slot.gen = gen
        cid = slot.cid = gen << SLOT_BITS | slot.index
        slot.owner = owner
        slot.sent = False
        slot.raw = None
        slot.busy = True
        view = slot.view
        if data is not None and length <= self.inline_size:
            view[SQE_SIZE:SQE_SIZE + length] = data
            _rw_pack_into(view, 0, opcode, PSDT_SGL, cid, nsid, 0, 0, 0, length | _OFFSET,
                          slba, nlb, 0, 0, 0)       # pack_rw_into, inline
            slot.sge.length = SQE_SIZE + length
        else:
            _rw_pack_into(view, 0, opcode, PSDT_SGL, cid, nsid, 0, 0, addr,
                          length | rkey << 24 | _KEYED, slba, nlb, 0, 0, 0)
            slot.sge.length = SQE_SIZE
        stats = self.stats
        slot.seq = stats.submitted_loop + stats.submitted_other
        stats.submitted_loop += 1
        inflight = self.depth - len(free)
        if inflight > stats.max_inflight:
            stats.max_inflight = inflight
        try:
            self.qp.post_send(slot.wr)
        except Exception as exc:
            raise self._post_failed(slot, False, exc) from exc
        return cid

    def _post_rw(self, slot: Slot, opcode: int, nsid: int, slba: int, nlb: int, addr: int,
                 length: int, rkey: int, data: Any, locked: bool) -> int:
        cid = slot.cid
        view = slot.view
        if data is not None and length <= self.inline_size:
            view[SQE_SIZE:SQE_SIZE + length] = data
            pack_rw_into(view, opcode, cid, nsid, slba, nlb, 0, length | _OFFSET)
            return self._post(slot, SQE_SIZE + length, locked)
        pack_rw_into(view, opcode, cid, nsid, slba, nlb, addr, length | rkey << 24 | _KEYED)
        return self._post(slot, SQE_SIZE, locked)

    def submit(self, sqe: SQE, callback: Callback, *, inline: bytes | memoryview | None = None,
               timeout: float | None = None) -> int:
        """Send ``sqe`` (its cid is assigned here); ``callback(cqe, error)`` runs on the
        reactor thread when the command completes, or with the QueueDead when the queue
        dies first.  With ``inline``, the bytes travel in the capsule and the SGL is set to
        an offset descriptor.  Blocks while every slot is in use (except on the reactor
        thread, which frees them: there a full queue raises TimeoutError)."""
        if inline is not None and len(inline) > self.inline_size:
            raise ValueError(f"{len(inline)} bytes of in-capsule data exceed "
                             f"{self.inline_size}")

        def post(slot: Slot, locked: bool) -> int:
            sqe.cid = slot.cid
            view = slot.view
            length = SQE_SIZE
            if inline is not None:
                n = len(inline)
                sqe.sgl = OffsetSGL(0, n)
                view[SQE_SIZE:SQE_SIZE + n] = inline
                length += n
            sqe.pack_into(view)
            return self._post(slot, length, locked)
        return self._submit_with(_CallbackOwner(callback), post, timeout)

    def submit_raw(self, capsule: bytes, callback: Callback,
                   timeout: float | None = None) -> int:
        """Send ``capsule`` exactly as given (only bytes 2..3, the cid, are set), for tests
        and tools that must send malformed commands."""
        def post(slot: Slot, locked: bool) -> int:
            view = slot.view
            n = min(len(capsule), len(view))
            view[:n] = capsule[:n]
            if n >= 4:
                view[2:4] = slot.cid.to_bytes(2, "little")
            return self._post(slot, n, locked)
        return self._submit_with(_CallbackOwner(callback), post, timeout)

    def _submit_with(self, owner: Any, post: Callable[[Slot, bool], int],
                     timeout: float | None) -> int:
        if _get_ident() != self._loop_ident:
            with self._lock:
                return post(self._take_locked(owner, timeout), True)
        if self.dead_reason is not None:
            raise QueueDead(self.dead_reason)
        if not self._free:
            raise self._full()
        return post(self._take(self._free.pop(), owner), False)

    def _full(self) -> TimeoutError:
        # Only the reactor frees slots: waiting for one here would wait for itself.
        return TimeoutError(f"{self.name}: no free command slot (all {self.depth} in "
                            "flight, and the reactor thread cannot wait for one)")

    def _take_locked(self, owner: Any, timeout: float | None) -> Slot:
        """With the lock held (a submitter off the reactor): wait for a free slot."""
        while not self._free and self.dead_reason is None:
            self._waiters += 1
            try:
                if not self._space.wait(timeout):
                    raise TimeoutError(f"{self.name}: no free command slot")
            finally:
                self._waiters -= 1
        if self.dead_reason is not None:
            raise QueueDead(self.dead_reason)
        return self._take(self._free.pop(), owner)

    def _take(self, index: int, owner: Any) -> Slot:
        slot = self.slots[index]
        gen = (slot.gen + 1) & GEN_MASK
        slot.gen = gen
        slot.cid = gen << SLOT_BITS | index
        slot.owner = owner
        slot.sent = False
        slot.raw = None
        slot.busy = True
        return slot

    def _count(self, slot: Slot, locked: bool) -> None:
        stats = self.stats
        seq = stats.submitted_loop + stats.submitted_other
        slot.seq = seq
        if locked:
            stats.submitted_other += 1
        else:
            stats.submitted_loop += 1
        inflight = self.depth - len(self._free)
        if inflight > stats.max_inflight:
            stats.max_inflight = inflight

    def _post(self, slot: Slot, length: int, locked: bool) -> int:
        """Count the command and SEND its capsule (``length`` bytes of the slot's buffer)."""
        slot.sge.length = length
        self._count(slot, locked)
        try:
            self.post_send(slot.wr)
        except Exception as exc:
            raise self._post_failed(slot, locked, exc) from exc
        return slot.cid

    def _post_failed(self, slot: Slot, locked: bool, exc: Exception) -> Exception:
        """A SEND that could not be posted: the slot goes back.  On a QP that is no longer
        ready to send (the connection just ended; its completions, which fail this queue,
        are not handled yet) that is this queue's loss: a QueueDead (a ConnectionError), which the
        controller answers by holding the command and re-issuing it (on another path, or
        after the reconnect), as for a queue already known dead; never the command's own
        error, which a FUSE mount would turn into EIO."""
        self._free_slot(slot, locked)
        if self.closed or self.qp.state is not QPState.RTS:
            return QueueDead(f"{self.name}: connection lost: {exc}")
        return exc

    # -- completions (reactor thread) ---------------------------------------------------
    raw_completions = True

    def handle(self, wcs: list[WC]) -> int:
        return self.handle_raw([(wc.wr_id, wc.status, wc.byte_len) for wc in wcs])

    def handle_raw(self, wcs: list[RawWC]) -> int:
        """:meth:`Endpoint.handle` for a host queue, a batch at once: the response capsules
        are read first and their receives posted again in one ``post_recv``, then the
        completions are handled in order (a response, a SEND) in this frame.  A receive goes
        back before any slot of its batch is freed, so no new command can draw a response
        while fewer receives than before are posted."""
        views, wrs = self.recv_views, self._recv_wrs
        raws: list[RawCQE] = []
        again: list[RecvWR] = []
        for wid, status, length in wcs:
            if wid >> KIND_SHIFT == KIND_RECV and not status and length >= CQE_SIZE:
                index = wid & INDEX_MASK
                raws.append(_unpack_cqe(views[index]))
                again.append(wrs[index])
        if again and not self.closed:
            try:
                # (one, as at QD1: the provider's single-WR path, no list to walk)
                self.qp.post_recv(again if len(again) > 1 else again[0])
            except Exception as exc:  # noqa: BLE001  (as a failed repost would: this queue)
                self.on_fault(f"reposting {len(again)} receives failed: "
                              f"{type(exc).__name__}: {exc}")
                return 0
        slots = self.slots
        k = done = 0
        # Every command in flight answered in this one batch: the target now waits for
        # what its completions issue next.  The commands issued for the first half go out
        # before the second half is handled (qp.push), so the target starts on them while
        # this loop goes on: two batches in motion, not one turn each (a caller that keeps
        # 16 reads in flight through the library: 2x the rate, for the same CPU).
        half = len(raws) >> 1 \
            if len(raws) >= SPLIT_MIN and self.depth - len(self._free) <= len(raws) else -1
        for wid, status, length in wcs:
            if self.closed:
                break
            done += 1
            try:
                kind = wid >> KIND_SHIFT
                if status:
                    name = WcStatus(status).name \
                        if status in WcStatus._value2member_map_ else str(status)
                    self.fail(WorkCompletionError(f"work completion {name}", status),
                              expected=self.closed)
                elif kind == KIND_RECV and length < CQE_SIZE:
                    # a host that gets a short response capsule has lost the transfer
                    self.repost(wid & INDEX_MASK)
                    self.fail(f"malformed response capsule: {length} bytes, a CQE is "
                              f"{CQE_SIZE}")
                elif kind == KIND_RECV:
                    if k == half:
                        half = -1
                        self._push()
                    raw = raws[k]
                    k += 1
                    # _on_cqe's common case inline: the response of a command in flight
                    slot = slots[raw[3] & SLOT_MASK] if raw[3] & SLOT_MASK < self.depth \
                        else None
                    if slot is not None and slot.busy and slot.cid == raw[3] \
                            and slot.raw is None:
                        slot.raw = raw
                        if slot.sent:
                            self._complete(slot)
                    else:
                        self._on_cqe(raw)       # dropped, and said why
                elif kind == KIND_SEND:
                    slot = slots[wid & INDEX_MASK]
                    slot.sent = True
                    if slot.busy and slot.raw is not None:
                        self._complete(slot)
            except Exception as exc:
                self.completion_failed(wid, exc)
        return done

    def _push(self) -> None:
        """handle_raw's push half way: a failure fails this queue, and the batch's other
        completions are still handled (as the queue's commands are failed)."""
        try:
            self.qp.push()
        except Exception as exc:  # noqa: BLE001  (this queue's only)
            self.on_fault(f"sending what the batch issued failed: {type(exc).__name__}: {exc}")

    def on_completion(self, wc: WC) -> None:
        self.handle_raw([(wc.wr_id, wc.status, wc.byte_len)])

    def on_fault(self, reason: str) -> None:
        self.fail(reason, expected=self.closed)

    def _on_cqe(self, raw: RawCQE) -> None:
        """A response capsule's CQE (as the raw tuple): complete its slot, or drop it if no
        command of this queue is waiting for it."""
        cid = raw[3]
        index = cid & SLOT_MASK
        if index >= self.depth:
            log.warning("%s: response for unknown cid %#x dropped", self.name, cid)
            return
        slot = self.slots[index]
        if not slot.busy or slot.cid != cid or slot.raw is not None:
            log.warning("%s: stale or duplicate response for cid %#x dropped", self.name, cid)
            return
        slot.raw = raw
        if slot.sent:
            self._complete(slot)

    def _complete(self, slot: Slot) -> None:
        owner, raw = slot.owner, slot.raw
        stats = self.stats
        seq = slot.seq
        if seq < stats._last_seq:
            stats.out_of_order += 1
        else:
            stats._last_seq = seq
        stats.completed += 1
        if raw[4] & STATUS_BITS:  # type: ignore[index]  # (completed: it has its response)
            stats.errors += 1
        slot.busy = False
        slot.owner = None
        self._free.append(slot.index)
        if self._waiters:
            with self._space:
                self._space.notify()
        try:
            owner.complete(raw, None)
        except Exception:
            # A command's owner is its submitter's code: one that raises costs neither the
            # other completions of its batch nor this queue.
            log.exception("%s: completion of %r failed", self.name, owner)

    def _free_slot(self, slot: Slot, locked: bool = False) -> None:
        """Give the slot back; wake a waiting submitter only if there is one (``locked``:
        the caller holds the lock)."""
        slot.busy = False
        slot.owner = None
        self._free.append(slot.index)
        if self._waiters:
            if locked:
                self._space.notify()
            else:
                with self._space:
                    self._space.notify()

    def fail(self, reason: str | QueueDead, *, expected: bool = False) -> None:
        """The queue is dead: fail every outstanding command once (with ``reason``, made a
        :class:`QueueDead` if it is text), wake waiters."""
        error = reason if isinstance(reason, QueueDead) else QueueDead(reason)
        reason = str(error)
        with self._space:
            if self.dead_reason is None:
                self.dead_reason = reason
                self.dead_error = error
                log.log(logging.DEBUG if expected else logging.WARNING, "%s: %s", self.name,
                        reason)
            pending = [s for s in self.slots if s.busy]
            owners = []
            for slot in pending:
                owners.append(slot.owner)
                slot.busy = False
                slot.owner = None
                self._free.append(slot.index)
            self._space.notify_all()
        if owners:
            self._cut()
        for owner in owners:
            if owner is None:
                continue
            try:
                owner.complete(None, error)
            except Exception:
                log.exception("%s: completion of %r failed", self.name, owner)

    def _cut(self) -> None:
        """Before the owners of failed commands get their memory back: nothing more of
        this connection may land in it (an RDMA WRITE a slow or broken target sends late,
        into a buffer a multipath host has already given another path).  Disconnected,
        the QP leaves RTS, and the NIC drops what arrives after."""
        try:
            self.cmid.disconnect()
        except Exception as exc:  # noqa: BLE001  (gone already, say)
            log.debug("%s: disconnect on failure: %s", self.name, exc)

    @property
    def outstanding(self) -> int:
        return self.stats.inflight

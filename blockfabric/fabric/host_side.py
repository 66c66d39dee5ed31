"""The host's end of an NVMe-oF RDMA queue.

Each queue has ``depth`` command slots.  A slot owns a registered capsule buffer (64-byte SQE
plus room for in-capsule data) and a command identifier: the slot index in the low 12 bits
and a 4-bit generation above it (as the Linux host does), so a stale or forged CQE for a
reused slot is recognised and dropped.  A command completes when *both* its SEND has
completed and its response capsule has arrived (the Linux host's two references), so a
slot's buffer is never reused while the provider may still read it.

Submission may come from any thread (the FUSE loop, benchmark workers); completions are
serviced by the controller's reactor thread and reported through each command's callback.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from blockfabric.fabric.endpoint import (INDEX_MASK, KIND_RECV, KIND_SEND, KIND_SHIFT,
                                         Endpoint, wr_id)
from blockfabric.protocol import CQE, CQE_SIZE, SQE, SQE_SIZE, OffsetSGL, ProtocolError
from blockfabric.protocol.status import StatusCode
from blockfabric.rdma import (CONNECTION_ENDED, PD, WC, CMId, SendFlags, SendWR, WcStatus,
                              WrOpcode)

log = logging.getLogger(__name__)

SLOT_BITS = 12
GEN_MASK = 0xF

Callback = Callable[[CQE | None, str | None], None]


class Slot:
    __slots__ = ("index", "gen", "cid", "callback", "sent", "cqe", "busy", "seq")

    def __init__(self, index: int) -> None:
        self.index = index
        self.gen = 0
        self.cid = index
        self.callback: Callback | None = None
        self.sent = False
        self.cqe: CQE | None = None
        self.busy = False
        self.seq = 0            # submission order on this queue, to count overtakes


class QueueStats:
    """Counters a caller can read to see what the queue did."""

    __slots__ = ("submitted", "completed", "inflight", "max_inflight", "out_of_order",
                 "errors", "_last_seq")

    def __init__(self) -> None:
        self.submitted = self.completed = self.inflight = self.max_inflight = 0
        self.out_of_order = self.errors = 0
        self._last_seq = -1

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_")}


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
        self.slots = [Slot(i) for i in range(depth)]
        self._free = list(range(depth - 1, -1, -1))
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self.stats = QueueStats()
        self._next_seq = 0
        self.dead_reason: str | None = None
        self.on_cm_event = self._on_cm_event

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
    def submit(self, sqe: SQE, callback: Callback, *, inline: bytes | memoryview | None = None,
               timeout: float | None = None) -> int:
        """Send ``sqe`` (its cid is assigned here); ``callback(cqe, error)`` runs on the
        reactor thread when the command completes, or with an error string when the queue
        dies first.  With ``inline``, the bytes travel in the capsule and the SGL is set to
        an offset descriptor.  Blocks while every slot is in use."""
        if inline is not None and len(inline) > self.inline_size:
            raise ValueError(f"{len(inline)} bytes of in-capsule data exceed "
                             f"{self.inline_size}")
        with self._space:
            slot = self._take_slot(callback, timeout)
            sqe.cid = slot.cid
            view = self.send_pool.views[slot.index]
            length = SQE_SIZE
            if inline is not None:
                n = len(inline)
                sqe.sgl = OffsetSGL(0, n)
                view[SQE_SIZE:SQE_SIZE + n] = inline
                length += n
            sqe.pack_into(view)
            self._post(slot, length)
            return slot.cid

    def submit_raw(self, capsule: bytes, callback: Callback,
                   timeout: float | None = None) -> int:
        """Send ``capsule`` exactly as given (only bytes 2..3, the cid, are set), for tests
        and tools that must send malformed commands."""
        with self._space:
            slot = self._take_slot(callback, timeout)
            view = self.send_pool.views[slot.index]
            n = min(len(capsule), len(view))
            view[:n] = capsule[:n]
            if n >= 4:
                view[2:4] = slot.cid.to_bytes(2, "little")
            self._post(slot, n)
            return slot.cid

    def _take_slot(self, callback: Callback, timeout: float | None) -> Slot:
        """With the lock held: wait for a free slot and give it a fresh cid."""
        while not self._free and self.dead_reason is None:
            if not self._space.wait(timeout):
                raise TimeoutError(f"{self.name}: no free command slot")
        if self.dead_reason is not None:
            raise ConnectionError(self.dead_reason)
        slot = self.slots[self._free.pop()]
        slot.gen = (slot.gen + 1) & GEN_MASK
        slot.cid = slot.gen << SLOT_BITS | slot.index
        slot.callback = callback
        slot.sent = False
        slot.cqe = None
        slot.busy = True
        return slot

    def _post(self, slot: Slot, length: int) -> None:
        """With the lock held: count the command and SEND its capsule."""
        stats = self.stats
        stats.submitted += 1
        stats.inflight += 1
        if stats.inflight > stats.max_inflight:
            stats.max_inflight = stats.inflight
        slot.seq = self._next_seq
        self._next_seq += 1
        try:
            self.post_send(SendWR(wr_id(KIND_SEND, slot.index), WrOpcode.SEND,
                                  [self.send_pool.sge(slot.index, length)],
                                  SendFlags.SIGNALED))
        except Exception:
            self._free_slot(slot)
            raise

    # -- completions -----------------------------------------------------------------
    def on_completion(self, wc: WC) -> None:
        kind = wc.wr_id >> KIND_SHIFT
        index = wc.wr_id & INDEX_MASK
        if wc.status != WcStatus.SUCCESS:
            status = WcStatus(wc.status).name if wc.status in WcStatus._value2member_map_ \
                else str(wc.status)
            self.fail(f"work completion {status}", expected=self.closed)
            return
        if kind == KIND_RECV:
            self._on_response(index, wc.byte_len)
        elif kind == KIND_SEND:
            slot = self.slots[index]
            with self._lock:
                slot.sent = True
                done = slot.busy and slot.cqe is not None
            if done:
                self._complete(slot)

    def on_fault(self, reason: str) -> None:
        self.fail(reason, expected=self.closed)

    def _on_response(self, recv_index: int, length: int) -> None:
        view = self.recv_views[recv_index]
        try:
            cqe = CQE.unpack_from(view[:length])
        except ProtocolError as exc:
            self.repost(recv_index)
            self.fail(f"malformed response capsule: {exc}")
            return
        self.repost(recv_index)
        index = cqe.cid & ((1 << SLOT_BITS) - 1)
        if index >= self.depth:
            log.warning("%s: response for unknown cid %#x dropped", self.name, cqe.cid)
            return
        slot = self.slots[index]
        with self._lock:
            if not slot.busy or slot.cid != cqe.cid or slot.cqe is not None:
                log.warning("%s: stale or duplicate response for cid %#x dropped", self.name,
                            cqe.cid)
                return
            slot.cqe = cqe
            done = slot.sent
        if done:
            self._complete(slot)

    def _complete(self, slot: Slot) -> None:
        callback, cqe = slot.callback, slot.cqe
        stats = self.stats
        with self._space:
            seq = slot.seq
            if seq < stats._last_seq:
                stats.out_of_order += 1
            else:
                stats._last_seq = seq
            stats.completed += 1
            if cqe is not None and cqe.status != StatusCode.SUCCESS:
                stats.errors += 1
            self._free_slot(slot)
        if callback is not None:
            self._call(callback, cqe, None)

    def _call(self, callback: Callback, cqe: CQE | None, error: str | None) -> None:
        """A command's callback is its submitter's code: one that raises costs neither the
        other completions of its batch nor this queue."""
        try:
            callback(cqe, error)
        except Exception:
            log.exception("%s: completion callback %r failed", self.name, callback)

    def _free_slot(self, slot: Slot) -> None:
        """With the lock held."""
        slot.busy = False
        slot.callback = None
        self.stats.inflight -= 1
        self._free.append(slot.index)
        self._space.notify()

    def fail(self, reason: str, *, expected: bool = False) -> None:
        """The queue is dead: fail every outstanding command once, wake waiters."""
        with self._space:
            if self.dead_reason is None:
                self.dead_reason = reason
                log.log(logging.DEBUG if expected else logging.WARNING, "%s: %s", self.name,
                        reason)
            pending = [s for s in self.slots if s.busy]
            for slot in pending:
                slot.busy = False
            self._space.notify_all()
        for slot in pending:
            callback, slot.callback = slot.callback, None
            with self._space:
                self.stats.inflight -= 1
                self._free.append(slot.index)
            if callback is not None:
                self._call(callback, None, reason)

    @property
    def outstanding(self) -> int:
        return self.stats.inflight


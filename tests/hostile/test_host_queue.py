"""A hostile target against the host's end of a queue (blockfabric.fabric.host_side), over a
real soft-provider connection on loopback: the target side is a bare QP driven by the test,
so it can answer with responses a real target never sends.  What the host must do with
each: a response for a cid it never issued, for an earlier generation of a slot, or a second
one for the same command is dropped and the queue goes on; a response capsule too short to
be a CQE fails this queue only, and every command outstanding on it completes once, with the
error.  Every command completes exactly once, and the receives a batch consumes are posted
again (the queue keeps working for many times its depth)."""

from __future__ import annotations

import mmap
import struct
import threading
import time

import pytest

from blockfabric.errors import QueueDead, RdmaError, WorkCompletionError
from blockfabric.fabric.endpoint import KIND_RECV, KIND_SHIFT
from blockfabric.fabric.host_side import SLOT_BITS, SLOT_MASK, HostQueue
from blockfabric.fabric.reactor import Reactor
from blockfabric.rdma import SGE, Access, QPCap, RecvWR, SendFlags, SendWR, WcStatus, WrOpcode
from blockfabric.rdma.soft import SoftProvider

pytestmark = pytest.mark.needs_transport(
    "rdma", "the hostile target is a bare soft-provider QP driven by the test in this process")

DEPTH = 4
CQE = struct.Struct("<QHHHH")
SQE_SIZE = 64
SLOTS = 32                  # the target's capsule receives and response sends
READ = 0x02


class Owner:
    """A command's owner: records every ``complete`` call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.done = threading.Event()

    def complete(self, raw, error) -> None:
        self.calls.append((raw, error))
        self.done.set()


class Target:
    """The far end: a QP with posted capsule receives and a slab to send responses from."""

    def __init__(self, cmid) -> None:
        self.cmid = cmid
        self.pd = cmid.context.alloc_pd()
        self.cq = cmid.context.create_cq(4 * SLOTS)
        self.qp = cmid.create_qp(self.pd, self.cq, self.cq,
                                 QPCap(max_send_wr=SLOTS, max_recv_wr=SLOTS, max_send_sge=1,
                                       max_recv_sge=1))
        self.slab = mmap.mmap(-1, 2 * SLOTS * SQE_SIZE)
        self.mr = self.pd.reg_mr(self.slab, Access.LOCAL_WRITE)
        self.qp.post_recv([RecvWR(i, [self._sge(i, SQE_SIZE)]) for i in range(SLOTS)])
        self.sent = 0

    def _sge(self, i: int, length: int) -> SGE:
        return SGE(self.mr.addr + i * SQE_SIZE, length, self.mr.lkey)

    def command(self, timeout: float = 5.0) -> int:
        """The cid of the next command capsule that arrives (its receive is posted again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for wc in self.cq.poll(1):
                if wc.wr_id < SLOTS:        # a receive
                    assert wc.status == 0 and wc.byte_len >= SQE_SIZE, wc
                    cid = struct.unpack_from("<H", self.mr.buf, wc.wr_id * SQE_SIZE + 2)[0]
                    self.qp.post_recv([RecvWR(wc.wr_id, [self._sge(wc.wr_id, SQE_SIZE)])])
                    return cid
            time.sleep(0.001)
        raise AssertionError("no command capsule arrived")

    def respond(self, cid: int, status: int = 0, length: int = CQE.size) -> None:
        """SEND a response capsule for ``cid`` (only ``length`` bytes of it)."""
        i = SLOTS + self.sent % SLOTS
        self.sent += 1
        CQE.pack_into(self.mr.buf, i * SQE_SIZE, 0, 0, 1, cid, status << 1)
        self.qp.post_send([SendWR(1000 + i, WrOpcode.SEND, [self._sge(i, length)],
                                  SendFlags.SIGNALED)])

    def close(self) -> None:
        for thing in (self.cmid, self.mr, self.cq, self.pd):
            try:
                thing.close()
            except Exception:  # noqa: BLE001  (teardown goes on)
                pass


@pytest.fixture(params=["thread", "poll"])
def link(request):
    """(host queue, target) connected over loopback; the queue serviced by a reactor.  The
    param: the progress mode, or (mode, queue depth) for another depth than DEPTH."""
    mode, depth = request.param if isinstance(request.param, tuple) else (request.param,
                                                                           DEPTH)
    provider = SoftProvider(progress=mode)          # the host's
    far = SoftProvider(progress=mode)               # the target's: its own engine
    listener = far.listen("127.0.0.1", 0)
    reactor = Reactor("hostile-target-test")
    reactor.start()
    box: dict = {}

    def connect() -> None:
        try:
            cmid = provider.create_id()
            cmid.resolve("127.0.0.1", listener.local_address[1], timeout=5)
            queue = HostQueue(cmid, cmid.context.alloc_pd(), qid=1, depth=depth,
                              inline_size=0)
            queue.post_all_receives()
            cmid.connect(b"", timeout=5)
            queue.attach(reactor)
            box["queue"] = queue
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    cmid = listener.get_request(5)
    assert cmid is not None, "the host did not connect"
    target = Target(cmid)
    cmid.accept(b"")
    thread.join(5)
    assert "error" not in box, box.get("error")
    queue = box["queue"]
    yield queue, target
    queue.close()
    target.close()
    reactor.stop()
    reactor.join(5)
    reactor.close()
    listener.close()
    for prov in (provider, far):
        if hasattr(prov, "close"):
            prov.close()


def submit(queue: HostQueue, owner: Owner) -> None:
    """A Read submitted from the queue's reactor thread (the FUSE server's path)."""
    queue.reactor.call_sync(lambda: queue.submit_rw(owner, READ, 1, 0, 0, 0x1000, 4096, 0x77))


def settle(queue: HostQueue) -> None:
    """Wait until the reactor has handled what has arrived so far (two round trips)."""
    for _ in range(2):
        queue.reactor.call_sync(lambda: None)
    time.sleep(0.05)
    queue.reactor.call_sync(lambda: None)


def test_forged_stale_and_duplicate_responses_are_dropped_and_the_queue_goes_on(link, caplog):
    queue, target = link
    owners = []
    for round_ in range(3 * DEPTH):      # many times the depth: receives are posted again
        owner = Owner()
        submit(queue, owner)
        cid = target.command()
        index, gen = cid & SLOT_MASK, cid >> SLOT_BITS
        # forged first: an index past the depth, then this slot's previous generation
        target.respond((DEPTH + 1) | gen << SLOT_BITS)
        target.respond(index | ((gen - 1) & 0xF) << SLOT_BITS)
        target.respond(cid, status=0x2 if round_ == 1 else 0)
        target.respond(cid)                      # and the real one twice
        assert owner.done.wait(5), f"command {cid:#x} never completed"
        owners.append((owner, cid))
        settle(queue)
    assert queue.dead_reason is None
    for i, (owner, cid) in enumerate(owners):
        assert len(owner.calls) == 1, (cid, owner.calls)
        raw, error = owner.calls[0]
        assert error is None and raw[3] == cid
        assert (raw[4] >> 1) == (0x2 if i == 1 else 0)
    assert queue.stats.completed == 3 * DEPTH and queue.stats.errors == 1
    assert queue.outstanding == 0
    text = caplog.text
    assert "response for unknown cid" in text and "stale or duplicate response" in text


def test_a_short_response_capsule_fails_only_this_queue_and_each_command_once(link):
    queue, target = link
    owners = [Owner() for _ in range(DEPTH)]
    for owner in owners:
        submit(queue, owner)
    cids = [target.command() for _ in owners]
    target.respond(cids[0])                  # one completes normally
    assert owners[0].done.wait(5)
    target.respond(cids[1], length=CQE.size - 4)
    for owner in owners[1:]:
        assert owner.done.wait(5), "an outstanding command was not failed"
    target.respond(cids[2])                  # too late: the queue is dead
    settle(queue)
    assert "malformed response capsule" in (queue.dead_reason or "")
    assert [len(o.calls) for o in owners] == [1] * DEPTH
    assert owners[0].calls[0][1] is None
    assert all(o.calls[0][0] is None and o.calls[0][1] for o in owners[1:])
    # the one error every owner gets is typed: a QueueDead (a ConnectionError) saying why
    assert all(type(o.calls[0][1]) is QueueDead for o in owners[1:])
    assert "malformed response capsule" in str(owners[1].calls[0][1])
    with pytest.raises(ConnectionError):
        submit(queue, Owner())


def test_nothing_lands_in_a_failed_commands_memory_after_its_owner_has_it_back(link):
    """Once the queue fails and a command's owner has its memory back (a multipath host
    re-issues it on another path at once), nothing more of this connection may land in
    it: the queue leaves the connection before it tells the owners, so an RDMA WRITE the
    target sends late is refused, not placed."""
    queue, target = link
    memory = bytearray(b"o" * 4096)
    mr = queue.pd.reg_mr(memory, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    owners = [Owner(), Owner()]
    for owner in owners:
        queue.reactor.call_sync(lambda o=owner: queue.submit_rw(o, READ, 1, 0, 0, mr.addr,
                                                               4096, mr.rkey))
    cids = [target.command() for _ in owners]
    target.respond(cids[0], length=CQE.size - 4)       # malformed: the queue fails
    assert all(o.done.wait(5) for o in owners)
    assert all(o.calls[0][1] for o in owners)
    target.slab[:4096] = b"L" * 4096                  # a late read answer for the host
    try:
        target.qp.post_send([SendWR(7, WrOpcode.RDMA_WRITE, [SGE(target.mr.addr, 4096,
                                                                  target.mr.lkey)],
                                    SendFlags.SIGNALED, remote_addr=mr.addr, rkey=mr.rkey)])
    except RdmaError:
        pass                                          # refused at once: as good
    time.sleep(0.3)
    assert bytes(memory) == b"o" * 4096, "a late RDMA WRITE landed after the owners heard"
    mr.close()


def test_a_failed_work_completion_fails_the_queue_with_its_status(link):
    """An RDMA WRITE under a key the host never gave: the host's QP NAKs it and goes to ERR,
    its posted receives complete flushed.  Every outstanding command gets the one typed
    error: a WorkCompletionError (a QueueDead and an RdmaError) carrying that status."""
    queue, target = link
    owners = [Owner() for _ in range(2)]
    for owner in owners:
        submit(queue, owner)
        target.command()
    target.qp.post_send([SendWR(2000, WrOpcode.RDMA_WRITE, [target._sge(SLOTS, 16)],
                                SendFlags.SIGNALED, remote_addr=0x1000, rkey=0xDEAD)])
    for owner in owners:
        assert owner.done.wait(5), "an outstanding command was not failed"
    settle(queue)
    errors = [o.calls[0][1] for o in owners]
    assert [len(o.calls) for o in owners] == [1, 1] and all(o.calls[0][0] is None
                                                            for o in owners)
    assert all(isinstance(e, WorkCompletionError) for e in errors), errors
    assert all(isinstance(e, RdmaError) and isinstance(e, QueueDead) for e in errors)
    assert errors[0].wc_status == WcStatus.WR_FLUSH_ERR, errors[0].wc_status
    assert "WR_FLUSH_ERR" in str(errors[0]) and queue.dead_error is errors[0]
    with pytest.raises(QueueDead):
        submit(queue, Owner())


@pytest.mark.parametrize("link", [("thread", 8), ("poll", 8)], indirect=True)
@pytest.mark.parametrize("answered", [8, 4])
def test_a_batch_answering_every_command_pushes_the_next_ones_half_way(link, answered):
    """A caller that issues the next read from each completion (the bench, any library user
    at a fixed depth), 8 reads in flight: a batch that answers all 8 pushes the reads its
    first 4 completions issued before it handles the other 4, so the two ends work at once;
    a batch of 4 that leaves 4 in flight pushes nothing.  (Where the engine thread splits
    the batch (thread progress), each batch is held to the same rule.)"""
    queue, target = link
    depth = queue.depth
    pushed: list[int] = []
    completed: list[int] = []
    batches: list[tuple[int, int]] = []             # (answers, commands in flight)
    real_push, real_handle = queue.qp.push, queue.handle_raw
    queue.qp.push = lambda: (pushed.append(len(completed)), real_push())

    def handle_raw(wcs):
        answers = sum(1 for wid, status, length in wcs
                      if wid >> KIND_SHIFT == KIND_RECV and not status and length >= CQE.size)
        batches.append((answers, depth - len(queue._free)))
        return real_handle(wcs)
    queue.handle_raw = handle_raw

    class Reissuer(Owner):
        def complete(self, raw, error) -> None:
            completed.append(raw[3])
            super().complete(raw, error)
            queue.submit_rw(Owner(), READ, 1, 0, 0, 0x1000, 4096, 0x77)    # (reactor)

    owners = [Reissuer() for _ in range(depth)]
    for owner in owners:
        submit(queue, owner)
    cids = [target.command() for _ in owners]
    # the answers in one post: one frame train
    target.qp.post_send([_response(target, cid) for cid in cids[:answered]])
    for owner in owners[:answered]:
        assert owner.done.wait(5)
    settle(queue)
    assert len(completed) == answered
    expected, before = [], 0
    for answers, in_flight in batches:
        if answers >= 4 and in_flight <= answers:
            expected.append(before + answers // 2)
        before += answers
    assert pushed == expected, (pushed, batches)
    if link_mode(queue) == "poll":              # one batch, as it came: the rule was tested
        assert [a for a, _ in batches if a] == [answered], batches
        assert pushed == ([4] if answered == depth else []), pushed
    assert sorted(target.command() for _ in range(answered))    # the reads reissued came


def link_mode(queue: HostQueue) -> str:
    return "poll" if queue.cmid.context.poll_mode else "thread"


def _response(target: Target, cid: int) -> SendWR:
    i = SLOTS + target.sent % SLOTS
    target.sent += 1
    CQE.pack_into(target.mr.buf, i * SQE_SIZE, 0, 0, 1, cid, 0)
    return SendWR(1000 + i, WrOpcode.SEND, [target._sge(i, CQE.size)], SendFlags.SIGNALED)

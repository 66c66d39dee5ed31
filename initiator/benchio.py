"""One ``blockfabric bench`` job: ``iodepth`` issue slots driven by their completions.

Each job keeps ``iodepth`` commands in flight without a thread per command: a job owns
``iodepth`` issue slots, and each completion callback, which runs on the controller's
reactor thread, records the latency and submits the slot's next command.  All of a job's
state is touched on that one thread only; the main thread (:class:`~.bench.Bench`) just
reads counters.  This is the benchmark's per-I/O path: the common completion is accounted
inline, with no call.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import resource
import threading
import time
from typing import Any, Callable, Iterator

from blockfabric.errors import BlockfabricError
from blockfabric.fabric.buffers import BufferPool
from blockfabric.initiator.benchopts import BenchOptions
from blockfabric.initiator.benchreport import DirStats, JobResult
from blockfabric.initiator.benchverify import _crc32c, check_block, fill_block
from blockfabric.initiator.host import (HOST_ACCESS, Controller, HostNamespace, IoCommand,
                                        NvmeError)
from blockfabric.protocol import IOOpcode

_READ, _WRITE = IOOpcode.READ.value, IOOpcode.WRITE.value


class Slot:
    """One of a job's ``iodepth`` issue contexts, pinned to one I/O queue: the ``lane``-th
    of the controller's (whichever queue has that place after a reconnect).  It owns a piece of the
    job's registered memory, where its reads land and its writes come from (no copy), and
    the one :class:`IoCommand` it issues again and again (the parent of that command)."""

    __slots__ = ("job", "index", "lane", "read", "offset", "t0", "t1", "expect", "buf",
                 "addr", "cmd")

    def __init__(self, job: Job, index: int, lane: int, buf: memoryview, addr: int) -> None:
        self.job = job
        self.index = index
        self.lane = lane
        self.read = True
        self.offset = 0
        self.t0 = self.t1 = 0
        self.expect: tuple[int, int] | None = None
        self.buf = buf          # the slot's data, in the job's registered memory
        self.addr = addr
        self.cmd = IoCommand(job.ctrl, self)

    def io_done(self, _cmd: IoCommand, error: BaseException | None) -> None:
        self.job._done(self, error)


class Job:
    """A fio job: a pattern over a region of one namespace, ``iodepth`` commands in flight.

    Runs in two phases when it writes with --verify: the workload, then a read-back of every
    block it wrote (not counted in the results, as the point is the workload's numbers).
    """

    def __init__(self, index: int, opts: BenchOptions, ctrl: Controller, ns: HostNamespace,
                 start: int, length: int, queues: list[Any]) -> None:
        self.index = index
        self.opts = opts
        self.ctrl = ctrl
        self.ns = ns
        self.start = start
        self.nblocks = length // opts.bs
        self.seed = opts.seed * 1_000_003 + index
        self.rng = random.Random(self.seed)
        self.pattern = self.rng.randbytes(opts.bs + 4096)
        # The slots' data: registered with the controller, so that reads land there and
        # writes go from there by RDMA (or in the capsule): no arena block, no copy.
        stride = -(-opts.bs // 4096) * 4096
        assert ctrl.pd is not None
        self.mem = BufferPool(ctrl.pd, opts.iodepth, stride, HOST_ACCESS)
        self.rkey = self.mem.rkey
        lanes = [ctrl.io_queues.index(q) for q in queues]
        self.slots = [Slot(self, k, lanes[k % len(lanes)], self.mem.views[k][:opts.bs],
                           self.mem.addrs[k])
                      for k in range(opts.iodepth)]
        for slot in self.slots:             # what never changes from one I/O to the next
            cmd = slot.cmd
            cmd.nsid = ns.nsid
            cmd.nlb = opts.bs // ns.block_size - 1
            cmd.addr = slot.addr
            cmd.length = opts.bs
            cmd.rkey = self.rkey
            if opts.writes and not opts.verify:
                slot.buf[:] = self.pattern[:opts.bs]    # what every write sends
        self.queues = {q.qid for q in queues[:opts.iodepth]}
        self.stats = {"read": DirStats(), "write": DirStats()}
        self.crc = _crc32c() if opts.verify else None
        self.written: dict[int, tuple[int, int]] = {}
        self.busy: set[int] = set()
        self.numberio = 0
        self.verified = 0
        self.inflight = self.max_inflight = self.completions = 0
        self.errors: list[str] = []
        self.error_kind = 0
        self.stopping = False
        self.measuring = opts.ramp_time <= 0
        self.t_start = self.t_end = 0
        self.finished = threading.Event()
        self._next: Callable[[], tuple[bool, int] | None] = self._workload()
        self._verifying = False

    # -- what to do next ---------------------------------------------------------------
    def _workload(self) -> Callable[[], tuple[bool, int] | None]:
        opts, bs, n = self.opts, self.opts.bs, self.nblocks
        rng = self.rng
        reads = {"read": 100, "randread": 100, "write": 0, "randwrite": 0}.get(
            opts.rw, opts.rwmixread)
        if opts.time_based:
            if opts.random:
                # uniform over [0, n) as int(random() * n), all in C (randrange is two
                # Python calls per I/O; n is far below 2**53, so no bias that shows)
                blocks: Iterator[int] = map(int, map(float(n).__mul__,
                                                     iter(rng.random, -1.0)))
            else:
                blocks = (i % n for i in itertools.count())
        else:
            order = list(range(n))
            if opts.random:
                rng.shuffle(order)
            blocks = iter(order)

        def next_io() -> tuple[bool, int] | None:
            block = next(blocks, None)
            if block is None:
                return None
            is_read = reads == 100 or (reads > 0 and rng.random() * 100 < reads)
            offset = self.start + block * bs
            while offset in self.busy:   # never two commands on one block when verifying
                block = (block + 1) % n
                offset = self.start + block * bs
            return is_read, offset
        return next_io

    def _readback(self) -> Callable[[], tuple[bool, int] | None]:
        pending = iter(sorted(self.written))

        def next_io() -> tuple[bool, int] | None:
            offset = next(pending, None)
            return None if offset is None else (True, offset)
        return next_io

    # -- running (reactor thread only) -----------------------------------------------------
    def begin(self) -> None:
        self.t_start = time.monotonic_ns()
        for slot in self.slots:
            self._issue(slot)
        self._maybe_finish()

    def begin_measure(self) -> None:
        """End of ramp_time: forget what was counted so far."""
        self.stats = {"read": DirStats(), "write": DirStats()}
        self.t_start = time.monotonic_ns()
        self.measuring = True

    @property
    def held(self) -> int:
        """Commands lost with a queue and held (re-issued) by the controller."""
        return sum(slot.cmd.held for slot in self.slots)

    def close(self) -> None:
        """Release the slots' registered memory (before the controller goes)."""
        for slot in self.slots:
            slot.buf.release()
        self.mem.close()

    def _issue(self, slot: Slot) -> None:
        if self.stopping:
            return
        nxt = self._next()
        if nxt is None:
            return
        is_read, offset = nxt
        bs = self.opts.bs
        slot.read, slot.offset, slot.expect = is_read, offset, None
        data = None
        if self.crc is not None:
            if is_read:
                slot.expect = self.written.get(offset)
            else:
                self.numberio += 1
                at = (self.numberio * 64) % 4096
                slot.buf[:] = self.pattern[at:at + bs]
                fill_block(self.crc, slot.buf, offset, self.seed, self.numberio)
                slot.expect = (self.seed, self.numberio)
            self.busy.add(offset)
        if not is_read:
            data = slot.buf
        self.inflight += 1
        if self.inflight > self.max_inflight:
            self.max_inflight = self.inflight
        live = self.ctrl.io_queues         # a new list after a reconnect
        cmd = slot.cmd
        cmd.opcode = _READ if is_read else _WRITE
        cmd.slba = offset // self.ns.block_size
        cmd.data = data
        slot.t1 = 0
        slot.t0 = time.monotonic_ns()
        try:
            # held by the controller (and issued again) if the queue is lost or gone
            self.ctrl.issue(cmd, live[slot.lane % len(live)] if live else None)
        except (BlockfabricError, TimeoutError, ValueError) as exc:
            self.inflight -= 1
            self.busy.discard(offset)
            self._fail(errno.EIO, f"{self._what(slot)}: not submitted: {exc}")
            return
        slot.t1 = time.monotonic_ns()

    def _done(self, slot: Slot, error: BaseException | None) -> None:
        now = time.monotonic_ns()
        self.completions += 1
        try:
            self.inflight -= 1
            self.busy.discard(slot.offset)
            if error is None:
                if self.crc is None and self.measuring and not self._verifying:
                    # _account and DirStats.record, inline: the common case costs no call
                    t1 = slot.t1 or slot.t0
                    st = self.stats["read" if slot.read else "write"]
                    st.ios += 1
                    st.bytes += self.opts.bs
                    st.slats.append(t1 - slot.t0)
                    st.clats.append(now - t1)
                else:
                    self._account(slot, now)
                self._issue(slot)
            elif isinstance(error, NvmeError):
                status = error.status
                name = getattr(status, "name", hex(int(status)))
                self._fail(errno.EIO, f"{self._what(slot)}: {name} ({int(status):#05x})")
            else:
                self._fail(errno.EIO, f"{self._what(slot)}: {error}")
        except Exception as exc:  # noqa: BLE001 - never let the reactor thread die
            self._fail(errno.EIO, f"{self._what(slot)}: {type(exc).__name__}: {exc}")
        if not self.inflight:
            self._maybe_finish()

    def _account(self, slot: Slot, now: int) -> None:
        if slot.read and self.crc is not None and (slot.expect is not None
                                                   or not self.opts.writes):
            # straight from where the target wrote it
            problem = check_block(self.crc, slot.buf, slot.offset, slot.expect)
            if problem is not None:
                self._fail(errno.EILSEQ, f"verify: {self._what(slot)}: {problem}")
                return
            self.verified += 1
        if not slot.read and slot.expect is not None:
            self.written[slot.offset] = slot.expect
        if self.measuring and not self._verifying:
            t1 = slot.t1 or slot.t0
            self.stats["read" if slot.read else "write"].record(
                self.opts.bs, t1 - slot.t0, now - t1)

    def _what(self, slot: Slot) -> str:
        kind = "read" if slot.read else "write"
        return (f"job {self.index}: {kind} of {self.opts.bs} bytes at offset "
                f"{slot.offset:#x} (nsid {self.ns.nsid})")

    def _fail(self, kind: int, message: str) -> None:
        if not self.errors:
            self.error_kind = kind
        self.errors.append(message)
        self.stopping = True

    def _maybe_finish(self) -> None:
        if self.inflight or self.finished.is_set():
            return
        if not self._verifying:
            self.t_end = time.monotonic_ns()
            if self.crc is not None and self.written and not self.errors:
                self._verifying = True
                self.stopping = False
                self._next = self._readback()
                for slot in self.slots:
                    self._issue(slot)
                if self.inflight:
                    return
        self.finished.set()

    def stop(self) -> None:
        """Stop the workload phase (a verify read-back still runs)."""
        if not self._verifying:
            self.stopping = True
            self._maybe_finish()

    @property
    def runtime_ns(self) -> int:
        end = self.t_end or time.monotonic_ns()
        return max(0, end - self.t_start) if self.t_start else 0

    def result(self, queue_stats: dict[int, dict[str, int]]) -> JobResult:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        wall, mono = time.time(), time.monotonic_ns()
        end = self.t_end or mono
        return JobResult(
            index=self.index, pid=os.getpid(), stats=self.stats, runtime_ns=self.runtime_ns,
            error_kind=self.error_kind, errors=list(self.errors),
            max_inflight=self.max_inflight, verified=self.verified, held=self.held,
            queues=set(self.queues),
            queue_max_inflight={q: queue_stats[q]["max_inflight"] for q in self.queues
                                if q in queue_stats},
            cpu=(usage.ru_utime, usage.ru_stime),
            window=(wall - (mono - self.t_start) / 1e9 if self.t_start else 0.0,
                    wall - (mono - end) / 1e9))

"""``blockfabric bench``: fio-style load driven through the host library, with no FUSE.

It measures the NVMe-oF path alone, so that a number taken through the FUSE mount (with the
fio job files in benchmarks/fio/) can be compared with what the fabric itself delivers.

Each job keeps ``iodepth`` commands in flight without a thread per command: a job owns
``iodepth`` issue slots, and each completion callback, which runs on the controller's
reactor thread, records the latency and submits the slot's next command.  All of a job's
state is touched on that one thread only; the main thread just reads counters.
"""

from __future__ import annotations

import argparse
import array
import errno
import itertools
import json
import math
import operator
import os
import random
import re
import resource
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from blockfabric import __version__
from blockfabric.errors import BlockfabricError
from blockfabric.fabric.buffers import BufferPool
from blockfabric.initiator.host import (HOST_ACCESS, Controller, HostNamespace, IoCommand,
                                        NvmeError)
from blockfabric.initiator.multipath import format_path
from blockfabric.protocol import IOOpcode

PATTERNS = ("read", "write", "randread", "randwrite", "randrw")
#: fio's default clat percentile list.
PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0,
               99.5, 99.9, 99.95, 99.99)
DRAIN_TIMEOUT = 30.0
_READ, _WRITE = IOOpcode.READ.value, IOOpcode.WRITE.value

_FIO_SIZE = re.compile(r"(?P<n>[0-9]+)\s*(?P<unit>[kmgtp]?)(?:i?b)?", re.IGNORECASE)
_UNIT_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


class BenchError(BlockfabricError):
    """The benchmark cannot run as asked (bad size, alignment, capacity)."""


def parse_fio_size(text: str | int) -> int:
    """A size as fio reads it with its default kb_base=1024: ``4k``, ``128K``, ``1m``,
    ``1MiB``, ``2g`` or a plain byte count.  fio, not the config files, sets the syntax here,
    because these flags are meant to be pasted from fio command lines."""
    if isinstance(text, int):
        return text
    match = _FIO_SIZE.fullmatch(text.strip())
    if match is None:
        raise BenchError(f"size {text!r}: expected a number with an optional k/m/g/t suffix "
                         "(4k, 128k, 1m)")
    return int(match["n"]) << _UNIT_SHIFT[match["unit"].lower()]


# --------------------------------------------------------------------------- options

@dataclass
class BenchOptions:
    """One run's workload, with fio's option names."""

    rw: str = "randread"
    bs: int = 4096
    iodepth: int = 16
    numjobs: int = 1
    size: int | None = None          # None: from offset to the end of the namespace
    offset: int = 0
    runtime: float = 10.0            # seconds; 0 with time_based off: no time limit
    time_based: bool = True
    ramp_time: float = 0.0
    rwmixread: int = 50
    verify: str | None = None
    nsid: int | None = None          # None: the first active namespace
    seed: int = 1
    name: str | None = None
    eta: str = "auto"                # auto (when stderr is a TTY), always, never
    controllers: str = "shared"      # shared: one controller for all jobs; per-job
    group_reporting: bool = False
    #: fio's --thread: the jobs are threads of one process; else (numjobs > 1) one process
    #: per job, each with its own controller (benchjobs.py)
    thread: bool = False
    cpus: frozenset[int] | None = None   # --cpus: pin the process(es) there

    @property
    def random(self) -> bool:
        return self.rw.startswith("rand")

    @property
    def writes(self) -> bool:
        return self.rw in ("write", "randwrite", "randrw")

    @property
    def jobname(self) -> str:
        return self.name or f"{self.rw}-{_short_size(self.bs)}-qd{self.iodepth}"


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        rw=args.rw, bs=parse_fio_size(args.bs), iodepth=args.iodepth, numjobs=args.numjobs,
        size=None if args.size is None else parse_fio_size(args.size),
        offset=parse_fio_size(args.offset), runtime=args.runtime, time_based=args.time_based,
        ramp_time=args.ramp_time, rwmixread=args.rwmixread, verify=args.verify,
        nsid=args.nsid, seed=args.seed, name=args.name, eta=args.eta,
        controllers=args.controllers, group_reporting=args.group_reporting,
        thread=args.thread, cpus=args.cpus)


# --------------------------------------------------------------------------- verify blocks

VERIFY_MAGIC = 0x31564642  # "BFV1" little-endian
_VERIFY_HEADER = struct.Struct("<IIQQQII")


@dataclass(frozen=True, slots=True)
class VerifyHeader:
    """The 40 bytes that start every block written with ``--verify crc32c``, as fio's
    verify header does: enough to tell that a block is the one written at this offset, by
    which job and which write, and intact.  The CRC-32C covers the whole block except its
    own field (bytes 32..35)."""

    magic: int       # @0 u32 VERIFY_MAGIC
    length: int      # @4 u32 block length in bytes
    offset: int      # @8 u64 byte offset in the namespace the block was written to
    seed: int        # @16 u64 the writing job's seed
    numberio: int    # @24 u64 the job's write sequence number
    crc32c: int = 0  # @32 u32 CRC-32C of bytes 0..31 and 36..length-1
    reserved: int = 0  # @36 u32 zero

    SIZE = 40
    CRC_AT = 32

    def pack_into(self, buf: Any) -> None:
        _VERIFY_HEADER.pack_into(buf, 0, self.magic, self.length, self.offset, self.seed,
                                 self.numberio, self.crc32c, self.reserved)

    @classmethod
    def unpack_from(cls, buf: Any) -> VerifyHeader:
        return cls(*_VERIFY_HEADER.unpack_from(buf, 0))


def _crc32c() -> Callable[..., int]:
    """The crc32c package's CRC-32C (hardware-assisted), else a slow pure-Python one, so
    that --verify still works, only slower, where the package is not installed."""
    try:
        import crc32c
    except ModuleNotFoundError:
        return crc32c_py
    return crc32c.crc32c


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1   # Castagnoli, reflected
        table.append(n)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c_py(data: Any, value: int = 0) -> int:
    """CRC-32C (RFC 3720), continuing from ``value`` like ``crc32c.crc32c``."""
    crc = value ^ 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def block_crc(crc: Callable[..., int], view: memoryview) -> int:
    at = VerifyHeader.CRC_AT
    return crc(view[at + 4:], crc(view[:at]))


def fill_block(crc: Callable[..., int], buf: bytearray | memoryview, offset: int, seed: int,
               numberio: int) -> None:
    """Stamp the header into ``buf`` (already holding the data pattern) and seal it."""
    view = memoryview(buf)
    VerifyHeader(VERIFY_MAGIC, len(buf), offset, seed, numberio).pack_into(view)
    struct.pack_into("<I", view, VerifyHeader.CRC_AT, block_crc(crc, view))


def check_block(crc: Callable[..., int], data: bytes | memoryview, offset: int,
                expect: tuple[int, int] | None) -> str | None:
    """Why ``data`` read at ``offset`` is not the block that belongs there, or None.
    ``expect`` is (seed, numberio) of the last write this run made there, if any."""
    if len(data) < VerifyHeader.SIZE:
        return f"short block of {len(data)} bytes"
    hdr = VerifyHeader.unpack_from(data)
    if hdr.magic != VERIFY_MAGIC:
        return (f"bad magic {hdr.magic:#010x}, wanted {VERIFY_MAGIC:#010x} (was this block "
                f"written with --verify crc32c?)")
    if hdr.length != len(data):
        return f"header says {hdr.length} bytes, read {len(data)}"
    if hdr.offset != offset:
        return f"block belongs at offset {hdr.offset:#x}"
    actual = block_crc(crc, memoryview(data))
    if actual != hdr.crc32c:
        return f"bad crc32c: header has {hdr.crc32c:#010x}, data gives {actual:#010x}"
    if expect is not None and (hdr.seed, hdr.numberio) != expect:
        return (f"stale block: write {hdr.numberio} of seed {hdr.seed}, wanted write "
                f"{expect[1]} of seed {expect[0]}")
    return None


# --------------------------------------------------------------------------- statistics

class LatStat:
    """min/max/mean/stddev of latencies in ns (fio's slat/clat/lat), from the values kept."""

    __slots__ = ("n", "min", "max", "sum", "sumsq")

    def __init__(self, values: Iterable[int] = ()) -> None:
        self.n = self.min = self.max = self.sum = self.sumsq = 0
        for ns in values:
            if self.n == 0 or ns < self.min:
                self.min = ns
            if ns > self.max:
                self.max = ns
            self.n += 1
            self.sum += ns
            self.sumsq += ns * ns

    def as_fio(self) -> dict[str, Any]:
        mean = self.sum / self.n if self.n else 0.0
        var = self.sumsq / self.n - mean * mean if self.n > 1 else 0.0
        return {"min": self.min, "max": self.max, "mean": mean,
                "stddev": math.sqrt(max(0.0, var)), "N": self.n}


class DirStats:
    """One direction (read or write) of one job.  Every slat and clat is kept (two array
    appends per I/O, nothing else on the completion path); the summaries and exact
    percentiles are worked out when the report is made."""

    __slots__ = ("ios", "bytes", "slats", "clats")

    def __init__(self) -> None:
        self.ios = self.bytes = 0
        self.slats = array.array("Q")
        self.clats = array.array("Q")

    def record(self, nbytes: int, slat: int, clat: int) -> None:
        self.ios += 1
        self.bytes += nbytes
        self.slats.append(slat)
        self.clats.append(clat)

    @classmethod
    def merge(cls, parts: list[DirStats]) -> DirStats:
        out = cls()
        for p in parts:
            out.ios += p.ios
            out.bytes += p.bytes
            out.slats.extend(p.slats)
            out.clats.extend(p.clats)
        return out

    def percentiles(self) -> dict[str, int]:
        """fio's keys ("99.900000"), nearest-rank values over every completion."""
        ordered = sorted(self.clats)
        if not ordered:
            return {f"{p:.6f}": 0 for p in PERCENTILES}
        n = len(ordered)
        rank = {p: math.ceil(round(p * n / 100, 9)) for p in PERCENTILES}  # 1-based
        return {f"{p:.6f}": ordered[min(n, max(1, r)) - 1] for p, r in rank.items()}

    def as_fio(self, runtime_ns: int) -> dict[str, Any]:
        secs = runtime_ns / 1e9 if runtime_ns > 0 else 0.0
        bw_bytes = int(self.bytes / secs) if secs else 0
        clat = LatStat(self.clats).as_fio()
        clat["percentile"] = self.percentiles()
        return {"io_bytes": self.bytes, "io_kbytes": self.bytes >> 10, "bw_bytes": bw_bytes,
                "bw": bw_bytes >> 10, "iops": self.ios / secs if secs else 0.0,
                "runtime": int(runtime_ns / 1e6) if self.ios else 0,
                "total_ios": self.ios, "short_ios": 0, "drop_ios": 0,
                "slat_ns": LatStat(self.slats).as_fio(), "clat_ns": clat,
                "lat_ns": LatStat(map(operator.add, self.slats, self.clats)).as_fio()}


# --------------------------------------------------------------------------- one job

@dataclass
class JobResult:
    """What the report needs of a finished job: plain data, so that a job run in another
    process (benchjobs.py) sends it back whole, latencies included."""

    index: int
    pid: int
    stats: dict[str, DirStats]
    runtime_ns: int
    error_kind: int
    errors: list[str]
    max_inflight: int
    verified: int
    held: int
    queues: set[int]
    #: qid -> the most commands that queue carried at once (the controller's count)
    queue_max_inflight: dict[int, int]
    cpu: tuple[float, float]            # user, system seconds of the job's process
    #: wall-clock (time.time()) start and end of the counted run, to line CPU samples
    #: up with it (benchmarks/numjobs.py)
    window: tuple[float, float] = (0.0, 0.0)


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


# --------------------------------------------------------------------------- the run

class Bench:
    """Connect, lay the jobs out over the namespace, run, and collect results."""

    def __init__(self, opts: BenchOptions, connect_opts: Any, err=sys.stderr,
                 only: list[int] | None = None) -> None:
        self.opts = opts
        self.connect_opts = connect_opts
        self.err = err
        #: the jobs this process runs (benchjobs.py runs one per process); None: all
        self.only = only
        self.controllers: list[Controller] = []
        self.jobs: list[Job] = []
        self.interrupted = False

    def _check(self, ns: HostNamespace, ctrl: Controller) -> tuple[int, int]:
        opts = self.opts
        if opts.rw not in PATTERNS:
            raise BenchError(f"--rw {opts.rw}: expected one of {', '.join(PATTERNS)}")
        if opts.iodepth < 1 or opts.numjobs < 1:
            raise BenchError("--iodepth and --numjobs must be at least 1")
        if not 0 <= opts.rwmixread <= 100:
            raise BenchError("--rwmixread must be 0..100")
        if opts.bs <= 0 or opts.bs % ns.block_size:
            raise BenchError(f"--bs {opts.bs} must be a multiple of the namespace's "
                             f"{ns.block_size}-byte block size")
        if opts.bs > ctrl.max_transfer:
            raise BenchError(f"--bs {opts.bs} exceeds the controller's maximum transfer "
                             f"size of {ctrl.max_transfer} bytes (MDTS)")
        if opts.offset % ns.block_size or opts.offset >= ns.size:
            raise BenchError(f"--offset {opts.offset} must be block-aligned and inside the "
                             f"{ns.size}-byte namespace")
        size = ns.size - opts.offset if opts.size is None else opts.size
        if opts.offset + size > ns.size:
            raise BenchError(f"--offset {opts.offset} + --size {size} exceed the "
                             f"{ns.size}-byte namespace {ns.nsid}")
        if opts.verify and opts.writes and opts.numjobs > 1:
            size //= opts.numjobs   # each job verifies its own slice, as offset_increment
        size -= size % opts.bs
        if size < opts.bs:
            raise BenchError(f"--size leaves each job less than one {opts.bs}-byte block")
        if opts.verify and opts.writes and opts.time_based and size // opts.bs <= opts.iodepth:
            raise BenchError("--verify with writes needs more blocks per job than --iodepth")
        return opts.offset, size

    def _connect(self) -> Controller:
        ctrl = Controller(self.connect_opts).connect()
        self.controllers.append(ctrl)
        return ctrl

    def setup(self) -> None:
        opts = self.opts
        per_job = opts.controllers == "per-job"
        ctrl = self._connect()
        nsid = opts.nsid if opts.nsid is not None else min(ctrl.namespaces, default=None)
        if nsid not in ctrl.namespaces:
            raise BenchError(f"namespace {nsid} is not active on {self.connect_opts.subnqn} "
                             f"(active: {sorted(ctrl.namespaces) or 'none'})")
        if opts.writes and ctrl.namespaces[nsid].read_only:
            raise BenchError(f"namespace {nsid} is read-only")
        start, size = self._check(ctrl.namespaces[nsid], ctrl)
        split = bool(opts.verify and opts.writes and opts.numjobs > 1)
        here = list(range(opts.numjobs)) if self.only is None else self.only
        for local, j in enumerate(here):
            if per_job and local:
                ctrl = self._connect()
            if per_job:
                local = 0
            queues = ctrl.io_queues
            slots_here = (opts.iodepth if per_job else opts.iodepth * len(here))
            room = len(queues) * min(q.depth for q in queues)
            if slots_here > room:
                raise BenchError(f"{slots_here} commands in flight per controller exceed its "
                                 f"{len(queues)} I/O queue(s) of depth {queues[0].depth}: "
                                 f"raise --nr-io-queues or --queue-size")
            base = local * opts.iodepth
            rotated = [queues[(base + k) % len(queues)] for k in range(len(queues))]
            self.jobs.append(Job(j, opts, ctrl, ctrl.namespaces[nsid],
                                 start + (j * size if split else 0), size, rotated))

    def run(self, on_tick: Callable[[], None] | None = None) -> None:
        """Run the jobs to their end (``on_tick``: called a few times a second)."""
        opts = self.opts
        for job in self.jobs:
            job.ctrl.reactor.call_soon_threadsafe(job.begin)
        t0 = time.monotonic()
        ramp_end = t0 + opts.ramp_time
        ramped = opts.ramp_time <= 0
        limit = opts.ramp_time + opts.runtime if (opts.time_based or opts.runtime > 0) \
            else None
        progress = Progress(self.totals, opts, self.err, opts.eta)
        try:
            while not all(j.finished.is_set() for j in self.jobs):
                now = time.monotonic()
                if not ramped and now >= ramp_end:
                    ramped = True
                    for job in self.jobs:
                        job.ctrl.reactor.call_soon_threadsafe(job.begin_measure)
                if limit is not None and now - t0 >= limit:
                    break
                if any(j.errors for j in self.jobs):
                    break
                wake = 1.0 - ((now - t0) % 1.0)
                if limit is not None:
                    wake = min(wake, t0 + limit - now)
                if not ramped:
                    wake = min(wake, ramp_end - now)
                self.jobs[0].finished.wait(max(0.001, min(wake, 0.25)))
                progress.tick(time.monotonic() - t0)
                if on_tick is not None:
                    on_tick()
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self._drain()
            progress.close()

    def _drain(self) -> None:
        """Stop the workloads and wait for what is in flight (and any verify read-back),
        giving up only when nothing has completed for DRAIN_TIMEOUT seconds."""
        for job in self.jobs:
            job.ctrl.reactor.call_soon_threadsafe(job.stop)
        seen, quiet_since = -1, time.monotonic()
        while not all(j.finished.is_set() for j in self.jobs):
            done = sum(j.completions for j in self.jobs)
            if done != seen:
                seen, quiet_since = done, time.monotonic()
            elif time.monotonic() - quiet_since > DRAIN_TIMEOUT:
                for job in self.jobs:
                    if not job.finished.is_set():
                        job.errors.append(f"job {job.index}: {job.inflight} command(s) did "
                                          f"not complete within {DRAIN_TIMEOUT:.0f} s")
                        job.error_kind = job.error_kind or errno.ETIMEDOUT
                return
            next(j for j in self.jobs if not j.finished.is_set()).finished.wait(0.5)

    def close(self) -> None:
        for job in self.jobs:
            try:
                job.close()
            except Exception as exc:  # noqa: BLE001 - the controllers must still go
                print(f"blockfabric bench: releasing job {job.index}'s memory: {exc}",
                      file=self.err)
        for ctrl in self.controllers:
            ctrl.close()
        self.controllers = []

    # -- results -------------------------------------------------------------------------
    def errors(self) -> list[str]:
        return [e for j in self.jobs for e in j.errors]

    def totals(self) -> tuple[int, int, int, int]:
        """Read I/Os, read bytes, write I/Os, write bytes so far (for the progress line)."""
        r = [j.stats["read"] for j in self.jobs]
        w = [j.stats["write"] for j in self.jobs]
        return (sum(s.ios for s in r), sum(s.bytes for s in r),
                sum(s.ios for s in w), sum(s.bytes for s in w))

    def job_results(self) -> list[JobResult]:
        stats = {id(c): c.queue_stats() for c in self.controllers}
        return [j.result(stats.get(id(j.ctrl), {})) for j in self.jobs]

    def result(self) -> dict[str, Any]:
        first = self.controllers[0] if self.controllers else None
        return make_result(self.opts, self.connect_opts, self.job_results(), {
            "controllers": self.opts.controllers,
            "provider": first.provider.name if first else None,
            "nsid": self.jobs[0].ns.nsid if self.jobs else None,
            "interrupted": self.interrupted,
            "queue_stats": [{str(q): s for q, s in c.queue_stats().items()}
                            for c in self.controllers],
            # Reconnects and failovers during the run (see docs/reliability.md).
            "paths": [format_path(a, p) for a, p in first.paths] if first else [],
            "recovery": [c.recovery_stats() for c in self.controllers],
            "ana_paths": [c.paths_view() for c in self.controllers
                          if hasattr(c, "paths_view")],
        })


def job_report(opts: BenchOptions, jobs: list[JobResult], name: str) -> dict[str, Any]:
    """fio's per-job JSON for ``jobs`` merged (one job, or all with group_reporting)."""
    runtime = max((j.runtime_ns for j in jobs), default=0)
    report: dict[str, Any] = {
        "jobname": name, "groupid": 0,
        "error": next((j.error_kind for j in jobs if j.error_kind), 0),
        "eta": 0, "elapsed": round(runtime / 1e9),
        "job options": job_options(opts),
        "job_runtime": int(runtime / 1e6),
    }
    for direction in ("read", "write"):
        report[direction] = DirStats.merge([j.stats[direction] for j in jobs]
                                           ).as_fio(runtime)
    report["trim"] = DirStats().as_fio(0)
    # the controllers' own counts (none left once a controller failed)
    used = [m for j in jobs for m in j.queue_max_inflight.values()]
    cpu = {j.pid: j.cpu for j in jobs}          # each process once
    wall = runtime / 1e9 or 1.0
    report["usr_cpu"] = 100.0 * sum(c[0] for c in cpu.values()) / wall
    report["sys_cpu"] = 100.0 * sum(c[1] for c in cpu.values()) / wall
    report["blockfabric"] = {
        "max_inflight": max(j.max_inflight for j in jobs),
        "queue_max_inflight": max(used, default=0),
        "queues": sorted({q for j in jobs for q in j.queues}),
        "verified_blocks": sum(j.verified for j in jobs),
        "held": sum(j.held for j in jobs),
        "errors": [e for j in jobs for e in j.errors][:10],
        "pids": sorted(cpu),
        "jobs": len(jobs),
        "window": [min(j.window[0] for j in jobs), max(j.window[1] for j in jobs)],
    }
    return report


def job_options(o: BenchOptions) -> dict[str, str]:
    out = {"rw": o.rw, "bs": str(o.bs), "iodepth": str(o.iodepth),
           "numjobs": str(o.numjobs), "offset": str(o.offset),
           "runtime": str(o.runtime), "rwmixread": str(o.rwmixread),
           "randseed": str(o.seed)}
    if o.size is not None:
        out["size"] = str(o.size)
    if o.time_based:
        out["time_based"] = "1"
    if o.ramp_time:
        out["ramp_time"] = str(o.ramp_time)
    if o.verify:
        out["verify"] = o.verify
    if o.thread:
        out["thread"] = "1"
    return out


def make_result(opts: BenchOptions, connect_opts: Any, results: list[JobResult],
                extra: dict[str, Any]) -> dict[str, Any]:
    """fio's JSON document: one report per job, or one for all with group_reporting;
    ``extra`` is the "blockfabric" section (controllers, paths, recovery)."""
    now = time.time()
    if opts.group_reporting:
        jobs = [job_report(opts, results, opts.jobname)]
    else:
        jobs = [job_report(opts, [r], opts.jobname) for r in results]
    return {
        "fio version": f"blockfabric-bench-{__version__}",
        "timestamp": int(now), "timestamp_ms": int(now * 1000),
        "time": time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)),
        "global options": {"traddr": connect_opts.traddr,
                           "trsvcid": str(connect_opts.trsvcid),
                           "subnqn": connect_opts.subnqn},
        "jobs": jobs,
        "disk_util": [],
        "blockfabric": extra,
    }


class Progress:
    """fio's eta line: once a second, elapsed time, IOPS and MB/s since the last line."""

    def __init__(self, totals: Callable[[], tuple[int, int, int, int]], opts: BenchOptions,
                 out, mode: str) -> None:
        self.totals = totals
        self.opts = opts
        self.out = out
        tty = hasattr(out, "isatty") and out.isatty()
        self.enabled = mode == "always" or (mode == "auto" and tty)
        self.tty = tty
        self.last_t = 0.0
        self.last = (0, 0, 0, 0)
        self.printed = False

    def tick(self, elapsed: float) -> None:
        if not self.enabled or elapsed - self.last_t < 1.0:
            return
        totals = self.totals()
        dt = elapsed - self.last_t
        d = [max(0, a - b) for a, b in zip(totals, self.last)]
        self.last, self.last_t = totals, elapsed
        opts = self.opts
        limit = opts.ramp_time + opts.runtime
        parts = [f"[{elapsed:4.0f}s/{limit:.0f}s]"]
        for label, ios, nbytes in (("r", d[0], d[1]), ("w", d[2], d[3])):
            if ios or (label == "r") != (opts.rw in ("write", "randwrite")):
                parts.append(f"{label}: {fio_num(ios / dt)} IOPS "
                             f"{nbytes / dt / 1e6:.1f} MB/s")
        line = " ".join(parts)
        self.out.write(("\r" + line + "  ") if self.tty else line + "\n")
        self.out.flush()
        self.printed = True

    def close(self) -> None:
        if self.enabled and self.tty and self.printed:
            self.out.write("\n")
            self.out.flush()


# --------------------------------------------------------------------------- fio-like text

def fio_num(value: float) -> str:
    """fio's short numbers: 950, 12.3k, 1234k -> 1.23M."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            v = value / factor
            return f"{v:.3g}{suffix}" if v < 1000 else f"{v:.0f}{suffix}"
    return f"{value:.0f}"


def _short_size(n: int) -> str:
    for shift, suffix in ((30, "g"), (20, "m"), (10, "k")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _bw_text(bw_bytes: float) -> str:
    """fio's "BW=48.0MiB/s (50.3MB/s)"."""
    for factor, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if bw_bytes >= factor:
            binary = f"{bw_bytes / factor:.3g}{unit}/s"
            break
    else:
        binary = f"{bw_bytes:.0f}B/s"
    for decimal, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if bw_bytes >= decimal:
            return f"{binary} ({bw_bytes / decimal:.3g}{unit}/s)"
    return f"{binary} ({bw_bytes:.0f}B/s)"


def _lat_unit(ns: float) -> tuple[str, float]:
    if ns >= 10_000_000:
        return "msec", 1e6
    if ns >= 10_000:
        return "usec", 1e3
    return "nsec", 1.0


def format_text(result: dict[str, Any]) -> str:
    """A summary laid out like fio's normal output."""
    lines = []
    for job in result["jobs"]:
        pids = job["blockfabric"]["pids"]
        lines.append(f"{job['jobname']}: (groupid=0, jobs={job['blockfabric']['jobs']}): "
                     f"err={job['error']:2d}: pid={','.join(map(str, pids))}: {result['time']}")
        for direction in ("read", "write"):
            d = job[direction]
            if not d["total_ios"]:
                continue
            clat = d["clat_ns"]
            unit, div = _lat_unit(clat["mean"])
            size = d["io_bytes"]
            lines.append(f"  {direction}: IOPS={fio_num(d['iops'])}, "
                         f"BW={_bw_text(d['bw_bytes'])}({_io_text(size)}/{d['runtime']}msec)")
            lines.append(f"    clat ({unit}): min={clat['min'] / div:.0f}, "
                         f"max={clat['max'] / div:.0f}, avg={clat['mean'] / div:.2f}, "
                         f"stdev={clat['stddev'] / div:.2f}")
            lines.append(f"     clat percentiles ({unit}):")
            cells = [f"{float(k):6.2f}th=[{v / div:.0f}]"
                     for k, v in clat["percentile"].items()]
            for i in range(0, len(cells), 4):
                lines.append("     | " + ", ".join(cells[i:i + 4]) + ",")
            lines[-1] = lines[-1].rstrip(",")
        bf = job["blockfabric"]
        verified = f", verified {bf['verified_blocks']} block(s)" if bf["verified_blocks"] \
            else ""
        lines.append(f"  blockfabric: I/O queue(s) {bf['queues']}, max in flight "
                     f"{bf['max_inflight']} (job) / {bf['queue_max_inflight']} (one queue)"
                     f"{verified}")
    for i, rec in enumerate(result["blockfabric"]["recovery"]):
        if rec["losses"]:
            lines.append(f"  blockfabric: controller {i}: {rec['losses']} connection loss(es), "
                         f"{rec['reconnects']} reconnect(s) ({rec['failovers']} to another "
                         f"path), {rec['retried']} command(s) re-issued, {rec['failed']} "
                         f"failed; on {rec['path']}")
    lines.append("")
    lines.append("Run status group 0 (all jobs):")
    for direction in ("read", "write"):
        total = sum(j[direction]["io_bytes"] for j in result["jobs"])
        if not total:
            continue
        run_ms = max(j[direction]["runtime"] for j in result["jobs"]) or 1
        lines.append(f"  {direction.upper():>5}: bw={_bw_text(total / run_ms * 1000)}, "
                     f"io={_io_text(total)}, run={run_ms}msec")
    return "\n".join(lines)


def _io_text(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g}{unit}"
    return f"{n}B"


# --------------------------------------------------------------------------- command

def cmd_bench(args: argparse.Namespace) -> int:
    from blockfabric import numa
    from blockfabric.initiator.benchjobs import ProcessBench
    from blockfabric.initiator.commands import options
    opts = options_from_args(args)
    connect_opts = options(args, args.nqn)
    processes = opts.numjobs > 1 and not opts.thread
    try:        # --cpus, or the route's NIC's node (best effort; logged)
        placement = numa.place_host(connect_opts.traddr, opts.cpus,
                                    rdma=connect_opts.transport == "rdma", apply_now=not processes)
    except numa.PlacementError as exc:
        raise BenchError(str(exc)) from None
    bench = (ProcessBench(opts, connect_opts, placement) if processes
             else Bench(opts, connect_opts))
    try:
        bench.setup()
        bench.run()
        result = bench.result()
        result["blockfabric"]["placement"] = placement.as_dict()
    finally:
        bench.close()
    if args.output_format == "json":
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_text(result))
    sys.stdout.flush()
    errors = bench.errors()
    for message in errors[:10]:
        print(f"blockfabric bench: {message}", file=sys.stderr)
    if len(errors) > 10:
        print(f"blockfabric bench: ... and {len(errors) - 10} more", file=sys.stderr)
    if errors:
        return 1
    return 130 if bench.interrupted else 0

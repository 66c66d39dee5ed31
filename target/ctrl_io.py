"""A controller's I/O commands: Read/Write (the per-I/O path), Flush, Write Zeroes, Dataset
Management, reservations, and the backend calls that run them.  A mixin of
:class:`~blockfabric.target.controller.Controller`; it imports nothing of the controller
module (the import goes one way: controller -> ctrl_io)."""

from __future__ import annotations

import errno
import logging
from time import perf_counter_ns
from typing import TYPE_CHECKING, Callable, Protocol

from blockfabric.fabric.target_side import Command
from blockfabric.protocol import StatusCode
from blockfabric.protocol import io as nvm_io
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.opcodes import FABRICS_OPCODE, IOOpcode
from blockfabric.protocol.sgl import TYPE_OFFSET
from blockfabric.rdma import SGE
from blockfabric.protocol import resv
from blockfabric.target import resvctl
from blockfabric.target.backends import Unavailable
from blockfabric.target.ctrl_auth import no_auth
from blockfabric.target.metrics import READ, WRITE, IoStats, done_pair

if TYPE_CHECKING:
    from blockfabric.target.fairshare import Lease
    from blockfabric.target.namespace import Namespace, Subsystem
    from blockfabric.target.services import Owner, Resources

    class _Rest(Protocol):
        """What this half uses of the rest of its Controller (controller.py): mypy checks
        that the composed Controller has it."""

        is_ready: bool
        _unpin_cmd: Callable[[Command], None]
        _write_fetched: Callable[[Command], None]

        @property
        def name(self) -> str: ...
        def handle(self, cmd: Command) -> None: ...
        def _check_mdts(self, length: int) -> None: ...
else:
    _Rest = object

# The controller's log, whichever of its modules a line comes from (no name changes).
_OP_WRITE = int(IOOpcode.WRITE)      # (an Enum attribute read costs ~90 ns, per I/O)
log = logging.getLogger("blockfabric.target.controller")


_ERRNO_STATUS = {
    errno.ERANGE: StatusCode.LBA_OUT_OF_RANGE,
    errno.EROFS: StatusCode.NS_WRITE_PROTECTED,
    errno.ENOSPC: StatusCode.CAPACITY_EXCEEDED,
    errno.EACCES: StatusCode.ACCESS_DENIED,
    errno.EPERM: StatusCode.ACCESS_DENIED,
    errno.EOPNOTSUPP: StatusCode.INVALID_OPCODE,
}


def errno_status(exc: OSError, writing: bool) -> StatusCode:
    """Map a backend error to an NVMe status, as nvmet's errno_to_nvme_status does."""
    status = _ERRNO_STATUS.get(exc.errno or 0)
    if status is not None:
        return status
    if exc.errno == errno.EIO:
        return StatusCode.WRITE_FAULT if writing else StatusCode.UNRECOVERED_READ_ERROR
    return StatusCode.INTERNAL_ERROR


class IoCommands(_Rest):
    """The I/O half of a controller (see :class:`Controller` for its state)."""

    # Of the controller's state, what this half reads and writes.
    res: Resources
    owner: Owner
    subsystem: Subsystem | None
    hostnqn: str
    mdts_bytes: int
    io: IoStats

    def _io(self, cmd: Command) -> None:
        sqe = cmd.sqe
        op = sqe.opcode
        nss = self._io_namespace(sqe.nsid, flush=op == IOOpcode.FLUSH)
        if not nss:                 # a Flush of every namespace, and there is none
            cmd.respond()
            return
        for ns in nss:
            if ns.ana_status:       # this path may not serve it now (ANA): try another
                raise ProtocolError(f"namespace {ns.nsid}: ANA group {ns.ana_group} is "
                                    "inaccessible on this gateway", ns.ana_status, dnr=False)
        if any(ns.paused for ns in nss):
            # A namespace is being resized: run the command once it is done.
            next(ns for ns in nss if ns.paused).held.append(lambda: self._rerun(cmd))
            return
        if op in resv.OPCODES:
            resvctl.execute(self, cmd, nss[0])  # type: ignore[arg-type]  # (a Controller)
            return
        resvctl.check_io(self, nss, op)  # type: ignore[arg-type]  # (a Controller)
        if op == IOOpcode.READ or op == IOOpcode.WRITE:
            # Decoded in full rather than by the queue's fast path: the same handler.
            cmd.slba = sqe.cdw10 | sqe.cdw11 << 32
            cmd.cdw12 = sqe.cdw12
            self._read_write(cmd)
        elif op == IOOpcode.FLUSH:
            self._backend_call(cmd, nss, lambda: [n.backend.flush()  # type: ignore[func-returns-value]
                                                  for n in nss], True,
                               blocking=True, aio=self._aio(nss, "flush"))
        elif op == IOOpcode.WRITE_ZEROES:
            wz = nvm_io.WriteZeroes.from_sqe(sqe)
            ns = nss[0]
            self._check_range(ns, wz.slba, wz.blocks, write=True)
            off, length = wz.slba * ns.block_size, wz.blocks * ns.block_size
            self._backend_call(cmd, nss, lambda: ns.backend.write_zeroes(off, length), True,
                               blocking=ns.memory is None,
                               aio=self._aio(nss, "write_zeroes", off, length))
        elif op == IOOpcode.DATASET_MANAGEMENT:
            self._dsm(cmd, nss[0], nvm_io.DatasetManagement.from_sqe(sqe))
        elif op == FABRICS_OPCODE:
            raise no_auth(cmd)
        else:
            raise ProtocolError(f"I/O opcode {op:#x} not supported", StatusCode.INVALID_OPCODE)

    def _io_namespace(self, nsid: int, flush: bool = False) -> list[Namespace]:
        if flush and nsid == 0xFFFFFFFF:
            return list(self.subsystem.namespaces.values())  # type: ignore[union-attr]
        ns = self.subsystem.namespaces.get(nsid)  # type: ignore[union-attr]  # (I/O: not discovery)
        if ns is None:
            raise ProtocolError(f"namespace {nsid} is not active", StatusCode.INVALID_NS)
        return [ns]

    @staticmethod
    def _check_range(ns: Namespace, slba: int, blocks: int, write: bool) -> None:
        if slba + blocks > ns.nblocks:
            raise ProtocolError(f"LBA {slba}+{blocks} beyond {ns.nblocks} blocks",
                                StatusCode.LBA_OUT_OF_RANGE)
        if write and ns.read_only:
            raise ProtocolError(f"namespace {ns.nsid} is read-only",
                                StatusCode.NS_WRITE_PROTECTED)

    # Every command that touches a namespace's backend is counted in flight from _begin to
    # _end: a resize or removal waits for that count to reach zero before it touches the
    # volume, and a drain waits for it before flushing.
    def _begin(self, nss: list[Namespace]) -> int:
        for ns in nss:
            ns.stats.inflight += 1
        self.io.inflight += 1
        return perf_counter_ns()

    def _unpin(self, nss: list[Namespace]) -> None:
        for ns in nss:
            ns.stats.inflight -= 1
        self.io.inflight -= 1

    def _end(self, cmd: Command, nss: list[Namespace], started: int,
             status: int = StatusCode.SUCCESS, *, dnr: bool = False,
             data: tuple[SGE, ...] = (), rw: int | None = None, nbytes: int = 0,
             pinned: bool = False) -> None:
        """Count and answer; ``pinned``: the answer's RDMA WRITE reads the volume's memory,
        so the command stays in flight until its response SEND completes."""
        ok = status == StatusCode.SUCCESS
        if not pinned:
            self._unpin(nss)
        for ns in nss:
            if rw is not None:
                ns.stats.done(rw, nbytes, started, ok)
            elif not ok:
                ns.stats.errors += 1
        io = self.io
        if rw is not None:
            io.done(rw, nbytes, started, ok)
        elif not ok:
            io.errors += 1
        cmd.user = None                         # answered: nothing left to undo
        cmd.respond(status, dnr=dnr, data=data)
        if not cmd.responded:       # the queue closed under it: no SEND will release it
            release, cmd.on_released = cmd.on_released, None
            if release is not None:
                release(cmd)

    # Read and Write: the per-I/O path.  The checks and statuses of nvmet (and of the rest of
    # this class), in its order: controller ready, namespace active, SGL length, MDTS, LBA
    # range, write protection; made on the ints the queue decoded, with no exception, object
    # or closure on the way of a success.
    def _read_write(self, cmd: Command) -> None:
        if not self.is_ready:
            self._refuse(cmd, StatusCode.CMD_SEQ_ERROR,
                         f"opcode {cmd.opcode:#x} before CC.EN=1 and CSTS.RDY=1")
            return
        ns = self.subsystem.namespaces.get(cmd.nsid)  # type: ignore[union-attr]  # (I/O: not discovery)
        if ns is None:
            self._refuse(cmd, StatusCode.INVALID_NS, f"namespace {cmd.nsid} is not active")
            return
        if ns.ana_status:   # this path may not serve it now (ANA): the host tries another
            self.io.errors += 1
            cmd.queue.respond(cmd, ns.ana_status)
            return
        if ns.paused:
            # A namespace is being resized: run the command once it is done.
            ns.held.append(lambda: self._rerun(cmd))
            return
        write = cmd.opcode == _OP_WRITE
        if not ns.resv_open:        # something is reserved: may this host read/write?
            status = resvctl.io_status(self, ns, write)  # type: ignore[arg-type]  # (a Controller)
            if status:
                self.io.errors += 1
                cmd.queue.respond(cmd, status, dnr=status == resvctl.CONFLICT)
                return
        bs = ns.block_size
        blocks = (cmd.cdw12 & 0xFFFF) + 1
        length = blocks * bs
        if cmd.data_length != length:
            self._refuse(cmd, StatusCode.SGL_DATA_LENGTH_INVALID,
                         f"SGL length {cmd.data_length} for {blocks} blocks of {bs}")
            return
        if length > self.mdts_bytes:
            self._refuse(cmd, StatusCode.INVALID_FIELD,
                         f"{length} bytes exceeds MDTS {self.mdts_bytes}")
            return
        slba = cmd.slba
        if slba + blocks > ns.nblocks:
            self._refuse(cmd, StatusCode.LBA_OUT_OF_RANGE,
                         f"LBA {slba}+{blocks} beyond {ns.nblocks} blocks")
            return
        if write and ns.read_only:
            self._refuse(cmd, StatusCode.NS_WRITE_PROTECTED,
                         f"namespace {ns.nsid} is read-only")
            return
        offset = slba * bs
        queue = cmd.queue
        mr = ns.mr(queue.pd)
        # In flight from here to the answer (see _begin); for a read from the volume's
        # memory until its response SEND completed (its RDMA WRITE reads the volume).
        ns.stats.inflight += 1
        self.io.inflight += 1
        cmd.ns = ns
        started = cmd.started = perf_counter_ns()
        if mr is None:
            cmd.user = self._unpin_cmd          # undo, should the queue die before the answer
            self.res.with_bounce(cmd, self.hostnqn, length, lambda view, sge, lease:
                                    self._bounce_rw(cmd, ns, offset, length, write, view, sge,
                                                    lease, started))
            return
        if not write:                           # zero copy: RDMA WRITE out of the volume
            cmd.on_released = self._unpin_cmd
            done_pair(ns.stats, self.io, READ, length, started)
            queue.respond_ok(cmd, mr.addr + offset, length, mr.lkey)
            if not cmd.responded:   # the queue closed under it: no SEND will release it
                cmd.on_released = None
                self._unpin_rw(cmd)
            return
        if cmd.sgl_type == TYPE_OFFSET:         # in-capsule data: copied, done
            queue.take_inline(cmd, ns.memory, offset, length)  # type: ignore[arg-type]  # (an mr: memory)
            self._written(cmd)
            return
        cmd.user = self._unpin_cmd              # undo, should the queue die before the READ
        queue.fetch_to(cmd, mr.addr + offset, length, mr.lkey, self._write_fetched)

    def _rerun(self, cmd: Command) -> None:
        """A command held while its namespace was resized, run now, unless its queue ended
        meanwhile: nothing would take its answer, and what a Read or Write counts in flight
        before it moves data would never be undone (the queue's cleanup ran already)."""
        if not cmd.queue.closed:
            self.handle(cmd)

    def _written(self, cmd: Command) -> None:
        """A write's data is in the volume's memory: count and answer."""
        ns = cmd.ns
        ns.stats.inflight -= 1
        self.io.inflight -= 1
        cmd.user = None
        done_pair(ns.stats, self.io, WRITE, cmd.data_length, cmd.started)
        cmd.queue.respond_ok(cmd)

    def _unpin_rw(self, cmd: Command) -> None:
        """A Read/Write's namespace is no longer in flight (answered, or never will be)."""
        cmd.ns.stats.inflight -= 1
        self.io.inflight -= 1

    def _refuse(self, cmd: Command, status: StatusCode, why: str) -> None:
        """Answer a Read/Write with an error status (DNR), as :meth:`handle` answers a
        ProtocolError."""
        self.io.errors += 1
        log.debug("%s qid=%d: cid %d opcode %#x: %s", self.name, cmd.queue.qid, cmd.cid,
                  cmd.opcode, why)
        cmd.queue.respond(cmd, status, dnr=True)

    def _bounce_rw(self, cmd: Command, ns: Namespace, offset: int, length: int, write: bool,
                   view: memoryview, sge: SGE, lease: Lease, started: int) -> None:
        cmd.on_released = lease.release
        part = view[:length]
        direction = WRITE if write else READ
        if write:
            cmd.fetch(part, sge, lambda c: self._backend_call(
                c, [ns], lambda: ns.backend.write(offset, part), True, blocking=True,
                started=started, rw=direction, nbytes=length, lease=lease,
                aio=self._aio([ns], "write", offset, part)))
        else:
            self._backend_call(cmd, [ns], lambda: ns.backend.readinto(offset, part), False,
                               blocking=True, data=(sge,), started=started, rw=direction,
                               nbytes=length, lease=lease,
                               aio=self._aio([ns], "readinto", offset, part))

    def _dsm(self, cmd: Command, ns: Namespace, dsm: nvm_io.DatasetManagement) -> None:
        nranges = dsm.ranges
        # At least the ranges, as nvmet checks (data length <= transfer length): the Linux
        # host sends one range in a whole 4 KiB page.
        if cmd.data_length < dsm.data_length:
            raise ProtocolError(f"SGL length {cmd.data_length} for {nranges} DSM ranges",
                                StatusCode.SGL_DATA_LENGTH_INVALID)
        self._check_mdts(cmd.data_length)
        if not dsm.ad:
            cmd.respond()
            return
        if ns.read_only:
            raise ProtocolError(f"namespace {ns.nsid} is read-only",
                                StatusCode.NS_WRITE_PROTECTED)
        # Only the ranges are read (at most 256 x 16 bytes), however long the SGL is.
        view, sge, release = self.res.control_buffer(cmd.queue, dsm.data_length)
        cmd.on_released = release
        started = self._begin([ns])
        cmd.user = lambda _c: self._unpin([ns])

        def fetched(c: Command) -> None:
            try:
                ranges = [(r.slba, r.nlb) for r in nvm_io.DSMRange.iter_from(view, nranges)]
                for slba, nlb in ranges:
                    self._check_range(ns, slba, nlb, write=True)
            except ProtocolError as exc:
                self._end(c, [ns], started, exc.status, dnr=exc.dnr)
                return
            bs = ns.block_size
            self._backend_call(c, [ns], lambda: [ns.backend.discard(  # type: ignore[func-returns-value]
                                                     s * bs, n * bs)
                                                 for s, n in ranges if n], True,
                               blocking=ns.memory is None, started=started,
                               aio=self._aio([ns], "discard",
                                             [(s * bs, n * bs) for s, n in ranges]))

        cmd.fetch(view, sge, fetched)

    def _aio(self, nss: list[Namespace], op: str, *args: object
             ) -> Callable[[Callable[[BaseException | None], None]], None] | None:
        """The asynchronous form of ``op`` when the namespace's backend has one (RBD), else
        None (the backend threads run the synchronous form)."""
        if len(nss) != 1 or not nss[0].backend.aio:
            return None
        backend, post = nss[0].backend, self.res.reactor.call_soon_threadsafe
        return lambda done: backend.start(post, done, op, *args)

    def _backend_call(self, cmd: Command, nss: list[Namespace], work: Callable[[], object],
                      writing: bool, *, blocking: bool, data: tuple[SGE, ...] = (),
                      started: int | None = None, rw: int | None = None,
                      nbytes: int = 0, lease: Lease | None = None,
                      aio: Callable[[Callable[[BaseException | None], None]], None] | None
                      = None) -> None:
        """Run ``work`` (inline, or on the I/O pool when it may block) and respond;
        ``lease``: the bounce buffer, whose wait on the host starts again with the answer;
        ``aio``: instead of ``work``, start the operation on an asynchronous backend (see
        :meth:`_aio`), which calls back on the reactor."""
        if started is None:
            started = self._begin(nss)

        def finish(exc: BaseException | None) -> None:
            if lease is not None:
                lease.on_wire()
            if exc is None:
                self._end(cmd, nss, started, data=data, rw=rw, nbytes=nbytes)
            elif isinstance(exc, OSError):
                if isinstance(exc, Unavailable):        # the store does not answer
                    self.res.volume_lost(nss, exc)
                status = errno_status(exc, writing)
                log.warning("%s: backend error %s -> %s", self.name, exc, status.name)
                self._end(cmd, nss, started, status, dnr=status != StatusCode.INTERNAL_ERROR,
                          rw=rw, nbytes=nbytes)
            else:
                log.error("%s: backend failure: %r", self.name, exc)
                self._end(cmd, nss, started, StatusCode.INTERNAL_ERROR, rw=rw,
                          nbytes=nbytes)

        if aio is not None:
            try:
                aio(finish)
            except Exception as exc:
                finish(exc)
            return
        if not blocking:
            try:
                work()
            except Exception as exc:
                finish(exc)
            else:
                finish(None)
            return
        self.res.run_blocking(work, finish, self.hostnqn)

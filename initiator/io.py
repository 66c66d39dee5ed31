"""The I/O path of the host: the commands, how a request becomes them, and their submission.

One primitive: an :class:`IoCommand` (op, LBA range, registered memory) that its user keeps
and reuses, completed by ``parent.io_done(command, error)`` (None or an exception), held and
re-issued across a reconnect (:mod:`.recovery`).  Namespace futures, ``submit_registered``,
the FUSE mount and the bench are built on it (:meth:`IoPath.issue_io`, or :meth:`IoPath.issue`
for a command kept and reused); everything that is not a read or a write goes as a
:class:`SqeCommand` with the same completion.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.initiator.errors import NvmeError
from blockfabric.initiator.namespace import chunks
from blockfabric.initiator.recovery import CtrlState

from blockfabric.errors import QueueDead
from blockfabric.fabric.host_side import STATUS_BITS, HostQueue
from blockfabric.protocol import (CQE, SQE, IOOpcode, KeyedSGL, StatusCode)

if TYPE_CHECKING:
    from blockfabric.fabric.host_side import RawCQE
    from blockfabric.initiator.arena import Arena
    from blockfabric.initiator.host import Controller
    from blockfabric.initiator.namespace import HostNamespace

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from blockfabric.initiator.parts import ControllerParts
else:
    ControllerParts = object    # (the parts' description, for the type checker: parts.py)

_READ = IOOpcode.READ.value


class HeldCommand:
    """What every I/O command has, so that it can be held while the controller reconnects
    and issued again after (read, write, flush, write zeroes and DSM are idempotent): the
    one callback, ``parent.io_done(command, error)``, run exactly once per issue with None,
    an :class:`NvmeError` (the command's status), or :class:`ControllerLost`."""

    __slots__ = ("parent", "nsid", "gen", "held", "path")

    def __init__(self, parent: Any, nsid: int = 0) -> None:
        self.parent = parent
        self.nsid = nsid
        self.gen = -1
        self.held = 0
        self.path: Controller | None = None     # the path it was last sent on (multipath)

    def lost(self, exc: BaseException) -> None:
        self.parent.io_done(self, exc)

    if TYPE_CHECKING:   # each kind's (IoCommand, SqeCommand)
        def send(self, ctrl: ControllerParts, queue: HostQueue) -> None: ...


class IoCommand(HeldCommand):
    """The I/O primitive: one Read or Write (one piece at MDTS) that its user keeps and
    reuses.  The user fills the fields (or lets :meth:`Controller.plan_io` do it) and calls
    :meth:`Controller.issue`; the data moves by RDMA to or from ``length`` bytes at ``addr``
    under ``rkey`` (memory registered with the controller's PD), or, for a write whose
    ``data`` (a view of those bytes) fits, in the capsule.

    ``parent.io_done(cmd, error)`` runs exactly once per issue, on the controller's reactor
    thread: ``error`` is None, an :class:`NvmeError` (the command's status) or
    :class:`ControllerLost`.  A command lost with its queue is held and re-issued after a
    reconnect, as every I/O command is (``held`` counts how often).  Nothing is allocated
    on the way: the queue packs the SQE into its slot's buffer from these fields."""

    __slots__ = ("ctrl", "opcode", "slba", "nlb", "addr", "length", "rkey", "data")

    def __init__(self, ctrl: ControllerParts, parent: Any) -> None:
        HeldCommand.__init__(self, parent)
        self.ctrl = ctrl
        self.opcode = IOOpcode.READ.value
        self.slba = self.nlb = self.addr = self.length = self.rkey = 0
        self.data: Any = None

    def send(self, ctrl: ControllerParts, queue: HostQueue) -> None:
        queue.submit_rw(self, self.opcode, self.nsid, self.slba, self.nlb, self.addr,
                        self.length, self.rkey, self.data)

    def complete(self, raw: RawCQE | None, error: QueueDead | None) -> None:
        """The queue's callback (reactor thread)."""
        if error is not None:
            self.ctrl._hold(self, error)
            return
        word = raw[4]  # type: ignore[index]  # (no error: the response)
        if word & STATUS_BITS:
            if word & 0x0E00 == 0x0600:     # SCT 3, path related (ANA): another path may serve
                self.ctrl._path_status(self, word, raw[0])  # type: ignore[index]
                return
            self.parent.io_done(self, NvmeError.from_word(
                "Read" if self.opcode == _READ else "Write", word, raw[0]))  # type: ignore[index]
        else:
            self.parent.io_done(self, None)


class SqeCommand(HeldCommand):
    """An I/O command that is not a read or a write (Flush, Write Zeroes, Dataset
    Management): built afresh by ``make_sqe`` for each issue, ``data_out`` (if any) sent
    from the arena; held and re-issued, and completed, like an
    :class:`IoCommand`."""

    __slots__ = ("ctrl", "make_sqe", "what", "data_out")

    def __init__(self, ctrl: ControllerParts, parent: Any, nsid: int, make_sqe: Callable[[], SQE],
                 what: str, data_out: bytes | None = None) -> None:
        HeldCommand.__init__(self, parent, nsid)
        self.ctrl = ctrl
        self.make_sqe = make_sqe
        self.what = what
        self.data_out = data_out

    def send(self, ctrl: ControllerParts, queue: HostQueue) -> None:
        ctrl.submit(queue, self.make_sqe(), self._completed, data_out=self.data_out)

    def _completed(self, cqe: CQE | None, _data: Any, error: QueueDead | None) -> None:
        if error is not None:
            self.ctrl._hold(self, error)
            return
        # (no error: the response)
        status = int(cqe.status)  # type: ignore[union-attr]
        if not status:
            self.parent.io_done(self, None)
        elif (status >> 8) & 7 == 3:        # path related: another path may serve
            self.ctrl._path_status(self, status << 1 | cqe.dnr << 15,  # type: ignore[union-attr]
                                   cqe.result)  # type: ignore[union-attr]
        else:
            self.parent.io_done(self, NvmeError(self.what, status,
                                                cqe.dnr, cqe.result))  # type: ignore[union-attr]


class IoJoin:
    """The parent of one request's commands (its pieces at MDTS): ``callback(error)`` once,
    when the last is done, with the first error or None."""

    __slots__ = ("callback", "left", "error")

    def __init__(self, callback: Callable[[BaseException | None], None], left: int) -> None:
        self.callback = callback
        self.left = left
        self.error: BaseException | None = None

    def io_done(self, _cmd: HeldCommand, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        if not self.left:
            self.callback(self.error)


class _FutureJoin:
    """The parent of a future's commands: the data sits in one arena block, copied out for
    a read; the block goes back and the future is settled when the last command is done."""

    __slots__ = ("future", "left", "error", "arena", "block", "read_length")

    def __init__(self, future: concurrent.futures.Future, left: int, arena: Arena | None = None,
                 block: tuple[int, int] | None = None, read_length: int = 0) -> None:
        self.future = future
        self.left = left
        self.error: BaseException | None = None
        self.arena = arena
        self.block = block
        self.read_length = read_length

    def io_done(self, _cmd: HeldCommand, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.left -= 1
        if self.left:
            return
        data = None
        block = self.block
        if block is not None:
            # (a block: from the arena given with it)
            if self.read_length and self.error is None:
                data = bytes(self.arena.view[  # type: ignore[union-attr]
                    block[0]:block[0] + self.read_length])
            self.arena.free(*block)  # type: ignore[union-attr]
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(data)


class IoPath(ControllerParts):
    """The controller's command submission: admin commands waited for, and the I/O
    primitive (:class:`IoCommand`) planned at MDTS and issued on a queue."""

    #: issue_io may send on the queue its caller names (a multipath controller routes
    #: every command itself, so it may not)
    direct_queues = True

    def io_queue(self) -> HostQueue:
        if not self.io_queues:
            raise QueueDead("no I/O queues")
        return self.io_queues[next(self._rr) % len(self.io_queues)]

    def submit(self, queue: HostQueue, sqe: SQE, callback, *, data_out=None,
               data_in: int = 0, inline: bool = False, sgl: KeyedSGL | None = None) -> None:
        """Submit with data handled: ``data_out`` bytes go in-capsule (``inline``) or from
        the arena by keyed SGL; ``data_in`` bytes come back into the arena.  ``callback(cqe,
        data, error)`` gets the data read (bytes) for ``data_in``.  With ``sgl`` (memory the
        caller registered), the data moves straight to or from there and ``data`` is None."""
        arena: Arena = self.arena  # type: ignore[assignment]  # (set with the first queue)
        block = None
        if data_out is not None and inline:
            queue.submit(sqe, lambda cqe, err: callback(cqe, None, err), inline=data_out)
            return
        if sgl is not None:
            sqe.sgl = sgl
            queue.submit(sqe, lambda cqe, err: callback(cqe, None, err))
            return
        length = len(data_out) if data_out is not None else data_in
        if length:
            offset, size = arena.alloc(length)
            block = (offset, size)
            if data_out is not None:
                arena.view[offset:offset + length] = data_out
            sqe.sgl = arena.sgl(offset, length)

        def done(cqe: CQE | None, error: QueueDead | None) -> None:
            data = None
            if block is not None:
                if data_in and cqe is not None and error is None:
                    data = bytes(arena.view[block[0]:block[0] + data_in])
                arena.free(*block)
            callback(cqe, data, error)

        try:
            queue.submit(sqe, done)
        except BaseException:
            if block is not None:
                arena.free(*block)
            raise

    def wait(self, queue: HostQueue, sqe: SQE, what: str, *, data_out=None, data_in: int = 0,
             inline: bool = False, timeout: float | None = None) -> tuple[CQE, bytes | None]:
        """Submit and wait; raise NvmeError on an error status, QueueDead if the queue dies."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cb(cqe, data, error) -> None:
            fut.set_result((cqe, data, error))

        self.submit(queue, sqe, cb, data_out=data_out, data_in=data_in, inline=inline)
        if timeout is None:
            # (re)connecting to a target that hangs, or one that stops answering: never
            # for ever, or the one worker that handles events would wait with it
            timeout = self.opts.admin_timeout if self.state == CtrlState.LIVE else \
                self.opts.connect_timeout
        try:
            cqe, data, error = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what}: no answer from the target within {timeout:g} s"
                               ) from None
        if error is not None:
            raise _queue_error(error, what)
        if cqe.status != StatusCode.SUCCESS:
            raise NvmeError(what, cqe.status, cqe.dnr, cqe.result)
        return cqe, data

    def raw(self, queue: HostQueue, capsule: bytes, timeout: float | None = 10.0) -> CQE:
        """Send ``capsule`` as is (only its cid is set) and return the response, whatever its
        status: for tools and tests that must send what a normal host never would."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        queue.submit_raw(capsule, lambda cqe, err: fut.set_result((cqe, err)), timeout)
        cqe, error = fut.result(timeout)
        if error is not None:
            raise _queue_error(error, "raw command")
        return cqe

    def _io(self, ns: HostNamespace, opcode: int, offset: int, length: int,
            data: memoryview | None) -> concurrent.futures.Future:
        """Read or write through an arena block, split at the transfer limit; one future
        for the whole range (its result: the bytes read, or None).  The range is not
        checked against the namespace size here: the target answers LBA out of range, and
        that real status is what the caller should see."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        arena: Arena = self.arena  # type: ignore[assignment]  # (set with the first queue)
        at, size = arena.alloc(length)
        view = None
        if data is not None:
            arena.view[at:at + length] = data
            view = arena.view[at:at + length]
        most = self.max_transfer
        join = _FutureJoin(fut, 1 if length <= most else -(-length // most), arena,
                           (at, size), length if data is None else 0)
        try:
            self.issue_io([], join, ns, opcode, offset, length, arena.mr.addr + at,
                          arena.mr.rkey, view)
        except BaseException:           # nothing was issued (a range no command carries)
            arena.free(at, size)
            raise
        return fut

    def wait_io(self, nsid: int, make_sqe: Callable[[], SQE], what: str, *,
                data_out=None) -> None:
        """An I/O command with no data back (flush, write zeroes, DSM), held and re-issued
        across a reconnect like reads and writes; raise NvmeError on an error status."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._dispatch(SqeCommand(self, _FutureJoin(fut, 1), nsid, make_sqe, what,
                                  data_out))
        fut.result()

    def submit_registered(self, ns: HostNamespace, opcode: int, offset: int, length: int,
                          addr: int, rkey: int,
                          callback: Callable[[BaseException | None], None], *,
                          data_out=None) -> int:
        """Read or write ``[offset, offset + length)`` straight from or into memory the
        caller registered with :attr:`pd` (``addr``, ``rkey``): no arena block, no copy, no
        future.  ``data_out`` (a view of that same memory, for writes) lets pieces that fit
        travel in-capsule.  ``callback(error)`` runs once, on the reactor thread, with None
        or the exception (NvmeError, ControllerLost); I/O is held across reconnects like
        every I/O command.  Returns the number of NVMe commands issued (pieces at MDTS).
        A caller that issues many keeps its :class:`IoCommand` objects and uses
        :meth:`plan_io` and :meth:`issue` instead: nothing is allocated per I/O then.

        It never waits for a command slot only if the caller keeps fewer commands in flight
        than a queue has slots (the FUSE server counts them); on the reactor thread a full
        queue raises TimeoutError (that thread would wait for itself)."""
        most = self.max_transfer
        join = IoJoin(callback, 1 if length <= most else -(-length // most))
        return self.issue_io([], join, ns, opcode, offset, length, addr, rkey, data_out)

    def issue_io(self, cmds: list[IoCommand], parent: Any, ns: HostNamespace, opcode: int,
                 offset: int, length: int, addr: int, rkey: int, data=None,
                 queue: HostQueue | None = None) -> int:
        """The I/O primitive's entry: plan ``[offset, offset + length)`` into ``cmds`` at
        MDTS (:meth:`plan_io`) and issue every piece (:meth:`issue`, on ``queue`` if given);
        returns how many.  ``parent.io_done(cmd, error)`` runs once per piece: the caller
        counts ``ceil(length / max_transfer)`` of them before this is called, since a piece
        that cannot be sent (a full queue on the reactor thread) completes here, with that
        error.  A range no command carries raises ValueError, and nothing is issued."""
        if length <= self.max_transfer and queue is not None and self.direct_queues \
                and self.state is CtrlState.LIVE:
            # The FUSE server's path: one command, plan_io's and issue()'s work in this
            # frame (a Python call costs more than any of these lines).
            if not cmds:
                cmds.append(IoCommand(self, parent))
            cmd = cmds[0]
            bs = ns.block_size
            cmd.opcode = opcode
            cmd.nsid = nsid = ns.nsid
            cmd.slba = slba = offset // bs
            cmd.nlb = nlb = length // bs - 1
            cmd.addr = addr
            cmd.length = length
            cmd.rkey = rkey
            cmd.data = data
            cmd.gen = self._gen
            try:
                queue.submit_rw(cmd, opcode, nsid, slba, nlb, addr, length, rkey, data)
            except ConnectionError as exc:
                self._hold(cmd, exc)
            except Exception as exc:  # noqa: BLE001 - not sent: the piece fails
                log.warning("%s: not sent: %s", self.opts.subnqn, exc)
                parent.io_done(cmd, exc)
            return 1
        n = self.plan_io(cmds, parent, ns, opcode, offset, length, addr, rkey, data)
        for i in range(n):
            try:
                self.issue(cmds[i], queue)
            except Exception as exc:  # noqa: BLE001 - not sent: those pieces fail here
                log.warning("%s: not sent: %s", self.opts.subnqn, exc)
                for k in range(i, n):
                    parent.io_done(cmds[k], exc)
                break
        return n

    def plan_io(self, cmds: list[IoCommand], parent: Any, ns: HostNamespace, opcode: int,
                offset: int, length: int, addr: int, rkey: int, data=None) -> int:
        """Fill ``cmds`` (reused; grown with new :class:`IoCommand` objects of ``parent`` as
        needed) with the Read or Write pieces of ``[offset, offset + length)`` at the
        transfer limit (MDTS), and return how many there are: the first that many of
        ``cmds`` are to be issued.  ``addr``/``rkey``: registered memory of the data;
        ``data``: a view of it, for writes whose pieces may travel in-capsule."""
        bs = ns.block_size
        most = self.max_transfer
        nsid = ns.nsid
        n = 0
        for start, count in chunks(offset, length, most):
            if count // bs > 0x10000:
                raise ValueError(f"{count} bytes is more blocks than one command carries")
            if n == len(cmds):
                cmds.append(IoCommand(self, parent))
            cmd = cmds[n]
            rel = start - offset
            cmd.opcode = opcode
            cmd.nsid = nsid
            cmd.slba = start // bs
            cmd.nlb = count // bs - 1
            cmd.addr = addr + rel
            cmd.length = count
            cmd.rkey = rkey
            cmd.data = None if data is None else data[rel:rel + count]
            n += 1
        return n

    def issue(self, cmd: IoCommand, queue: HostQueue | None = None) -> None:
        """Send ``cmd`` on ``queue`` (default: the next I/O queue, round robin), or hold it
        while the controller reconnects.  The live controller's path takes no lock."""
        if self.state is CtrlState.LIVE:
            cmd.gen = self._gen
            if queue is None:
                queues = self.io_queues
                if queues:
                    queue = queues[next(self._rr) % len(queues)]
            if queue is not None:
                try:
                    queue.submit_rw(cmd, cmd.opcode, cmd.nsid, cmd.slba, cmd.nlb, cmd.addr,
                                    cmd.length, cmd.rkey, cmd.data)
                except ConnectionError as exc:
                    self._hold(cmd, exc)
                return
        self._dispatch(cmd)

    def _path_status(self, cmd: IoCommand | SqeCommand, word: int, result: int) -> None:
        """A path-related status (SCT 3, e.g. ANA Inaccessible) on a single path: there is
        no other path to try, so the caller gets it (a multipath controller re-routes)."""
        what = cmd.what if isinstance(cmd, SqeCommand) else \
            "Read" if cmd.opcode == _READ else "Write"
        cmd.parent.io_done(cmd, NvmeError.from_word(what, word, result))


def _queue_error(error: BaseException, what: str) -> BaseException:
    """The error a waiting caller gets for a command its queue lost: a QueueDead (or its
    WorkCompletionError, status kept) that says what was being done."""
    if isinstance(error, QueueDead):
        return error.during(what)
    return QueueDead(f"{what}: {error}")

"""The target's registered memory and backend threads: protection domains, control and zero
buffers, bounce buffers shared fairly between hosts (and the watch on how long a host holds
one), and the backend thread pool.

Controllers reach it through :class:`~blockfabric.target.services.Resources` (the bound
methods ``control_buffer``, ``zeros``, ``with_bounce``, ``run_blocking``); it knows nothing of
controllers: a queue that keeps a bounce buffer too long is reported to ``on_hoarding``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from blockfabric.fabric.buffers import BufferPool
from blockfabric.fabric.reactor import Reactor, Timer
from blockfabric.fabric.target_side import Command
from blockfabric.fabric.tcp import local_pd
from blockfabric.rdma import PD, SGE, Access, CMId
from blockfabric.target import config as cfg
from blockfabric.target.fairshare import BouncePool, FairExecutor, Lease

if TYPE_CHECKING:
    from blockfabric.fabric.tcp import _LocalKeys
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.rdma.soft.memory import SoftPD

CONTROL_SLOT = 4096
BOUNCE_SLOTS = 64
#: A host's share of the bounce buffers never drops below this, however many hosts want them.
BOUNCE_FLOOR = 4
BACKEND_THREADS = 4


def abort_command(cmd: Command) -> None:
    """A command that will never be answered (its queue is gone): run its undo hook
    (``cmd.user(cmd)``, set where a command pins a namespace) and release its buffer."""
    undo, cmd.user = cmd.user, None
    if undo is not None:
        undo(cmd)
    release, cmd.on_released = cmd.on_released, None
    if release is not None:
        release(cmd)


class BufferBroker:
    """Registered buffers per protection domain, and the backend threads, of one target.
    ``config()``: the configuration in force (a reload swaps it); ``on_hoarding(queue, held,
    bound)``: a queue's host held a bounce buffer ``held`` seconds, past ``bound``."""

    def __init__(self, reactor: Reactor, config: Callable[[], cfg.TargetConfig],
                 on_hoarding: Callable[[AnyTargetQueue, float, float], None]) -> None:
        self.reactor = reactor
        self._config = config
        self._on_hoarding = on_hoarding
        self._pds: dict[object, PD] = {}
        self._control: dict[int, BufferPool] = {}
        self._zeros: dict[int, BufferPool] = {}
        self._old_zeros: list[BufferPool] = []      # outgrown by a larger mdts (reload)
        self._bounce: dict[int, BouncePool] = {}
        self._hold_timer: Timer | None = None
        self.executor = FairExecutor(reactor, BACKEND_THREADS)

    # -- protection domains -------------------------------------------------------------
    def pd_for(self, cmid: CMId) -> PD:
        """The protection domain of ``cmid``'s device: one per device in this process,
        shared by all its queues (so are the control, zero and bounce buffers registered on
        it: once per device, not per queue).  Keyed by the context's ``device_key``: on
        verbs each CM id holds its own handle of the shared device."""
        key = cmid.context.device_key
        pd = self._pds.get(key)
        if pd is None:
            pd = self._pds[key] = cmid.context.alloc_pd()
        return pd

    def tcp_pd(self) -> SoftPD[_LocalKeys]:
        """The protection domain of NVMe/TCP queues (local memory, no device)."""
        pd = self._pds.get(0)
        if pd is None:
            pd = self._pds[0] = local_pd()
        return pd  # type: ignore[return-value]  # (key 0: local_pd's)

    # -- buffers -------------------------------------------------------------------------
    def control_buffer(self, queue: AnyTargetQueue, length: int
                       ) -> tuple[memoryview, SGE, Callable[[Command], None]]:
        """A registered buffer for admin data (Identify pages, log pages, Connect data)."""
        pd = queue.pd
        if length <= CONTROL_SLOT:
            pool = self._control.get(id(pd))
            if pool is None:
                pool = self._control[id(pd)] = BufferPool(pd, 64, CONTROL_SLOT)
            index = pool.get()
            if index is not None:
                return (pool.views[index], pool.sge(index, length),
                        lambda _cmd: pool.put(index))
        # Large or many: a one-off registration (the admin path is not the hot path).
        pool = BufferPool(pd, 1, max(length, 1))
        return pool.views[0], pool.sge(0, length), lambda _cmd: pool.close()

    def zeros(self, queue: AnyTargetQueue, length: int) -> SGE:
        """``length`` (at most limits.mdts) bytes of zeros in registered memory, one region
        per protection domain that is never written: answers padded to a length the host
        chose cost no memory of that length."""
        pd = queue.pd
        pool = self._zeros.get(id(pd))
        if pool is None or pool.size < length:
            if pool is not None:
                self._old_zeros.append(pool)    # may still be read by a posted WRITE
            size = max(length, self._config().limits.mdts)
            pool = self._zeros[id(pd)] = BufferPool(pd, 1, size, Access(0))
        return pool.sge(0, length)

    def with_bounce(self, cmd: Command, host: str, length: int,
                    use: Callable[[memoryview, SGE, Lease], None]) -> None:
        """Run ``use(view, sge, lease)`` with a registered bounce buffer (file backends),
        when ``host``'s fair share allows (see fairshare.py); the command gives it back
        through ``lease.release`` as its ``on_released``."""
        pd = cmd.queue.pd
        pool = self._bounce.get(id(pd))
        if pool is None:
            pool = self._bounce[id(pd)] = BouncePool(
                BufferPool(pd, BOUNCE_SLOTS, self._config().limits.mdts), BOUNCE_FLOOR,
                abort_command)
            self._watch_holds()
        pool.request(host, (cmd, length, use))

    def drop_unwanted_waiters(self) -> None:
        """Commands still waiting for a bounce buffer whose queue is gone never need it."""
        for pool in self._bounce.values():
            if pool.ring:
                pool.drop_unwanted()

    @property
    def bounce_pools(self) -> list[BouncePool]:
        return list(self._bounce.values())

    # -- hold watching -------------------------------------------------------------------
    def _watch_holds(self) -> None:
        """Check the bounce buffers against limits.buffer_hold_timeout, a few times per
        bound (at most once a second)."""
        if self._hold_timer is None:
            period = min(1.0, self._config().limits.buffer_hold_timeout / 4)
            self._hold_timer = self.reactor.call_later(period, self._check_holds)

    def _check_holds(self) -> None:
        self._hold_timer = None
        bound = self._config().limits.buffer_hold_timeout
        now = time.monotonic()
        try:
            for pool in list(self._bounce.values()):
                for lease in pool.overdue(now, bound):
                    cmd = lease.cmd
                    if cmd is not None and not cmd.queue.closed:  # not gone with an earlier one
                        self._on_hoarding(cmd.queue, now - lease.since, bound)
        finally:
            self._watch_holds()

    # -- backend threads -----------------------------------------------------------------
    def run_blocking(self, work: Callable[[], object],
                     finish: Callable[[BaseException | None], None], host: str) -> None:
        """Run ``work`` on the backend threads, in ``host``'s fair turn; ``finish(exc)``
        runs back on the reactor."""
        self.executor.submit(host, work, finish)

    # -- teardown ------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop watching holds and stop the backend threads (before the volumes close)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self.executor.shutdown()

    def close(self) -> None:
        """Deregister every buffer and close every protection domain (queues closed first)."""
        for pool in [*self._control.values(), *self._bounce.values(), *self._zeros.values(),
                     *self._old_zeros]:
            pool.close()  # type: ignore[attr-defined]  # (BufferPools and BouncePools)
        self._control.clear()
        self._zeros.clear()
        self._old_zeros.clear()
        self._bounce.clear()
        for pd in self._pds.values():
            pd.close()
        self._pds.clear()

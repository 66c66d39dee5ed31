"""What a :class:`~blockfabric.target.controller.Controller` may use of the daemon, and no more.

A controller gets two small objects from its owner (the :class:`~blockfabric.target.server.
Target` builds both once, and hands the same pair to every controller), never the daemon:

* :class:`Resources`: what it spends per command: registered control, zero and bounce
  buffers (a bounce buffer waits for the host's fair share), the backend threads, the
  reactor's timers, and the live limits (a reload swaps the configuration).
* :class:`Owner`: what it tells or asks its owner: tear a controller or a queue down, flush
  a subsystem, count a failed authentication, the discovery log, whether the daemon is
  draining, and the identity it answers Identify with (discovery NQN, serial, firmware).

Each callable is stored bound, so a call costs one attribute lookup, as a method call on the
daemon did (the per-I/O path uses ``with_bounce``, ``run_blocking`` and ``reactor``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from blockfabric.fabric.tcp_target import AnyTargetQueue
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.fabric.target_side import Command
    from blockfabric.protocol.auth import TargetAuth
    from blockfabric.rdma import SGE
    from blockfabric.target import config as cfg
    from blockfabric.target.ana import Ana
    from blockfabric.target.controller import Controller
    from blockfabric.target.fairshare import Lease
    from blockfabric.target.namespace import Namespace, Subsystem

ControlBuffer = Callable[["AnyTargetQueue", int],
                         "tuple[memoryview, SGE, Callable[[Command], None]]"]


class Resources:
    """Buffers, threads and timers a controller uses to run its commands."""

    __slots__ = ("reactor", "control_buffer", "zeros", "with_bounce", "run_blocking",
                 "volume_lost", "_config")

    def __init__(self, *, reactor: Reactor,
                 control_buffer: ControlBuffer,
                 zeros: Callable[[AnyTargetQueue, int], SGE],
                 with_bounce: Callable[[Command, str, int,
                                        Callable[[memoryview, SGE, Lease], None]], None],
                 run_blocking: Callable[[Callable[[], object],
                                         Callable[[BaseException | None], None], str], None],
                 volume_lost: Callable[[list[Namespace], BaseException], None],
                 config: Callable[[], cfg.TargetConfig]) -> None:
        self.reactor = reactor
        #: ``control_buffer(queue, length)``: a registered buffer for admin data.
        self.control_buffer = control_buffer
        #: ``zeros(queue, length)``: registered zeros (answers padded to the host's length).
        self.zeros = zeros
        #: ``with_bounce(cmd, host, length, use)``: ``use(view, sge, lease)`` once a bounce
        #: buffer is free for ``host`` (file backends).
        self.with_bounce = with_bounce
        #: ``run_blocking(work, finish, host)``: ``work`` on the backend threads in ``host``'s
        #: fair turn, ``finish(exc)`` back on the reactor.
        self.run_blocking = run_blocking
        #: ``volume_lost(namespaces, exc)``: a backend reported its volume gone.
        self.volume_lost = volume_lost
        self._config = config

    @property
    def limits(self) -> cfg.Limits:
        """The limits in force now (a reload may have changed them)."""
        return self._config().limits

    @property
    def keep_alive(self) -> cfg.KeepAlive:
        return self._config().keep_alive


class Owner:
    """What a controller reports to (or asks of) the daemon that owns it."""

    __slots__ = ("destroy_controller", "end_queue", "flush_subsystem", "auth_failed",
                 "discovery_log", "draining", "controllers", "ana", "discovery_nqn",
                 "discovery_serial", "firmware_revision", "publish_resv", "refresh_activity")

    def __init__(self, *, destroy_controller: Callable[[Controller, str], None],
                 end_queue: Callable[[AnyTargetQueue, str], None],
                 flush_subsystem: Callable[[Subsystem | None], None],
                 auth_failed: Callable[[Controller, AnyTargetQueue, TargetAuth], None],
                 discovery_log: Callable[[Controller], bytes],
                 controllers: Mapping[int, Controller],
                 ana: Ana | None,
                 discovery_nqn: str, discovery_serial: str, firmware_revision: str) -> None:
        self.destroy_controller = destroy_controller
        self.end_queue = end_queue          # one queue of a controller, as if its host left
        self.flush_subsystem = flush_subsystem
        self.auth_failed = auth_failed      # counted, logged, and the peer's back-off
        self.discovery_log = discovery_log
        #: The daemon is draining (SIGTERM): commands are held, not run.  A plain attribute
        #: the daemon sets (its ``draining`` reads it): every command checks it.
        self.draining = False
        #: Every controller of the daemon by cntlid (reservation notices reach them all).
        self.controllers = controllers
        self.ana = ana                      # None unless a member of a gateway group
        self.discovery_nqn = discovery_nqn
        self.discovery_serial = discovery_serial
        self.firmware_revision = firmware_revision
        #: With poll groups (target.pollgroups): ``publish_resv(ns, state, fenced, then)``
        #: gives every group a namespace's new reservation state, ``then()`` once they
        #: all have it; None: this process is the only one.
        self.publish_resv: Callable[..., None] | None = None
        #: With poll groups: ``refresh_activity(ctrl, then)`` has the groups serving ``ctrl``
        #: report its last command now (their periodic report may be late on a busy
        #: machine), ``then()`` once they did or a KATO passed; None: one process.
        self.refresh_activity: Callable[[Controller, Callable[[], None]], None] | None = None

"""The target daemon's composition root: :class:`Target` builds its parts, starts them, and
tears them down in one ordered place (:meth:`Target.close`).

The parts, each in its own module:

* :mod:`.listeners`: listeners (rdma_cm and NVMe/TCP), accepting connections, and the limits
  a connection meets before its Connect;
* :mod:`.sessions`: a queue's first command, the Fabrics Connect, and how it is bound to a
  controller (or refused);
* :mod:`.registry`: controllers and queue sessions, their teardown, the discovery log;
* :mod:`.broker`: registered buffers and the backend threads;
* :mod:`.drain`, :mod:`.reloader` (beside its planner :mod:`.reload`), :mod:`.status`:
  the orderly stop, a reload, the status snapshot.

A controller sees none of this: it gets the :class:`~blockfabric.target.services.Resources`
and :class:`~blockfabric.target.services.Owner` built here.  Signal handlers only ask
(:meth:`Target.request_stop`, :meth:`Target.request_reload` wake the reactor, and the drain or
the reload runs there, between commands, like everything else).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from blockfabric import __version__, numa
from blockfabric.fabric.reactor import Reactor
from blockfabric.protocol.cm import CMConnectRequest
from blockfabric.protocol.controller import ControllerState
from blockfabric.protocol.fabrics import DISCOVERY_NQN
from blockfabric.sdnotify import sd_notify
from blockfabric.target import config as cfg
from blockfabric.target import metrics
from blockfabric.target import pollgroups
from blockfabric.target import resvctl
from blockfabric.target.ana import Ana
from blockfabric.target.broker import BufferBroker
from blockfabric.target.control import ControlServer
from blockfabric.target.drain import DRAIN_TIMEOUT, count_inflight, flush_subsystem, start_drain
from blockfabric.target.controller import Controller
from blockfabric.target.gateway import Coordinator, refuse_exclusive_lock
from blockfabric.target.listeners import Entry, Listeners
from blockfabric.target.namespace import Subsystem
from blockfabric.target.rbdvolume import VolumeWatch
from blockfabric.target.registry import MAX_CNTLID, ControllerRegistry, discovery_log
from blockfabric.target.nschanges import NamespaceChanges
from blockfabric.target.reloader import Reloader
from blockfabric.target.services import Owner, Resources
from blockfabric.target.sessions import Connector, QueueSession
from blockfabric.target.status import snapshot

log = logging.getLogger(__name__)


class Target:
    """The whole daemon; used as ``with Target(config) as t: t.start(); t.serve_forever()``."""

    def __init__(self, config: cfg.TargetConfig) -> None:
        self.config = config
        # First: the threads started below and the memory allocated below (ramdisks,
        # buffer pools) inherit the placement (docs/numa.md).
        self.placement = numa.place_target(config)
        self.reactor = Reactor("target", spin_us=config.spin_us)
        self.discovery_nqn = DISCOVERY_NQN
        self.discovery_serial = "blockfabric-disc"
        self.firmware_revision = __version__[:8]
        self.subsystems: dict[str, Subsystem] = {}
        self._started = threading.Event()
        self.genctr = 0
        self.started = time.time()
        self.reloads = 0
        self.last_reload_error: str | None = None
        self.metrics_server: metrics.MetricsServer | None = None
        self.control_server: ControlServer | None = None
        self.ana: Ana | None = None             # a member of a gateway group: its ANA state
        self.coordinator: Coordinator | None = None
        live_config = self._live_config
        self.broker = BufferBroker(self.reactor, live_config,
                                   lambda queue, held, bound: self.registry.hoarding(
                                       queue, held, bound))
        self.registry = ControllerRegistry(self.broker, self._cntlid_range)
        #: namespace changes while serving (a reload's, an RBD image's new size)
        self.namespaces = NamespaceChanges(self.reactor, self.registry.controllers)
        self.volumes = VolumeWatch(                 # RBD volumes: availability and size
            self.reactor, self.subsystems, self.registry.destroy_where,
            self.broker.run_blocking, self.namespaces.resize)
        self.reloader = Reloader(self)
        self.listening = Listeners(self.reactor, live_config, self.registry, self.broker,
                                   self._new_session)
        self.connector = Connector(
            config=live_config, subsystems=self.subsystems, registry=self.registry,
            volumes=self.volumes, listener_now=self.listening.now,
            control_buffer=self.broker.control_buffer, new_controller=self._new_controller)
        #: The worker processes of ``reactors`` > 1 (target.pollgroups), started by start().
        self.poll: pollgroups.PollGroups | None = None
        pollgroups.prepare(config.reactor_count)
        try:
            for sub in config.subsystems:
                self.subsystems[sub.nqn] = Subsystem(sub)
            if config.gateway is not None:
                refuse_exclusive_lock(ns for sub in self.subsystems.values()
                                      for ns in sub.namespaces.values())
                self.ana = Ana(self.reactor, self.subsystems, self.registry.controllers,
                               config.gateway)
        except BaseException:
            self.close()
            raise
        # What a controller may use of the daemon (services.py), the same pair for all.
        broker = self.broker
        self.resources = Resources(
            reactor=self.reactor, control_buffer=broker.control_buffer, zeros=broker.zeros,
            with_bounce=broker.with_bounce, run_blocking=broker.run_blocking,
            volume_lost=self.volumes.lost, config=live_config)
        self.owner = Owner(
            destroy_controller=self.registry.destroy_controller,
            end_queue=self.registry.end_queue, flush_subsystem=flush_subsystem,
            auth_failed=self.connector.auth_failed, discovery_log=self.discovery_log,
            controllers=self.registry.controllers, ana=self.ana,
            discovery_nqn=self.discovery_nqn, discovery_serial=self.discovery_serial,
            firmware_revision=self.firmware_revision)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- how the parts are wired ---------------------------------------------------------
    def _live_config(self) -> cfg.TargetConfig:
        return self.config

    def _cntlid_range(self) -> tuple[int, int]:
        """A gateway's range as its configuration has it now, else all ids."""
        gw = self.ana.gw if self.ana is not None else None
        return (gw.cntlid_min, gw.cntlid_max) if gw is not None else (1, MAX_CNTLID)

    def _new_session(self, lconf: cfg.Listener, provider: str,
                     req: CMConnectRequest | None) -> QueueSession:
        return QueueSession(self.connector, lconf, provider, req)

    def _new_controller(self, state: ControllerState, subsystem: Subsystem | None,
                        hostnqn: str, hostid: bytes, provider: str) -> Controller:
        return Controller(self.resources, self.owner, state, subsystem, hostnqn, hostid,
                          provider)

    # -- what the other parts of the daemon read --------------------------------------------
    @property
    def listeners(self) -> list[Entry]:
        """The open listeners: (configuration, provider name, listener)."""
        return self.listening.entries

    @property
    def draining(self) -> bool:
        """Stopping (SIGTERM): held on :attr:`owner`, which every controller reads."""
        return self.owner.draining

    def bind_reservations(self) -> None:
        """Watch the reservation state shared with other gateways of namespaces not yet
        watched (at start, and after a reload)."""
        resvctl.bind(self.subsystems, self.resources, self.owner)

    def discovery_log(self, ctrl: Controller) -> bytes:
        return discovery_log(ctrl, self.config, self.subsystems.values(),
                             self.listening.entries, self.genctr)

    def inflight(self) -> int:
        """Commands executing on any namespace (held ones, and AERs, are not counted)."""
        return count_inflight(self.subsystems.values(), self.namespaces.closing)

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        """Open every listener (all or nothing), then the metrics listener and the control
        socket: when this returns, every listener accepts."""
        try:
            if self.ana is not None:        # join the group first: it may refuse us
                self.coordinator = Coordinator(self.reactor, self.ana,
                                               self.config.gateway)  # type: ignore[arg-type]  # (ANA: a gateway)
                self.coordinator.connect()
            if self.config.reactor_count > 1:
                self.poll = pollgroups.PollGroups(self, self.config.reactor_count)
                self.owner.publish_resv = self.poll.publish_resv
                self.owner.refresh_activity = self.poll.refresh_activity
                self.listening.poll = self.connector.poll = self.poll
                self.poll.start()
            for lconf in self.config.listeners:
                self.listening.add(self.listening.open(lconf))
            self._start_metrics()
        except BaseException:
            self.close()
            raise
        if self.coordinator is not None:
            self.ana.start()  # type: ignore[union-attr]  # (a coordinator: ANA)
            self.coordinator.start()
        self.start_control()
        self._start_watchdog()
        self.volumes.start()
        self.bind_reservations()
        self._started.set()

    def _start_metrics(self) -> None:
        m = self.config.metrics
        if m is not None:
            self.metrics_server = metrics.MetricsServer(m.address, m.port,
                                                        self.metrics_text).start()
            log.info("metrics on http://%s:%d/metrics", m.address, self.metrics_server.port)

    def start_control(self) -> None:
        """The control socket is for ``status``: a target without one still serves I/O."""
        try:
            self.control_server = ControlServer(self.config.control_socket,
                                                self._control_request).start()
        except OSError as exc:
            log.warning("no control socket at %s: %s", self.config.control_socket, exc)

    def _start_watchdog(self) -> None:
        """WATCHDOG=1 from the reactor itself at half of WatchdogSec: a stuck reactor gets
        the service restarted."""
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and int(pid) != os.getpid()):
            return

        def ping() -> None:
            sd_notify("WATCHDOG=1")
            self.reactor.call_later(usec / 2e6, ping)
        self.reactor.call_later(usec / 2e6, ping)

    def serve_forever(self) -> None:
        self.reactor.run_forever()

    def stop(self) -> None:
        self.reactor.stop()

    # -- signals: only wake the reactor ------------------------------------------------
    def request_stop(self, announce: Callable[[], object] | None = None) -> None:
        """For a signal handler: drain and stop (a second request stops at once).
        ``announce`` (its log line) runs first, on the reactor: a signal handler must not
        log itself.  The signal may land while this thread is inside a write to the same
        stderr; the handler's write then raises 'reentrant call', out of the handler, and
        the stop was lost (seen in the lab: a target that ignored its SIGTERM)."""
        def stop() -> None:
            if announce is not None:
                announce()
            self.drain()
        self.reactor.call_soon_threadsafe(stop)

    def request_reload(self, load: Callable[[], cfg.TargetConfig],
                       announce: Callable[[], object] | None = None) -> None:
        """For a signal handler: reload with the configuration ``load()`` returns
        (``announce`` first, on the reactor, as for :meth:`request_stop`)."""
        def reload() -> None:
            if announce is not None:
                announce()
            self.reload_from(load)
        self.reactor.call_soon_threadsafe(reload)

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Stop accepting, let the commands in flight finish, flush, disconnect, stop
        (see drain.py)."""
        poll = self.poll
        if poll is not None and not self.draining:
            poll.drain(timeout)             # the workers' commands in flight count too
        start_drain(reactor=self.reactor, owner=self.owner, listeners=self.listening,
                    registry=self.registry, subsystems=self.subsystems,
                    inflight=self.inflight, timeout=timeout,
                    groups_left=(lambda: 0) if poll is None else poll.draining_left)

    def reload_from(self, load: Callable[[], cfg.TargetConfig]) -> bool:
        """Load a new configuration and apply it (through :meth:`reload`); on any error
        keep the old one whole."""
        return self.reloader.reload_from(load)

    def reload(self, new: cfg.TargetConfig) -> bool:
        """Apply ``new`` (see :class:`~blockfabric.target.reloader.Reloader`)."""
        refusal = pollgroups.reload_refusal(self.config, new)
        if refusal is not None:             # what poll groups cannot change while running
            self.reloader.failed(f"{new.source}: {refusal}")
            return False
        old = self.config
        done = self.reloader.apply(new)
        if done and (old.numa_node, old.cpus, old.numa_memory) != (
                new.numa_node, new.cpus, new.numa_memory):
            log.warning("numa_node, cpus or numa_memory changed: a reload does not move a "
                        "running target; restart it to apply (docs/numa.md)")
        return self._pushed(done)

    def _pushed(self, applied: bool) -> bool:
        """After a reload: the poll groups get the configuration too (limits)."""
        if applied and self.poll is not None:
            self.poll.push_config(self.config)
        return applied

    # -- status and metrics -------------------------------------------------------------
    def _control_request(self, request: dict[str, Any]) -> Any:
        """The control socket's handler (on its thread): answers come from the reactor."""
        command = request.get("command")
        if command != "status":
            raise ValueError(f"unknown command {command!r} (known: status)")
        return self._snapshot_here()

    def metrics_text(self) -> str:
        return metrics.render_metrics(self._snapshot_here())

    def _snapshot_here(self) -> dict[str, Any]:
        """The snapshot, copied on the reactor; then, on the calling thread, where the
        placed memory lives (/proc/self/numa_maps walks every present page: not a cost
        for the reactor to pay)."""
        box: list[dict[str, Any]] = []
        self.reactor.call_sync(lambda: box.append(self.snapshot()))
        placement = box[0]["placement"]
        placement["memory"] = numa.memory_report(placement["memory"])
        return box[0]

    def snapshot(self) -> dict[str, Any]:
        """Everything ``status`` and the metrics show, copied on the reactor."""
        out = snapshot(self)
        if self.poll is not None:
            self.poll.snapshot(out)         # per group, and the workers' counts in the totals
        return out

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        """Stop accepting, close every queue, flush and close every volume; idempotent."""
        self.listening.close()
        self.registry.close()
        if self.poll is not None:
            self.poll.close()
            self.poll = None
        for server in (self.control_server, self.metrics_server):
            if server is not None:
                server.close()
        self.control_server = self.metrics_server = None
        self.volumes.stop()
        if self.ana is not None:
            # A planned stop hands the groups over: no longer optimized here first, then
            # the leases are released for the survivors to take at once.
            self.ana.stop()
            for group in list(self.ana.owned):
                self.ana.set_owned(group, False, why="gateway stopping")
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None
        self.broker.stop()
        for sub in self.subsystems.values():
            flush_subsystem(sub)
            sub.close()
        self.subsystems.clear()
        self.namespaces.close()
        self.broker.close()
        self.reactor.close()

"""Applying a reload to the running target, beside its planner (:mod:`.reload`).

:meth:`Reloader.apply` takes a new configuration in two phases: everything that can fail
(opening new listeners and volumes, the gateway's checks with its group, a new metrics
port) first, undone if any of it fails; then the commit, which changes the running target
and is not expected to fail.  What it reads and changes of the target is
:class:`Reloadable`; the namespace changes it makes (retire, resize, tell the hosts) are
:mod:`.nschanges`'.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

from blockfabric.errors import BlockfabricError
from blockfabric.fabric.reactor import Reactor, spin_default
from blockfabric.protocol.admin import AsyncNotice
from blockfabric.protocol.opcodes import LogPageId
from blockfabric.sdnotify import sd_notify
from blockfabric.target import config as cfg
from blockfabric.target import metrics
from blockfabric.target import reload
from blockfabric.target.gateway import refuse_exclusive_lock
from blockfabric.target.namespace import Namespace, Subsystem
from blockfabric.target.registry import may_stay

if TYPE_CHECKING:
    from blockfabric.target.ana import Ana
    from blockfabric.target.control import ControlServer
    from blockfabric.target.gateway import Coordinator
    from blockfabric.target.listeners import Entry, Listeners
    from blockfabric.target.nschanges import NamespaceChanges
    from blockfabric.target.rbdvolume import VolumeWatch
    from blockfabric.target.registry import ControllerRegistry

log = logging.getLogger(__name__)


class Reloadable(Protocol):
    """What a reload reads and changes of the running target (the daemon,
    :class:`~blockfabric.target.server.Target`, is one)."""

    config: cfg.TargetConfig
    subsystems: dict[str, Subsystem]
    listening: Listeners
    registry: ControllerRegistry
    namespaces: NamespaceChanges
    volumes: VolumeWatch
    ana: Ana | None
    coordinator: Coordinator | None
    metrics_server: metrics.MetricsServer | None
    control_server: ControlServer | None
    reactor: Reactor                        # its busy-poll (spin_us) is reloadable
    genctr: int                             # the discovery log's generation counter
    reloads: int
    last_reload_error: str | None

    @property
    def draining(self) -> bool: ...

    def start_control(self) -> None: ...

    def metrics_text(self) -> str: ...

    def bind_reservations(self) -> None: ...

    def reload(self, new: cfg.TargetConfig) -> bool: ...


class Reloader:
    """Reloads of one running target (on its reactor)."""

    def __init__(self, target: Reloadable) -> None:
        self.target = target

    def reload_from(self, load: Callable[[], cfg.TargetConfig]) -> bool:
        """Load a new configuration and apply it; on any error keep the old one whole."""
        t = self.target
        if t.draining:
            log.warning("reload ignored: the target is stopping")
            return False
        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            try:
                new = load()
            except BlockfabricError as exc:
                self.failed(str(exc))
                return False
            return t.reload(new)        # Target.reload: apply, and say what a reload cannot
        finally:
            sd_notify("READY=1\nSTATUS=serving")

    def failed(self, error: str) -> None:
        self.target.last_reload_error = error
        log.error("reload rejected, the running configuration is unchanged: %s", error)

    def apply(self, new: cfg.TargetConfig) -> bool:
        """Apply ``new``: prepare everything that can fail, then commit (see reload.py)."""
        t = self.target
        plan = reload.plan(t.config, new)
        opened: list[Entry] = []
        subsystems: list[Subsystem] = []
        namespaces: dict[tuple[str, int], Namespace] = {}
        metrics_server = None
        gateway_prepared = False
        try:
            for change in plan.changed:
                for ns_conf in change.resized:
                    self._check_resize(change.new.nqn, ns_conf)
            for lconf in plan.added_listeners:
                opened.append(t.listening.open(lconf))
            for sconf in plan.added_subsystems:
                subsystems.append(Subsystem(sconf))
            for change in plan.changed:
                for ns_conf in change.added + change.replaced:
                    namespaces[change.new.nqn, ns_conf.nsid] = Namespace(ns_conf)
            if t.config.gateway is not None:
                refuse_exclusive_lock([*namespaces.values(), *(
                    ns for sub in subsystems for ns in sub.namespaces.values())])
            if plan.gateway_changed:
                self._prepare_gateway(new.gateway)
                gateway_prepared = True
            if plan.metrics_changed and new.metrics is not None:
                old = t.metrics_server
                if old is not None and old.port == new.metrics.port:
                    old.close()      # the same port: it must be free for the new one
                    t.metrics_server = None
                metrics_server = metrics.MetricsServer(new.metrics.address,
                                                       new.metrics.port, t.metrics_text)
        except (OSError, BlockfabricError, ValueError) as exc:
            for _l, _p, listener in opened:
                listener.close()
            for sub in subsystems:
                sub.close()
            for ns in namespaces.values():
                ns.close()
            if gateway_prepared and t.coordinator is not None and new.gateway is not None:
                t.coordinator.rollback(new.gateway)
            self.failed(f"{new.source}: {exc}")
            return False
        self._commit(plan, new, opened, subsystems, namespaces, metrics_server)
        t.reloads += 1
        t.last_reload_error = None
        t.volumes.poll_sizes()               # an image resized in the cluster
        log.info("reloaded %s: %s", new.source, plan.summary())
        return True

    def _prepare_gateway(self, gw: cfg.Gateway | None) -> None:
        """A reload changes the ``gateway`` section: refuse (ValueError, naming the key)
        what needs a restart, or a controller id range that leaves out a connected
        controller; register what can be applied with the group (GatewayError)."""
        t = self.target
        old = t.config.gateway
        refusal = reload.gateway_refusal(old, gw)
        if refusal is not None:
            raise ValueError(refusal)
        assert gw is not None and old is not None   # gateway_refusal refuses the rest
        if (gw.cntlid_min, gw.cntlid_max) != (old.cntlid_min, old.cntlid_max):
            outside = sorted(cntlid for cntlid, c in t.registry.controllers.items()
                             if not c.is_discovery
                             and not gw.cntlid_min <= cntlid <= gw.cntlid_max)
            if outside:
                raise ValueError(
                    f"gateway.cntlid_min/cntlid_max: {old.cntlid_min}-{old.cntlid_max} -> "
                    f"{gw.cntlid_min}-{gw.cntlid_max}: connected controller(s) "
                    f"{', '.join(map(str, outside))} would be outside it (a host may meet "
                    "their ids again on another gateway); disconnect those hosts first or "
                    "restart the gateway")
        if t.coordinator is not None:
            t.coordinator.prepare(gw)

    def _check_resize(self, nqn: str, ns_conf: cfg.Namespace) -> None:
        t = self.target
        ns = t.subsystems[nqn].namespaces[ns_conf.nsid]
        if ns_conf.backend == "file" and ns_conf.size is not None and ns_conf.size < ns.size:
            raise ValueError(f"subsystem {nqn} namespace {ns_conf.nsid}: a file volume cannot "
                             f"shrink ({ns.size} -> {ns_conf.size} bytes): data would be lost")

    def _commit(self, plan: reload.ReloadPlan, new: cfg.TargetConfig,
                opened: list[Entry], subsystems: list[Subsystem],
                namespaces: dict[tuple[str, int], Namespace],
                metrics_server: metrics.MetricsServer | None) -> None:
        """Apply a prepared plan; nothing here is expected to fail."""
        t = self.target
        removed = {reload.listener_key(x) for x in plan.removed_listeners}
        for entry in [e for e in t.listening.entries if reload.listener_key(e[0]) in removed]:
            t.listening.close_one(entry)
            log.info("stopped listening on %s", entry[0].endpoint)
        t.listening.rename(new.listeners)  # type: ignore[arg-type]  # (any sequence will do)
        for entry in opened:
            t.listening.add(entry)
        if t.config.spin_us != new.spin_us:
            t.reactor.set_spin(spin_default() if new.spin_us is None else new.spin_us)
            log.info("reactor spin: %s us", t.reactor.spin_us)
        t.config = new
        for nqn in plan.removed_subsystems:
            sub = t.subsystems.pop(nqn)
            t.registry.destroy_where(lambda c, s=sub: c.subsystem is s,  # type: ignore[misc]
                                     "subsystem removed")
            for ns in sub.namespaces.values():
                t.namespaces.retire(sub, ns)
            sub.namespaces.clear()
            log.info("subsystem removed: subnqn=%s", nqn)
        for sub in subsystems:
            t.subsystems[sub.nqn] = sub
            log.info("subsystem added: subnqn=%s namespaces=%d", sub.nqn, len(sub.namespaces))
        for change in plan.changed:
            self._commit_subsystem(change, namespaces)
        # Controllers that came in on a listener that no longer exists, or that no longer
        # exposes their subsystem, or whose host is no longer allowed (or must now
        # authenticate differently), go.
        t.registry.destroy_where(
            lambda c: not c.is_discovery and not may_stay(c, t.config, t.subsystems),
            "no longer allowed by the configuration")
        t.registry.destroy_where(lambda c: reload.listener_key(c.listener) in removed,
                                 "listener removed")
        if plan.control_socket_changed:
            if t.control_server is not None:
                t.control_server.close()
                t.control_server = None
            t.start_control()
        if plan.metrics_changed:
            if t.metrics_server is not None:
                t.metrics_server.close()
            t.metrics_server = metrics_server.start() if metrics_server is not None else None
        t.bind_reservations()    # new namespaces: their shared reservation state
        if t.ana is not None:
            if plan.gateway_changed:
                assert new.gateway is not None  # a reload never takes a gateway out
                t.ana.reconfigure(new.gateway)
                if t.coordinator is not None:
                    t.coordinator.reconfigure(new.gateway)
            if any(c.regrouped for c in plan.changed):
                t.ana.changed("namespaces moved to other ANA groups (reload)")
            else:
                t.ana.refresh()  # new namespaces: their ANA group and path state
        if plan.discovery_changed:
            t.genctr += 1
            for ctrl in list(t.registry.controllers.values()):
                if ctrl.is_discovery:
                    ctrl.notify(AsyncNotice.DISCOVERY_CHANGE, LogPageId.DISCOVERY)

    def _commit_subsystem(self, change: reload.SubsystemChange,
                          namespaces: dict[tuple[str, int], Namespace]) -> None:
        t = self.target
        sub = t.subsystems[change.new.nqn]
        sub.conf = change.new
        for nsid in change.removed + [n.nsid for n in change.replaced]:
            t.namespaces.retire(sub, sub.namespaces.pop(nsid))
        for ns_conf in change.added + change.replaced:
            sub.namespaces[ns_conf.nsid] = namespaces[sub.nqn, ns_conf.nsid]
        for ns_conf in change.flipped:
            ns = sub.namespaces[ns_conf.nsid]
            ns.conf = ns_conf
            ns.read_only = ns.backend.read_only = ns_conf.read_only
        for ns_conf in change.regrouped:    # Ana.refresh reads the group from ns.conf
            sub.namespaces[ns_conf.nsid].conf = ns_conf
        if change.changed_nsids:
            log.info("namespaces changed: subnqn=%s added=%s removed=%s replaced=%s "
                     "read_only=%s", sub.nqn, [n.nsid for n in change.added], change.removed,
                     [n.nsid for n in change.replaced], [n.nsid for n in change.flipped])
        t.namespaces.notify_ns_changed(sub, change.changed_nsids)
        for ns_conf in change.resized:
            t.namespaces.resize(sub, sub.namespaces[ns_conf.nsid], ns_conf)

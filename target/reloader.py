"""Applying a reload to the running target, beside its planner (:mod:`.reload`).

:meth:`Reloader.apply` takes a new configuration in two phases: everything that can fail
(opening new listeners and volumes, the gateway's checks with its group, a new metrics
port) first, undone if any of it fails; then the commit, which changes the running target
and is not expected to fail.  The namespace changes a running target makes (a namespace
retired once idle, a resize between commands, the hosts told by an event) are here too: the
RBD watch (an image resized in the cluster) uses them as a reload does.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.errors import BlockfabricError
from blockfabric.protocol.admin import AsyncNotice
from blockfabric.protocol.opcodes import LogPageId
from blockfabric.rdma import Listener
from blockfabric.target import config as cfg
from blockfabric.target import reload
from blockfabric.target import resvctl
from blockfabric.target.gateway import refuse_exclusive_lock
from blockfabric.target.metrics import MetricsServer
from blockfabric.target.namespace import Namespace, Subsystem

if TYPE_CHECKING:
    from blockfabric.target.controller import Controller
    from blockfabric.target.server import Target

log = logging.getLogger(__name__)

#: How long a resize or removal waits for a namespace's I/O to finish, and how often it looks.
IDLE_TIMEOUT = 10.0
IDLE_POLL = 0.005


def close_namespace(ns: Namespace) -> None:
    """Flush (an error is logged) and close."""
    try:
        ns.backend.flush()
    except OSError as exc:
        log.error("flushing nsid=%d: %s", ns.nsid, exc)
    ns.close()


class Reloader:
    """Reloads and namespace changes of one running :class:`Target` (on its reactor)."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def apply(self, new: cfg.TargetConfig) -> bool:
        """Apply ``new``: prepare everything that can fail, then commit (see reload.py)."""
        t = self.target
        plan = reload.plan(t.config, new)
        opened: list[tuple[cfg.Listener, str, Listener]] = []
        subsystems: list[Subsystem] = []
        namespaces: dict[tuple[str, int], Namespace] = {}
        metrics = None
        gateway_prepared = False
        try:
            for change in plan.changed:
                for ns_conf in change.resized:
                    self._check_resize(change.new.nqn, ns_conf)
            for lconf in plan.added_listeners:
                opened.append(t._open_listener(lconf))
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
                metrics = MetricsServer(new.metrics.address, new.metrics.port,
                                        t.metrics_text)
        except (OSError, BlockfabricError, ValueError) as exc:
            for _l, _p, listener in opened:
                listener.close()
            for sub in subsystems:
                sub.close()
            for ns in namespaces.values():
                ns.close()
            if gateway_prepared and t.coordinator is not None and new.gateway is not None:
                t.coordinator.rollback(new.gateway)
            t._reload_failed(f"{new.source}: {exc}")
            return False
        self._commit(plan, new, opened, subsystems, namespaces, metrics)
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
            outside = sorted(cntlid for cntlid, c in t.controllers.items()
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
                opened: list[tuple[cfg.Listener, str, Listener]], subsystems: list[Subsystem],
                namespaces: dict[tuple[str, int], Namespace],
                metrics: MetricsServer | None) -> None:
        """Apply a prepared plan; nothing here is expected to fail."""
        t = self.target
        removed = {reload.listener_key(x) for x in plan.removed_listeners}
        for entry in [e for e in t.listeners if reload.listener_key(e[0]) in removed]:
            t._close_listener(entry)
            log.info("stopped listening on %s", entry[0].endpoint)
        renamed = {reload.listener_key(x): x for x in new.listeners}
        t.listeners = [(renamed[reload.listener_key(lc)], p, li) for lc, p, li in t.listeners]
        for entry in opened:
            t._add_listener(entry)
        t.config = new
        for nqn in plan.removed_subsystems:
            sub = t.subsystems.pop(nqn)
            def in_removed(c: Controller, s: Subsystem = sub) -> bool:
                return c.subsystem is s
            t.destroy_where(in_removed, "subsystem removed")
            for ns in sub.namespaces.values():
                self.retire(sub, ns)
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
        t.destroy_where(lambda c: not c.is_discovery and not t.may_stay(c),
                            "no longer allowed by the configuration")
        t.destroy_where(lambda c: c.listener is not None
                        and reload.listener_key(c.listener) in removed, "listener removed")
        if plan.control_socket_changed:
            if t.control_server is not None:
                t.control_server.close()
                t.control_server = None
            t._start_control()
        if plan.metrics_changed:
            if t.metrics_server is not None:
                t.metrics_server.close()
            t.metrics_server = metrics.start() if metrics is not None else None
        resvctl.bind(t)          # new namespaces: their shared reservation state
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
            for ctrl in list(t.controllers.values()):
                if ctrl.is_discovery:
                    ctrl.notify(AsyncNotice.DISCOVERY_CHANGE, LogPageId.DISCOVERY)

    def _commit_subsystem(self, change: reload.SubsystemChange,
                          namespaces: dict[tuple[str, int], Namespace]) -> None:
        t = self.target
        sub = t.subsystems[change.new.nqn]
        sub.conf = change.new
        for nsid in change.removed + [n.nsid for n in change.replaced]:
            self.retire(sub, sub.namespaces.pop(nsid))
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
        self.notify_ns_changed(sub, change.changed_nsids)
        for ns_conf in change.resized:
            self.resize(sub, sub.namespaces[ns_conf.nsid], ns_conf)

    def notify_ns_changed(self, sub: Subsystem, nsids: tuple[int, ...]) -> None:
        """Namespace Attribute Changed to every controller of ``sub`` (spec sheet 10)."""
        t = self.target
        if not nsids:
            return
        for ctrl in list(t.controllers.values()):
            if ctrl.subsystem is sub and not ctrl.dead:
                ctrl.notify(AsyncNotice.NS_ATTR_CHANGED, LogPageId.CHANGED_NS, nsids)

    def retire(self, sub: Subsystem, ns: Namespace) -> None:
        """A namespace left the configuration: no new command finds it; close it once the
        commands already running on it are done."""
        t = self.target
        sub.retired.add(ns.stats)
        t._closing.append(ns)
        def close() -> None:
            close_namespace(ns)
            t._closing.remove(ns)
        self.when_idle(ns, close, f"closing subnqn={sub.nqn} nsid={ns.nsid}")

    def resize(self, sub: Subsystem, ns: Namespace, conf: cfg.Namespace) -> None:
        """Hold new commands, wait for those running, resize, release, tell the hosts."""
        ns.paused = True

        def resize() -> None:
            old = ns.size
            try:
                ns.resize(conf)
            except OSError as exc:
                log.error("resize failed: subnqn=%s nsid=%d: %s", sub.nqn, ns.nsid, exc)
            else:
                log.info("namespace resized: subnqn=%s nsid=%d %d -> %d bytes", sub.nqn,
                         ns.nsid, old, ns.size)
            finally:
                ns.paused = False
                held, ns.held = ns.held, []
                for run in held:
                    run()
            self.notify_ns_changed(sub, (ns.nsid,))

        self.when_idle(ns, resize, f"resizing subnqn={sub.nqn} nsid={ns.nsid}")

    def when_idle(self, ns: Namespace, action: Callable[[], Any], what: str,
                   timeout: float = IDLE_TIMEOUT) -> None:
        """Run ``action`` on the reactor once ``ns`` has no command in flight.  A
        BufferError means a posted RDMA operation still holds the volume's memory: retry."""
        t = self.target
        deadline = time.monotonic() + timeout

        def attempt() -> None:
            late = time.monotonic() >= deadline
            if ns.stats.inflight and not late:
                t.reactor.call_later(IDLE_POLL, attempt)
                return
            try:
                action()
            except BufferError:
                if late:
                    log.error("%s: the volume's memory is still in use after %.0f s", what,
                              timeout)
                    return
                t.reactor.call_later(IDLE_POLL, attempt)
        attempt()

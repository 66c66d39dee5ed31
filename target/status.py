"""The status snapshot: everything ``blockfabric-target status`` and the metrics show, copied
on the reactor into plain data (dicts, lists, numbers, strings) that another thread may read.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from blockfabric import __version__, numa
from blockfabric.target import reload

if TYPE_CHECKING:
    from blockfabric.target.server import Target


def snapshot(target: Target) -> dict[str, Any]:
    """``target``'s state now (call on its reactor); never a secret."""
    registry = target.registry
    config = target.config
    per_listener: dict[tuple, int] = {}
    for ctrl in registry.controllers.values():
        key = reload.listener_key(ctrl.listener)
        per_listener[key] = per_listener.get(key, 0) + 1
    subsystems = []
    for sub in target.subsystems.values():
        subsystems.append({
            "nqn": sub.nqn, "allow_any_host": sub.conf.allow_any_host,
            "hosts": list(sub.conf.host_nqns),     # never the secrets
            "listeners": [x.endpoint for x in config.listeners_for(sub.conf)],
            "controllers": sum(1 for c in registry.controllers.values() if c.subsystem is sub),
            "io": sub.stats(),
            "namespaces": [{"nsid": ns.nsid, "backend": ns.conf.backend,
                            "path": ns.conf.path, "size": ns.size,
                            "block_size": ns.block_size, "read_only": ns.read_only,
                            "io": ns.stats.copy()}
                           for ns in sorted(sub.namespaces.values(), key=lambda n: n.nsid)]})
    controllers = []
    for ctrl in sorted(registry.controllers.values(), key=lambda c: c.cntlid):
        controllers.append({
            "cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "subnqn": ctrl.subnqn,
            "discovery": ctrl.is_discovery, "provider": ctrl.provider,
            "listener": ctrl.listener.endpoint, "peer": ctrl.peer,
            "kato_ms": ctrl.kato_ms, "created": ctrl.created,
            "queues": [{"qid": qid, "depth": q.depth, "in_use": q.outstanding,
                        **_same_host(q)} for qid, q in sorted(ctrl.queues.items())],
            "io": ctrl.io.copy(), "admin_errors": ctrl.admin_errors,
            # DH-HMAC-CHAP: whether its queues must authenticate, and which have
            "auth_required": ctrl.auth_policy is not None,
            "authenticated_queues": sorted(q for q, a in ctrl.auth.items()
                                           if a.authenticated)})
    now = time.time()
    return {
        "version": __version__, "pid": os.getpid(), "config": config.source,
        "started": target.started, "uptime_s": now - target.started,
        "state": "draining" if target.draining else "serving",
        "reloads": target.reloads, "last_reload_error": target.last_reload_error,
        "genctr": target.genctr, "auth_failures": target.connector.auth_failures,
        "buffer_hold_disconnects": registry.hold_disconnects,
        "listeners": [{"endpoint": lc.endpoint, "name": lc.name, "address": lc.address,
                       "port": lc.port, "provider": p,
                       "controllers": per_listener.get(reload.listener_key(lc), 0)}
                      for lc, p, _li in target.listeners],
        "subsystems": subsystems, "controllers": controllers,
        "gateway": target.ana.snapshot() if target.ana is not None else None,
        # Where the reactor (this thread) runs and where registered memory lives
        # (memory: the regions here; where their pages are is read off the reactor,
        # Target._snapshot_here).
        "placement": {**target.placement.as_dict(), "reactor": numa.thread_report(),
                      "memory": numa.bound_regions()},
        # The reactor's busy-poll (blockfabric.fabric.reactor: spin_us, hits, misses, and
        # the waits the depth or the CPU pressure kept from spinning); the coordinator's.
        "spin": target.reactor.spin_stats(),
        # What hosts hold right now: a host that vanished must leave all of it at rest.
        # (With poll groups, PollGroups.snapshot adds what the workers hold.)
        "resources": resources(target.broker, len(registry.sessions), target.inflight()),
    }


def resources(broker: Any, connections: int, inflight: int) -> dict[str, Any]:
    """What the hosts hold in one process (the coordinator's or a poll-group worker's)."""
    bounce = broker.bounce_pools
    executor = broker.executor
    return {
        "connections": connections,
        "commands_in_flight": inflight,
        "bounce_buffers_in_use": sum(p.used for p in bounce),
        "bounce_waiters": sum(p.waiting for p in bounce),
        # per host (its fair share is what fairshare.py says)
        "bounce_buffers_by_host": _by_host(bounce),
        "backend_threads": {"busy": executor.used,
                            "waiting": executor.waiting,
                            "by_host": _by_host([executor])},
    }


def add_resources(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Add one process's :func:`resources` into ``total`` (the target's sums)."""
    for key in ("connections", "commands_in_flight", "bounce_buffers_in_use",
                "bounce_waiters"):
        total[key] += part.get(key, 0)
    _add_by_host(total["bounce_buffers_by_host"], part.get("bounce_buffers_by_host", {}))
    threads, theirs = total["backend_threads"], part.get("backend_threads", {})
    threads["busy"] += theirs.get("busy", 0)
    threads["waiting"] += theirs.get("waiting", 0)
    _add_by_host(threads["by_host"], theirs.get("by_host", {}))


def _add_by_host(total: dict[str, int], part: dict[str, int]) -> None:
    for host, n in part.items():
        total[host] = total.get(host, 0) + n


def _by_host(pools: Any) -> dict[str, int]:
    """Units held per host NQN, summed over ``pools``."""
    out: dict[str, int] = {}
    for pool in pools:
        for h in pool.hosts.values():
            if h.held:
                out[h.key] = out.get(h.key, 0) + h.held
    return out


def _same_host(queue: object) -> dict[str, object]:
    """A soft-RDMA queue of a host on this machine (blockfabric.rdma.soft: data through
    shared memory): ``same_host`` and how many of the host's regions it maps."""
    qp = getattr(queue, "qp", None)
    if not getattr(qp, "shm", False):
        return {}
    return {"same_host": True, "shared_regions": qp.shared_regions}  # type: ignore[union-attr]

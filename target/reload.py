"""What a configuration reload changes: a pure diff of the old and the new configuration.

The reloader applies the plan in two phases (see ``Reloader.apply`` in reloader.py): everything
that can fail (opening new listeners and volumes, refusing what cannot be done) happens before
anything running is touched, so a reload is taken whole or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blockfabric.target import config as cfg


def listener_key(listener: cfg.Listener) -> tuple[str, str, str, int]:
    """A listener's identity: renaming it keeps its socket and its connections."""
    return (listener.transport, listener.provider, listener.address, listener.port)


def same_volume(old: cfg.Namespace, new: cfg.Namespace) -> bool:
    """Whether ``new`` is the same volume as ``old`` (size, read_only and the ANA group may
    differ; any change of an rbd section, another image or other client settings, reopens
    it)."""
    return (old.backend, old.path, old.rbd, old.block_size, old.uuid, old.nguid) == \
        (new.backend, new.path, new.rbd, new.block_size, new.uuid, new.nguid)


@dataclass
class SubsystemChange:
    """How one subsystem present in both configurations changes."""

    old: cfg.Subsystem
    new: cfg.Subsystem
    added: list[cfg.Namespace] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    #: A different volume under the same nsid (backend, path, rbd, block size or ids changed):
    #: the old one is removed and the new one added.
    replaced: list[cfg.Namespace] = field(default_factory=list)
    resized: list[cfg.Namespace] = field(default_factory=list)
    #: read_only flipped on a memory volume (a file volume is reopened: ``replaced``).
    flipped: list[cfg.Namespace] = field(default_factory=list)
    #: The same volume moved to another ANA group (hosts hear of it by an ANA change event).
    regrouped: list[cfg.Namespace] = field(default_factory=list)

    @property
    def access_changed(self) -> bool:
        """The allow-list or the listeners exposing it changed."""
        return (self.old.allow_any_host, self.old.hosts, self.old.listeners) != \
            (self.new.allow_any_host, self.new.hosts, self.new.listeners)

    @property
    def changed_nsids(self) -> tuple[int, ...]:
        """Namespaces whose change hosts hear of at once (resizes: when done)."""
        return tuple(sorted({n.nsid for n in self.added + self.replaced + self.flipped}
                            | set(self.removed)))


@dataclass
class ReloadPlan:
    added_listeners: list[cfg.Listener] = field(default_factory=list)
    removed_listeners: list[cfg.Listener] = field(default_factory=list)
    added_subsystems: list[cfg.Subsystem] = field(default_factory=list)
    removed_subsystems: list[str] = field(default_factory=list)
    changed: list[SubsystemChange] = field(default_factory=list)
    metrics_changed: bool = False
    control_socket_changed: bool = False
    #: The ``gateway`` section differs (Reloader.apply applies what it safely can, refuses
    #: the rest: see gateway_refusal).
    gateway_changed: bool = False

    @property
    def discovery_changed(self) -> bool:
        """Whether a discovery log page may read differently (hosts must hear of it)."""
        return bool(self.added_listeners or self.removed_listeners or self.added_subsystems
                    or self.removed_subsystems or any(c.access_changed for c in self.changed))

    def summary(self) -> str:
        parts = []
        for what, items in (("listeners added", self.added_listeners),
                            ("listeners removed", self.removed_listeners),
                            ("subsystems added", self.added_subsystems),
                            ("subsystems removed", self.removed_subsystems)):
            if items:
                parts.append(f"{what}={len(items)}")
        for c in self.changed:
            bits = [f"{k}={','.join(str(n.nsid) if hasattr(n, 'nsid') else str(n) for n in v)}"
                    for k, v in (("ns_added", c.added), ("ns_removed", c.removed),
                                 ("ns_replaced", c.replaced), ("ns_resized", c.resized),
                                 ("ns_read_only", c.flipped),
                                 ("ns_ana_group", c.regrouped)) if v]
            if c.access_changed:
                bits.append("access")
            if bits:
                parts.append(f"subnqn={c.new.nqn} " + " ".join(bits))
        if self.gateway_changed:
            parts.append("gateway")
        return "; ".join(parts) or "no changes"


def plan(old: cfg.TargetConfig, new: cfg.TargetConfig) -> ReloadPlan:
    """The changes that turn ``old`` into ``new``."""
    out = ReloadPlan()
    old_l = {listener_key(x): x for x in old.listeners}
    new_l = {listener_key(x): x for x in new.listeners}
    out.added_listeners = [x for k, x in new_l.items() if k not in old_l]
    out.removed_listeners = [x for k, x in old_l.items() if k not in new_l]
    old_s = {s.nqn: s for s in old.subsystems}
    new_s = {s.nqn: s for s in new.subsystems}
    out.added_subsystems = [s for n, s in new_s.items() if n not in old_s]
    out.removed_subsystems = [n for n in old_s if n not in new_s]
    for nqn, new_sub in new_s.items():
        old_sub = old_s.get(nqn)
        if old_sub is None or old_sub == new_sub:
            continue
        change = SubsystemChange(old_sub, new_sub)
        old_ns = {n.nsid: n for n in old_sub.namespaces}
        new_ns = {n.nsid: n for n in new_sub.namespaces}
        change.removed = [nsid for nsid in old_ns if nsid not in new_ns]
        for nsid, ns in new_ns.items():
            before = old_ns.get(nsid)
            if before is None:
                change.added.append(ns)
            elif before == ns:
                continue
            elif not same_volume(before, ns) or (before.read_only != ns.read_only
                                                 and ns.backend in ("file", "rbd")):
                change.replaced.append(ns)
            else:
                if before.read_only != ns.read_only:
                    change.flipped.append(ns)
                if before.size != ns.size:
                    change.resized.append(ns)
                if before.ana_group_id != ns.ana_group_id:
                    change.regrouped.append(ns)
        out.changed.append(change)
    out.metrics_changed = old.metrics != new.metrics
    out.control_socket_changed = old.control_socket != new.control_socket
    out.gateway_changed = old.gateway != new.gateway
    return out


def gateway_refusal(old: cfg.Gateway | None, new: cfg.Gateway | None) -> str | None:
    """Why a reload cannot change the ``gateway`` section from ``old`` to ``new`` without a
    restart, naming the key; None when what changed can be applied to the running gateway
    (its home ANA groups, ``others``, ``lease``, ``renew_interval``, and its controller id
    range, which the target checks against its controllers and the group)."""
    restart = "restart the gateway to change it (systemctl restart blockfabric-target)"
    if old is None and new is not None:
        return f"gateway: a reload cannot make a standalone target a gateway: {restart}"
    if old is not None and new is None:
        return f"gateway: a reload cannot take a gateway out of its group: {restart}"
    if old is None or new is None:
        return None
    for key, why in (("name", "this gateway's identity in its group (its leases, its "
                      "registered controller ids)"),
                     ("group", "the gateways it coordinates with and their RADOS objects"),
                     ("ceph", "the Ceph connection it coordinates through (unset, it is the "
                      "first rbd namespace's pool, cluster, client and timeouts)")):
        before, after = getattr(old, key), getattr(new, key)
        if before != after:
            shown = (before, after) if key != "ceph" else (_ceph(before), _ceph(after))
            return (f"gateway.{key}: {shown[0]} -> {shown[1]}: cannot change on reload, it is "
                    f"{why}; {restart}")
    return None


def _ceph(c: cfg.GatewayCeph | None) -> str:
    if c is None:
        return "-"
    return (f"{c.client}@{c.pool}{'/' + c.namespace if c.namespace else ''} ({c.ceph_conf}, "
            f"connect_timeout {c.connect_timeout}, op_timeout {c.op_timeout})")

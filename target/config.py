"""The target's configuration: one model that loads from YAML, validates, and dumps back.

The engine underneath (field kinds, key paths, errors) is :mod:`blockfabric.schema`, shared
with the initiator's configuration.  This module owns the whole (:class:`TargetConfig`: the
checks that need more than one section, loading and dumping); the sections are in
:mod:`.config_subsystems` (subsystems, hosts, namespaces, RBD images, the gateway group) and
:mod:`.config_serving` (listeners, limits, keep-alive, metrics, placement kinds), and every
name of theirs is importable from here too.

In the manner of nvmetcli, each part of the configuration is a class (``Listener``,
``Subsystem``, ``Namespace``, ``Limits``, ``KeepAlive``, ``Metrics``, ``TargetConfig``) that is
built from a mapping and dumps itself back.  Each field is declared once, with its default and
its *kind* (how a YAML value is read, checked and written back), so load and dump cannot drift
apart and every default lives in exactly one place: the field declaration.

A bad configuration fails at load with :class:`blockfabric.errors.ConfigError`, naming the file,
the key path (``subsystems[0].namespaces[1].size``) and what was expected; nothing starts
half-configured.  Unknown keys are errors (with a did-you-mean hint), because a misspelt
optional key would otherwise be silently ignored.

``to_dict()`` returns the *effective* configuration: defaults filled in and derived values
(serial, namespace uuid/nguid) written out, so that what ``blockfabric-target check`` prints is
what the daemon will run.  Keys whose value is unset (``None``) are left out.

Semantics that are not obvious from the schema:

- Listeners on port 8009 are ordinary listeners; the discovery subsystem is served on every
  listener.  ``provider: auto`` picks verbs when an RDMA device owns the address, else soft.
- ``subsystems[].listeners`` restricts which listeners expose a subsystem; each entry names a
  listener by its ``name`` or by ``address:port`` (``[v6addr]:port``).  Absent: all listeners.
- ``serial`` defaults to 20 hex digits derived from the NQN; a namespace's ``uuid`` and
  ``nguid`` default to values derived from the subsystem NQN and the nsid.  They are therefore
  stable across restarts (hosts key multipath and udev names on them) without being stored.
- ``limits.connect_timeout`` (seconds) bounds how long an accepted queue may go without a
  completed Fabrics Connect; then it is disconnected and its slot in
  ``limits.max_connections_per_host`` freed.
- ``limits.auth_timeout`` (seconds) bounds how long a queue that must authenticate may go
  unauthenticated after its Connect (and a failed exchange may wait for its Failure1 to be
  fetched); then its controller ends, counted as a failed authentication.
  ``limits.auth_max_failures`` failed authentications from one peer address within
  ``limits.auth_failure_window`` seconds make the target answer that address's Connects
  that would authenticate with Controller Busy for ``limits.auth_backoff`` seconds.
- ``keep_alive.kas_ms`` is the keep-alive granularity the controller reports (Identify KAS, in
  units of 100 ms); ``keep_alive.max_timeout_ms`` caps the keep-alive timeout a host may ask
  for in Connect or Set Features (a larger request is lowered to it), and is also how long a
  controller whose host asked for none (KATO 0) may go without any command before it is
  ended (a discovery controller: 120 s, as nvmet, or this cap if lower).
- ``metrics`` is off unless given; ``metrics.address`` defaults to loopback.
- File backends need an absolute ``path``; two namespaces may not share one.
- ``backend: rbd`` takes its volume from the ``rbd`` section (a Ceph RBD image) and its size
  from the image, so it has no ``size``; two namespaces may not share one image.  See
  docs/ceph.md.
- ``gateway`` makes this target one gateway of a group that exports the same subsystems and
  RBD images: identifiers derive from the NQN and nsid (the same on every gateway), controller
  ids come from ``cntlid_min``..``cntlid_max`` (checked disjoint from the other gateways' at
  start, through Ceph), and each namespace's ``ana_group`` (default derived from the nsid) is
  optimized on the gateway holding that group's lease in ``gateway.ceph.pool`` (default: the
  first rbd namespace's cluster and pool).  See target/gateway.py and docs/ceph.md.
- ``subsystems[].hosts`` entries are host NQNs, or mappings with the ``nqn`` and the host's
  DH-HMAC-CHAP settings (``dhchap_secret`` makes that host authenticate on every queue;
  ``dhchap_ctrl_secret`` lets it authenticate the controller too; ``dhchap_hash`` and
  ``dhchap_dhgroup`` as nvmet's configfs attributes of the same names).  A secret is never
  echoed in an error message; ``to_dict()`` (and so ``check``) does write it out.
- ``numa_node``, ``cpus`` and ``numa_memory`` place the daemon (docs/numa.md): a node or a
  CPU this machine does not have is refused at load (read from sysfs, or from
  ``BLOCKFABRIC_SYSFS``); ``auto`` asks the listeners' NICs only at start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any, ClassVar

import yaml

from blockfabric import numa
from blockfabric.fileutil import atomic_write
# Model, Nested, ListOf: also config.X for configref
from blockfabric.schema import (AbsPath, Choice, Int, ListOf, Model, Nested,  # noqa: F401
                                Plain, Where, parse_yaml, read_text, setting, unique)
# The section models live in two modules, what is exported and how it is served; every name
# is also this module's (config.Listener, config.Namespace...), as callers and tests use it.
from blockfabric.target.config_serving import (  # noqa: F401
    NAME, NVME_RDMA_PORT, PROVIDERS, REACTORS_MAX, UNSENT_SLACK, CpuList, KeepAlive, Limits,
    Listener, Metrics, NumaNode, Reactors, usable_cpus)
from blockfabric.target.config_subsystems import (  # noqa: F401
    ANA_GROUP_MAX, ANA_OTHERS, BACKENDS, DHGROUP_CHOICES, DISCOVERY_NQN, HMAC_CHOICES, MAX_CNTLID,
    MAX_NSID, Gateway, GatewayCeph, Host, HostEntry, Namespace, Rbd, Subsystem)

DISCOVERY_PORT = 8009
DEFAULT_CONTROL_SOCKET = "/run/blockfabric/target.sock"
#: The embedded default configuration, shipped inside the package (same text as
#: configs/target.yaml in the source tree).
DEFAULT_CONFIG_RESOURCE = "default.yaml"


@dataclass(frozen=True, kw_only=True)
class TargetConfig(Model):
    """The whole target configuration."""

    WHAT: ClassVar[str] = "a target configuration"

    listeners: tuple[Listener, ...] = setting(ListOf(Nested(Listener), min_items=1))
    subsystems: tuple[Subsystem, ...] = setting(ListOf(Nested(Subsystem)), ())
    limits: Limits = setting(Nested(Limits), Limits())
    keep_alive: KeepAlive = setting(Nested(KeepAlive), KeepAlive())
    metrics: Metrics | None = setting(Nested(Metrics), None)
    #: This target as a member of a gateway group (ANA, failover through Ceph); unset: a
    #: standalone target.
    gateway: Gateway | None = setting(Nested(Gateway), None)
    control_socket: str = setting(AbsPath(), DEFAULT_CONTROL_SOCKET)
    #: The NUMA node the reactor and its registered memory are placed on (docs/numa.md).
    #: auto: the node of the listeners' NICs when they agree and the machine has more than
    #: one node; none: no memory placement.  Applied at start (a reload does not move it).
    numa_node: str | int = setting(NumaNode(), "auto")
    #: CPUs the target's threads are pinned to (unset: the numa_node's, or any).
    cpus: frozenset[int] | None = setting(CpuList(), None)
    #: How memory is held to numa_node: preferred (there while it has room) or bind (only
    #: there: allocations fail when the node is full).
    numa_memory: str = setting(Choice(*numa.POLICIES), "preferred")
    #: Microseconds the reactor busy-polls for an answer it waits for before it sleeps
    #: (adaptive: spins that find nothing shrink it, down to none; see
    #: docs/performance.md).  0: never spin; unset: $BLOCKFABRIC_REACTOR_SPIN_US, else 100.
    spin_us: int | None = setting(Int(0, 10_000, unit="microseconds"), None)
    #: Poll groups: processes that each serve I/O queues on a reactor of their own, so the
    #: target uses that many cores (docs/scaling.md).  1: one process, as before; ``auto``:
    #: one per CPU the process may run on.  NVMe/TCP and RDMA (soft and verbs) I/O queues
    #: are spread over the groups (a subsystem with an RBD image that has exclusive-lock
    #: keeps its queues in the main process); a reload cannot change it.
    reactors: int | str = setting(Reactors(), 1)
    #: The file this configuration came from (for messages; not part of the configuration).
    source: str = dataclasses.field(default="<dict>", compare=False)

    def _finish(self, where: Where) -> TargetConfig:
        lst = where.at("listeners")
        unique(((lst.index(i), (ipaddress.ip_address(x.address), x.port), x.endpoint)
                 for i, x in enumerate(self.listeners)), "an address:port")
        unique(((lst.index(i).at("name"), x.name, x.name)
                 for i, x in enumerate(self.listeners) if x.name), "a listener name")
        for i, x in enumerate(self.listeners):
            for other in self.listeners[:i]:
                if other.port == x.port and (other.is_wildcard or x.is_wildcard) and (
                        ":" in other.address) == (":" in x.address):
                    lst.index(i).fail(f"an address:port that does not overlap {other.endpoint} "
                                      "(a wildcard address takes the port on every address)",
                                      x.endpoint)
        for i, x in enumerate(self.listeners):
            for attr in ("max_io_queues", "queue_size"):
                most = getattr(self.limits, attr)
                if getattr(x, attr) is not None and getattr(x, attr) > most:
                    lst.index(i).at(attr).fail(f"at most limits.{attr} ({most})",
                                               getattr(x, attr))
        names = {x.name for x in self.listeners if x.name} | {x.endpoint for x in self.listeners}
        subs = where.at("subsystems")
        for i, sub in enumerate(self.subsystems):
            for j, ref in enumerate(sub.listeners or ()):
                if ref not in names:
                    subs.index(i).at("listeners").index(j).fail(
                        f"the name or address:port of a listener ({', '.join(sorted(names))})",
                        ref)
        unique(((subs.index(i).at("nqn"), s.nqn, s.nqn)
                 for i, s in enumerate(self.subsystems)), "an NQN")
        for attr in ("uuid", "nguid", "path", "rbd_image"):
            unique(((subs.index(i).at("namespaces").index(j).at(attr), getattr(ns, attr),
                      getattr(ns, attr))
                     for i, s in enumerate(self.subsystems)
                     for j, ns in enumerate(s.namespaces) if getattr(ns, attr) is not None),
                    f"a namespace {attr}")
        if self.gateway is not None and self.gateway.ceph is None:
            rbd = next((ns.rbd for s in self.subsystems for ns in s.namespaces if ns.rbd), None)
            if rbd is None:
                where.at("gateway").at("ceph").fail(
                    "a mapping (no rbd namespace to take the pool and cluster from)")
            ceph = GatewayCeph(pool=rbd.pool, namespace=rbd.namespace, ceph_conf=rbd.ceph_conf,
                               client=rbd.client, keyring=rbd.keyring,
                               connect_timeout=rbd.connect_timeout,
                               op_timeout=min(rbd.op_timeout, 5))
            self = dataclasses.replace(self, gateway=dataclasses.replace(self.gateway,
                                                                         ceph=ceph))
        if self.numa_node not in ("auto", "none") or self.cpus is not None:
            try:      # nodes and CPUs of this machine (without asking the NICs)
                numa.resolve(self.numa_node, self.cpus)
            except numa.PlacementError as exc:
                where.at(exc.key).fail(exc.expected, Plain(str(exc.got)))
        return dataclasses.replace(self, source=where.file)

    @property
    def reactor_count(self) -> int:
        """How many poll groups ``reactors`` means on this machine."""
        return usable_cpus() if self.reactors == "auto" else int(self.reactors)

    @classmethod
    def from_dict(cls, data: Any, path: str = "<dict>") -> TargetConfig:
        """Build and validate a configuration from plain data (as YAML loads it)."""
        if data is None:
            Where(path).fail(f"a mapping ({cls.WHAT})", Plain("an empty file"))
        return cls.load_from(data, Where(path))

    def listeners_for(self, subsystem: Subsystem) -> tuple[Listener, ...]:
        """The listeners that expose ``subsystem`` (all, unless it names some)."""
        if subsystem.listeners is None:
            return self.listeners
        refs = set(subsystem.listeners)
        return tuple(x for x in self.listeners if x.name in refs or x.endpoint in refs)

    def subsystem(self, nqn: str) -> Subsystem | None:
        return next((s for s in self.subsystems if s.nqn == nqn), None)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the effective configuration to ``path`` atomically (as nvmetcli does)."""
        atomic_write(path, self.to_yaml())


def loads(text: str, path: str = "<string>") -> TargetConfig:
    """Load and validate a configuration from YAML text (``path`` is used in messages)."""
    return TargetConfig.from_dict(parse_yaml(text, path), path=path)


def load(path: str | os.PathLike[str]) -> TargetConfig:
    """Load and validate the configuration file at ``path``."""
    return loads(read_text(path), os.fspath(path))


def default_text() -> str:
    """The YAML text of the embedded default configuration."""
    return resources.files(__package__).joinpath(DEFAULT_CONFIG_RESOURCE).read_text("utf-8")


def default_config() -> TargetConfig:
    """The embedded default: a 1 GiB ramdisk on the soft provider at 127.0.0.1:4420."""
    return loads(default_text(), f"<embedded {DEFAULT_CONFIG_RESOURCE}>")

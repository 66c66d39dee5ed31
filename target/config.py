"""The target's configuration: one model that loads from YAML, validates, and dumps back.

The engine underneath (field kinds, key paths, errors) is :mod:`blockfabric.schema`, shared
with the initiator's configuration.

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
import hashlib
import ipaddress
import os
import re
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any, ClassVar

import yaml

from blockfabric import numa
from blockfabric.fileutil import atomic_write
from blockfabric.protocol.auth import DHGROUP_NAMES, HASH_NAMES, SUPPORTED_DHGROUPS, Secret
from blockfabric.schema import (NQN, AbsPath, Address, Bool, Choice, DhchapSecret, Int, Kind,
                                ListOf, Model, Nested, Plain, Size, Text, Where, parse_yaml, read_text,
                                setting, unique)
from blockfabric.sizes import KiB, MiB, format_size

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
NVME_RDMA_PORT = 4420
DISCOVERY_PORT = 8009
MAX_NSID = 1024          # nvmet's default NN; also the length of the active namespace list
BACKENDS = ("ramdisk", "file", "null", "rbd")
#: ANA group ids run 1..ANA_GROUP_MAX (Identify ANAGRPMAX and NANAGRPID, as nvmet's 128).
ANA_GROUP_MAX = 128
#: Controller ids a target may hand out (nvmet's range; 0xFFF0.. are reserved).
MAX_CNTLID = 0xFFEF
#: What a gateway reports for the ANA groups it does not own.
ANA_OTHERS = ("non-optimized", "inaccessible")
PROVIDERS = ("auto", "soft", "verbs")
#: The most poll groups (``reactors``) a target runs.
REACTORS_MAX = 256
DEFAULT_CONTROL_SOCKET = "/run/blockfabric/target.sock"
#: The embedded default configuration, shipped inside the package (same text as
#: configs/target.yaml in the source tree).
DEFAULT_CONFIG_RESOURCE = "default.yaml"

# Stable derived identifiers: uuid5 under a fixed namespace of our own.
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "blockfabric.io")

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NGUID_RE = re.compile(r"[0-9a-fA-F]{32}")
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                      r"[0-9a-fA-F]{12}")

class Reactors(Kind):
    """``reactors``: a number of poll groups, or ``auto`` (one per CPU this process may
    run on)."""

    expected = f"an integer from 1 to {REACTORS_MAX} or \"auto\" (one per usable CPU)"

    def load(self, value: Any, where: Where) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= REACTORS_MAX:
            where.fail(self.expected, value)
        return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a systemd CPUAffinity=)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class NumaNode(Kind):
    expected = "auto, none or a NUMA node number"

    def load(self, value: Any, where: Where) -> str | int:
        if value in ("auto", "none") or (isinstance(value, int) and not isinstance(value, bool)
                                         and 0 <= value < 1024):
            return value
        where.fail(self.expected, value)


class CpuList(Kind):
    expected = 'a CPU list in the kernel\'s syntax ("0-3,8", as taskset -c)'

    def load(self, value: Any, where: Where) -> frozenset[int]:
        try:
            cpus = numa.parse_cpulist(value) if isinstance(value, (str, int)) else None
        except ValueError as exc:
            where.fail(f"{self.expected}; {exc}", value)
        if not cpus:
            where.fail(self.expected, value)
        return cpus

    def dump(self, value: frozenset[int]) -> str:
        return numa.format_cpulist(value)


NAME = Text("a name of 1 to 64 letters, digits, '_', '.' or '-'", _NAME_RE)
HMAC_CHOICES = tuple(f"hmac({name})" for name in HASH_NAMES.values())
DHGROUP_CHOICES = tuple(DHGROUP_NAMES[g] for g in SUPPORTED_DHGROUPS)


def _ascii(max_chars: int) -> Text:
    return Text(f"1 to {max_chars} printable ASCII characters",
                re.compile(f"[\\x20-\\x7e]{{1,{max_chars}}}"))


@dataclass(frozen=True, kw_only=True)
class Listener(Model):
    """An address the target accepts connections on: NVMe-oF over RDMA (``provider``: the
    soft provider or verbs) or NVMe/TCP (``transport: tcp``; ``provider`` does not apply).
    Both transports serve the same subsystems, controllers, ACLs and authentication."""

    WHAT: ClassVar[str] = "a listener"

    transport: str = setting(Choice("rdma", "tcp"), "rdma")
    provider: str = setting(Choice(*PROVIDERS), "auto")
    address: str = setting(Address())
    port: int = setting(Int(1, 65535), NVME_RDMA_PORT)
    name: str | None = setting(NAME, None)
    #: NVMe/TCP only: CPDA in ICResp, the alignment ((cpda + 1) x 4 bytes) the host must
    #: pad the data of its capsules and H2CData PDUs to; 0: none (as every target does).
    cpda: int = setting(Int(0, 31), 0)
    #: Queues (admin and I/O, every host) connected through this listener at once; a
    #: Connect past it is refused with Controller Busy (0x181).  Unset: only
    #: limits.max_connections_per_host and limits.max_unconnected_queues apply.
    max_connections: int | None = setting(Int(1, 65535), None)
    #: I/O queues per controller created through this listener (at most
    #: limits.max_io_queues): Set Features Number of Queues grants no more, a Connect for a
    #: higher qid gets Connect Invalid Parameters (0x182, IPO 42).
    max_io_queues: int | None = setting(Int(1, 128), None)
    #: Queue depth of controllers created through this listener (at most limits.queue_size):
    #: advertised in CAP.MQES, a Connect asking more gets Connect Invalid Parameters (0x182,
    #: IPO 44).
    queue_size: int | None = setting(Int(16, 1024), None)

    @property
    def endpoint(self) -> str:
        """``address:port``, with an IPv6 address in brackets."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        return ipaddress.ip_address(self.address).is_unspecified

    def _finish(self, where: Where) -> Listener:
        if self.cpda and self.transport != "tcp":
            where.at("cpda").fail("0 (cpda applies to NVMe/TCP listeners)", self.cpda)
        return self


_CEPH_NAME_RE = re.compile(r"[A-Za-z0-9_.+-][A-Za-z0-9_.+@-]{0,254}")
_CEPH_CLIENT_RE = re.compile(r"client\.[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, kw_only=True)
class Rbd(Model):
    """The Ceph RBD image behind a ``backend: rbd`` namespace, and how to reach the cluster.
    The timeouts are given to librados as its own options (``client mount timeout``,
    ``rados mon op timeout``, ``rados osd op timeout``), so a cluster that is down fails
    start-up or a command within them instead of hanging."""

    WHAT: ClassVar[str] = "the Ceph RBD image of a backend: rbd namespace"

    pool: str = setting(Text("a Ceph pool name", _CEPH_NAME_RE))
    image: str = setting(Text("an RBD image name", _CEPH_NAME_RE))
    #: RADOS namespace inside the pool (rbd --namespace); unset: the pool's default.
    namespace: str | None = setting(Text("a RADOS namespace name", _CEPH_NAME_RE), None)
    ceph_conf: str = setting(AbsPath(), "/etc/ceph/ceph.conf")
    #: The Ceph user the target connects as (its caps: docs/ceph.md).
    client: str = setting(Text("client.NAME (a Ceph user)", _CEPH_CLIENT_RE), "client.admin")
    #: Unset: whatever ceph_conf says (by default /etc/ceph/ceph.CLIENT.keyring).
    keyring: str | None = setting(AbsPath(), None)
    #: Seconds to reach the monitors and open the image at start or reload.
    connect_timeout: int = setting(Int(1, 3600, unit="seconds"), 10)
    #: Seconds one read, write, flush or discard may wait for the cluster before it fails
    #: (and the namespace is reported unavailable: docs/ceph.md).
    op_timeout: int = setting(Int(1, 3600, unit="seconds"), 30)
    #: Seconds between checks of the image size (a resize reaches hosts as a Namespace
    #: Attribute Changed event); 0: only on reload.
    size_poll_interval: int = setting(Int(0, 3600, unit="seconds"), 5)

    @property
    def spec(self) -> str:
        """pool[/namespace]/image, as the rbd command names it."""
        ns = f"{self.namespace}/" if self.namespace else ""
        return f"{self.pool}/{ns}{self.image}"


_NS_SIZE = Size(1)
_NS_SIZE.expected += "; required except for backend rbd (whose size is the image's)"


@dataclass(frozen=True, kw_only=True)
class Namespace(Model):
    """A volume exported as an NVMe namespace."""

    WHAT: ClassVar[str] = "a namespace"

    nsid: int = setting(Int(1, MAX_NSID))
    backend: str = setting(Choice(*BACKENDS))
    #: Required except for backend rbd (whose size is the image's).
    size: int | None = setting(_NS_SIZE, None)
    block_size: int = setting(Choice(512, 4096), 4096)
    path: str | None = setting(AbsPath(), None)
    rbd: Rbd | None = setting(Nested(Rbd), None)
    read_only: bool = setting(Bool(), False)
    uuid: str | None = setting(Text("a UUID (8-4-4-4-12 hex digits)", _UUID_RE,
                                   normalize=str.lower), None)
    nguid: str | None = setting(Text("an NGUID (32 hex digits, not all zero)", _NGUID_RE,
                                    normalize=str.lower), None)
    #: The ANA group this namespace belongs to (with a ``gateway`` section); unset: derived
    #: from the nsid, 1 + (nsid - 1) % 128, so every gateway of a group derives the same.
    ana_group: int | None = setting(Int(1, ANA_GROUP_MAX), None)

    def _finish(self, where: Where) -> Namespace:
        if self.backend == "file" and self.path is None:
            where.at("path").fail("an absolute path (the file backend needs one)")
        if self.backend != "file" and self.path is not None:
            where.at("path").fail(f"no path for backend {self.backend} (only file uses one)",
                                  self.path)
        if self.backend == "rbd":
            if self.rbd is None:
                where.at("rbd").fail("a mapping (the rbd backend needs pool and image)")
            if self.size is not None:
                where.at("size").fail("no size for backend rbd (the image's size is used)",
                                      format_size(self.size))
            return self._ids_checked(where)
        if self.rbd is not None:
            where.at("rbd").fail(f"no rbd section for backend {self.backend}", "a mapping")
        if self.size is None:
            where.at("size").fail("a size (every backend but rbd needs one)")
        if self.size % self.block_size:
            where.at("size").fail(f"a multiple of block_size {self.block_size}",
                                  format_size(self.size))
        return self._ids_checked(where)

    def _ids_checked(self, where: Where) -> Namespace:
        if self.nguid is not None and int(self.nguid, 16) == 0:
            where.at("nguid").fail("an NGUID that is not all zero (zero means none)", self.nguid)
        return self

    @property
    def nblocks(self) -> int:
        return (self.size or 0) // self.block_size

    @property
    def ana_group_id(self) -> int:
        """The ANA group: as configured, else derived from the nsid."""
        return self.ana_group or 1 + (self.nsid - 1) % ANA_GROUP_MAX

    @property
    def rbd_image(self) -> str | None:
        """The RBD image (pool[/namespace]/image), for backend rbd; else None."""
        return self.rbd.spec if self.rbd is not None else None

    def with_ids(self, subnqn: str) -> Namespace:
        """This namespace with uuid/nguid filled in where unset, derived from the subsystem
        NQN and the nsid so that they are the same on every start."""
        name = f"{subnqn}/{self.nsid}"
        ids: dict[str, Any] = {}
        if self.uuid is None:
            ids["uuid"] = str(uuid.uuid5(_ID_NAMESPACE, name))
        if self.nguid is None:
            ids["nguid"] = hashlib.sha256(b"nguid\0" + name.encode()).hexdigest()[:32]
        return dataclasses.replace(self, **ids) if ids else self


@dataclass(frozen=True, kw_only=True)
class Host(Model):
    """A host allowed on a subsystem, and how it must authenticate (if at all)."""

    WHAT: ClassVar[str] = ("an allowed host: its NQN as a string, or a mapping with nqn and "
                           "its dhchap_ settings")

    nqn: str = setting(NQN)
    dhchap_secret: Secret | None = setting(DhchapSecret(), None)
    dhchap_ctrl_secret: Secret | None = setting(DhchapSecret(), None)
    dhchap_hash: str = setting(Choice(*HMAC_CHOICES), HMAC_CHOICES[0])
    dhchap_dhgroup: str = setting(Choice(*DHGROUP_CHOICES), DHGROUP_CHOICES[0])

    def _finish(self, where: Where) -> Host:
        if self.dhchap_ctrl_secret is not None and self.dhchap_secret is None:
            where.at("dhchap_secret").fail("a host secret too (the controller authenticates "
                                           "only after the host has)")
        if (self.dhchap_ctrl_secret is not None and self.dhchap_secret is not None
                and self.dhchap_ctrl_secret.key == self.dhchap_secret.key):
            where.at("dhchap_ctrl_secret").fail("a secret other than dhchap_secret (with one "
                                                "key, a reflected challenge proves nothing)",
                                                Plain("the same key"))
        return self

    @property
    def hash_id(self) -> int:
        return next(h for h, name in HASH_NAMES.items() if f"hmac({name})" == self.dhchap_hash)

    @property
    def dhgroup_id(self) -> int:
        return next(g for g, name in DHGROUP_NAMES.items() if name == self.dhchap_dhgroup)


class HostEntry(Nested):
    """``hosts[]``: a bare NQN, or a :class:`Host` mapping; dumped back the same way."""

    def __init__(self) -> None:
        super().__init__(Host)

    def load(self, value: Any, where: Where) -> Host:
        if isinstance(value, dict):
            return Host.load_from(value, where)
        if not isinstance(value, str):
            where.fail(f"{NQN.expected}, or a mapping ({Host.WHAT})", value)
        return Host(nqn=NQN.load(value, where))

    def dump(self, value: Model) -> Any:
        assert isinstance(value, Host)
        return value.to_dict() if value.dhchap_secret is not None else value.nqn


@dataclass(frozen=True, kw_only=True)
class Subsystem(Model):
    """An NVM subsystem: an NQN, who may connect, and its namespaces."""

    WHAT: ClassVar[str] = "a subsystem"

    nqn: str = setting(NQN)
    serial: str | None = setting(_ascii(20), None)
    model: str = setting(_ascii(40), "blockfabric")
    allow_any_host: bool = setting(Bool(), False)
    hosts: tuple[Host, ...] = setting(ListOf(HostEntry()), ())
    namespaces: tuple[Namespace, ...] = setting(ListOf(Nested(Namespace)), ())
    listeners: tuple[str, ...] | None = setting(
        ListOf(Text("a listener's name or address:port", re.compile(r"\S+"))), None)

    def _finish(self, where: Where) -> Subsystem:
        if self.nqn == DISCOVERY_NQN:
            where.at("nqn").fail("an NQN other than the discovery NQN", self.nqn)
        if self.allow_any_host and self.hosts:
            where.at("hosts").fail("no hosts when allow_any_host is true (as nvmet refuses "
                                   "them): drop one of the two", list(self.host_nqns))
        unique(((where.at("hosts").index(i), h.nqn, h.nqn) for i, h in enumerate(self.hosts)),
                "a host NQN")
        unique(((where.at("namespaces").index(i).at("nsid"), ns.nsid, ns.nsid)
                 for i, ns in enumerate(self.namespaces)), "an nsid")
        serial = self.serial or hashlib.sha256(self.nqn.encode()).hexdigest()[:20]
        return dataclasses.replace(self, serial=serial, namespaces=tuple(
            ns.with_ids(self.nqn) for ns in self.namespaces))

    def allows(self, hostnqn: str) -> bool:
        """Whether a host may connect to this subsystem."""
        return self.allow_any_host or hostnqn in self.host_nqns

    @property
    def host_nqns(self) -> tuple[str, ...]:
        return tuple(h.nqn for h in self.hosts)

    def host(self, hostnqn: str) -> Host | None:
        """The allow-list entry of ``hostnqn`` (None: not listed)."""
        return next((h for h in self.hosts if h.nqn == hostnqn), None)

    def namespace(self, nsid: int) -> Namespace | None:
        return next((ns for ns in self.namespaces if ns.nsid == nsid), None)


#: What one command may have queued besides its data: frame headers, the response capsule,
#: an acknowledgement, and the provider's cost of each queued buffer.
UNSENT_SLACK = 4 * KiB


@dataclass(frozen=True, kw_only=True)
class Limits(Model):
    """Queue and transfer limits the controller advertises (defaults as the Linux target)."""

    WHAT: ClassVar[str] = "the limits"

    queue_size: int = setting(Int(16, 1024), 128)
    max_io_queues: int = setting(Int(1, 128), 8)
    inline_data_size: int = setting(Size(0, 16 * KiB, multiple_of=16), 4 * KiB)
    # One keyed SGL descriptor moves at most 16 MiB - 1, so 8 MiB is the largest power of two.
    mdts: int = setting(Size(4 * KiB, 8 * MiB, multiple_of=4 * KiB, power_of_two=True), MiB)
    max_connections_per_host: int = setting(Int(1, 65535), 64)
    #: Seconds a queue may stay connected (rdma_cm) without completing a Fabrics Connect
    #: before it is disconnected, so that silent peers cannot keep connection slots.
    connect_timeout: int = setting(Int(1, 3600, unit="seconds"), 10)
    #: Queues accepted (rdma_cm) whose Fabrics Connect has not completed, across all peer
    #: addresses; past it a new connection gets CM reject NO_RESOURCES.
    max_unconnected_queues: int = setting(Int(1, 65535), 128)
    #: Connection requests each listener holds before they are whole (the soft provider
    #: reads them itself): past it the oldest is dropped for the newest.
    max_pending_requests: int = setting(Int(1, 65535), 128)
    #: Seconds a connection request may take to arrive whole before it is dropped.
    request_timeout: int = setting(Int(1, 60, unit="seconds"), 5)
    #: Bytes of frames a queue may hold unsent because its peer does not read them (soft
    #: provider; queued buffers count 128 B more each), past which the queue is cut.  0: the
    #: queue's depth x (mdts + inline_data_size + 4 KiB), what a well-behaved host can
    #: legitimately have in flight.
    max_unsent_bytes: int = setting(Size(0, 64 * 1024 * MiB), 0)
    #: Seconds a command may keep a shared bounce buffer waiting on its host (an RDMA READ
    #: of the host's data not answered, an answer not acknowledged) before the target
    #: disconnects that queue and tears its controller down, so that no host can hoard the
    #: buffers the other hosts' file-backed I/O needs.  Far above any real transfer.
    buffer_hold_timeout: int = setting(Int(1, 3600, unit="seconds"), 30)
    #: Seconds a queue that must authenticate (DH-HMAC-CHAP) may take from its Connect to a
    #: finished exchange, and a failed exchange to be answered, before its controller ends.
    auth_timeout: int = setting(Int(1, 600, unit="seconds"), 10)
    #: Failed authentications from one peer address within auth_failure_window seconds
    #: that make the target refuse that address's authenticating Connects (Controller
    #: Busy) for auth_backoff seconds.
    auth_max_failures: int = setting(Int(1, 1000), 5)
    auth_failure_window: int = setting(Int(1, 86400, unit="seconds"), 60)
    auth_backoff: int = setting(Int(1, 86400, unit="seconds"), 60)

    def _finish(self, where: Where) -> Limits:
        if 0 < self.max_unsent_bytes < MiB:
            where.at("max_unsent_bytes").fail("0 (derived from the queue) or at least 1MiB",
                                              format_size(self.max_unsent_bytes))
        return self

    def unsent_limit(self, depth: int, inline: int) -> int:
        """``max_unsent_bytes`` for a queue of ``depth`` commands with ``inline`` bytes of
        in-capsule data."""
        return self.max_unsent_bytes or depth * (self.mdts + inline + UNSENT_SLACK)


@dataclass(frozen=True, kw_only=True)
class KeepAlive(Model):
    """Keep-alive granularity (Identify KAS) and the longest timeout a host may ask for."""

    WHAT: ClassVar[str] = "the keep-alive settings"

    kas_ms: int = setting(Int(100, 6_553_500, multiple_of=100), 1000)
    max_timeout_ms: int = setting(Int(100, 3_600_000), 300_000)

    def _finish(self, where: Where) -> KeepAlive:
        if self.max_timeout_ms < self.kas_ms:
            where.at("max_timeout_ms").fail(f"at least kas_ms ({self.kas_ms})",
                                            self.max_timeout_ms)
        return self


@dataclass(frozen=True, kw_only=True)
class Metrics(Model):
    """Where counters are served for scraping; off unless configured."""

    WHAT: ClassVar[str] = "the metrics endpoint"

    address: str = setting(Address(), "127.0.0.1")
    port: int = setting(Int(1, 65535))


@dataclass(frozen=True, kw_only=True)
class GatewayCeph(Model):
    """Where the gateways of a group coordinate: RADOS objects in a pool of the cluster
    that holds their images (docs/ceph.md)."""

    WHAT: ClassVar[str] = "the Ceph pool a gateway group coordinates in"

    pool: str = setting(Text("a Ceph pool name", _CEPH_NAME_RE))
    namespace: str | None = setting(Text("a RADOS namespace name", _CEPH_NAME_RE), None)
    ceph_conf: str = setting(AbsPath(), "/etc/ceph/ceph.conf")
    client: str = setting(Text("client.NAME (a Ceph user)", _CEPH_CLIENT_RE), "client.admin")
    keyring: str | None = setting(AbsPath(), None)
    #: Seconds to reach the monitors at start, and the longest any one RADOS call may take.
    connect_timeout: int = setting(Int(1, 3600, unit="seconds"), 10)
    op_timeout: int = setting(Int(1, 3600, unit="seconds"), 5)


@dataclass(frozen=True, kw_only=True)
class Gateway(Model):
    """This target as one gateway of a group that exports the same subsystems and images:
    the others have the same subsystems, namespaces and ANA groups and other names and
    controller id ranges.  Ownership of each ANA group is a lease (a RADOS lock) in
    ``ceph.pool``; see docs/ceph.md for the failover it gives and how long it takes."""

    WHAT: ClassVar[str] = "this target's place in a gateway group"

    #: Unique in the group (the RADOS lock cookie, the log lines).
    name: str = setting(Text("a gateway name (letters, digits, . _ -)",
                            re.compile(r"[A-Za-z0-9_.-]{1,64}")))
    #: The group's name: gateways with the same group coordinate (its RADOS objects).
    group: str = setting(Text("a gateway group name (letters, digits, . _ -)",
                             re.compile(r"[A-Za-z0-9_.-]{1,64}")))
    #: Controller ids this gateway hands out; disjoint from every other gateway's of the
    #: group (hosts refuse a second controller with the same id in one subsystem).
    cntlid_min: int = setting(Int(1, MAX_CNTLID))
    cntlid_max: int = setting(Int(1, MAX_CNTLID))
    #: The ANA groups this gateway serves optimized when it is up (its home groups); it
    #: takes others' only while their home gateway is down, and hands them back.
    ana_groups: tuple[int, ...] = setting(ListOf(Int(1, ANA_GROUP_MAX)), ())
    #: The state reported for the groups this gateway does not own: non-optimized (I/O is
    #: still served: both paths reach the same image) or inaccessible (I/O gets ANA
    #: Inaccessible and the host uses another path).
    others: str = setting(Choice(*ANA_OTHERS), "non-optimized")
    #: Seconds an owner's lease on an ANA group lasts without renewal: a gateway that dies
    #: loses its groups this long after its last renewal.
    lease: int = setting(Int(2, 3600, unit="seconds"), 6)
    #: Seconds between renewals (and between looks at groups nobody owns).
    renew_interval: int = setting(Int(1, 600, unit="seconds"), 2)
    ceph: GatewayCeph | None = setting(Nested(GatewayCeph), None)

    def _finish(self, where: Where) -> Gateway:
        if self.cntlid_max < self.cntlid_min:
            where.at("cntlid_max").fail(f"at least cntlid_min ({self.cntlid_min})",
                                        self.cntlid_max)
        if 2 * self.renew_interval >= self.lease:
            where.at("renew_interval").fail(f"less than half the lease ({self.lease} s), so "
                                            "an owner renews at least twice per lease",
                                            self.renew_interval)
        unique(((where.at("ana_groups").index(i), g, g)
                 for i, g in enumerate(self.ana_groups)), "an ANA group")
        return self

    @property
    def anatt(self) -> int:
        """Identify ANATT: the longest an ANA group may stay in transition, seconds."""
        return min(255, self.lease + 2 * int(self.renew_interval) + 2)

    def overlaps(self, other: tuple[int, int]) -> bool:
        return self.cntlid_min <= other[1] and other[0] <= self.cntlid_max


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
    #: docs/performance.md).  0: never spin; unset: $BLOCKFABRIC_REACTOR_SPIN_US, else 0.
    spin_us: int | None = setting(Int(0, 10_000, unit="microseconds"), None)
    #: Poll groups: processes that each serve I/O queues on a reactor of their own, so the
    #: target uses that many cores (docs/scaling.md).  1: one process, as before; ``auto``:
    #: one per CPU the process may run on.  NVMe/TCP and RDMA (soft and verbs) I/O queues
    #: are spread over the groups.  Not with rbd namespaces or a gateway section (yet); a
    #: reload cannot change it.
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
        self._check_reactors(where)
        return dataclasses.replace(self, source=where.file)

    @property
    def reactor_count(self) -> int:
        """How many poll groups ``reactors`` means on this machine."""
        return usable_cpus() if self.reactors == "auto" else int(self.reactors)

    def _check_reactors(self, where: Where) -> None:
        """What poll groups cannot serve yet is refused at start, naming the key, rather
        than served wrong (docs/scaling.md says what each would take)."""
        if self.reactor_count == 1:
            return
        here = where.at("reactors")
        shown = f"{self.reactors}" + (f" ({self.reactor_count} CPUs)"
                                      if self.reactors == "auto" else "")
        for s in self.subsystems:
            for ns in s.namespaces:
                if ns.backend == "rbd":
                    here.fail(f"1 with backend: rbd namespaces ({s.nqn} nsid {ns.nsid}): "
                              "poll groups do not open RBD images per worker yet",
                              Plain(shown))
        if self.gateway is not None:
            here.fail("1 in a gateway (the gateway section): ANA state is not shared with "
                      "poll groups yet", Plain(shown))

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



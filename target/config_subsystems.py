"""What the target exports, in its configuration: subsystems, the hosts they allow, their
namespaces, the Ceph RBD images behind them, and the gateway group that serves them together.

The section models of :mod:`blockfabric.target.config` (which re-exports them all) for the
``subsystems`` and ``gateway`` keys; each checks itself (``_finish``), and what needs the
whole configuration (a listener named by a subsystem, an image used twice) is checked by
:class:`~blockfabric.target.config.TargetConfig`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from blockfabric.protocol.auth import DHGROUP_NAMES, HASH_NAMES, SUPPORTED_DHGROUPS, Secret
from blockfabric.schema import (NQN, AbsPath, Bool, Choice, DhchapSecret, Int, ListOf, Model,
                                Nested, Plain, Size, Text, Where, setting, unique)
from blockfabric.sizes import format_size

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
MAX_NSID = 1024          # nvmet's default NN; also the length of the active namespace list
BACKENDS = ("ramdisk", "file", "null", "rbd")
#: ANA group ids run 1..ANA_GROUP_MAX (Identify ANAGRPMAX and NANAGRPID, as nvmet's 128).
ANA_GROUP_MAX = 128
#: Controller ids a target may hand out (nvmet's range; 0xFFF0.. are reserved).
MAX_CNTLID = 0xFFEF
#: What a gateway reports for the ANA groups it does not own.
ANA_OTHERS = ("non-optimized", "inaccessible")

# Stable derived identifiers: uuid5 under a fixed namespace of our own.
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "blockfabric.io")

_NGUID_RE = re.compile(r"[0-9a-fA-F]{32}")
_UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                      r"[0-9a-fA-F]{12}")
CEPH_NAME_RE = re.compile(r"[A-Za-z0-9_.+-][A-Za-z0-9_.+@-]{0,254}")
CEPH_CLIENT_RE = re.compile(r"client\.[A-Za-z0-9_.-]{1,64}")
HMAC_CHOICES = tuple(f"hmac({name})" for name in HASH_NAMES.values())
DHGROUP_CHOICES = tuple(DHGROUP_NAMES[g] for g in SUPPORTED_DHGROUPS)


def _ascii(max_chars: int) -> Text:
    return Text(f"1 to {max_chars} printable ASCII characters",
                re.compile(f"[\\x20-\\x7e]{{1,{max_chars}}}"))


@dataclass(frozen=True, kw_only=True)
class Rbd(Model):
    """The Ceph RBD image behind a ``backend: rbd`` namespace, and how to reach the cluster.
    The timeouts are given to librados as its own options (``client mount timeout``,
    ``rados mon op timeout``, ``rados osd op timeout``), so a cluster that is down fails
    start-up or a command within them instead of hanging."""

    WHAT: ClassVar[str] = "the Ceph RBD image of a backend: rbd namespace"

    pool: str = setting(Text("a Ceph pool name", CEPH_NAME_RE))
    image: str = setting(Text("an RBD image name", CEPH_NAME_RE))
    #: RADOS namespace inside the pool (rbd --namespace); unset: the pool's default.
    namespace: str | None = setting(Text("a RADOS namespace name", CEPH_NAME_RE), None)
    ceph_conf: str = setting(AbsPath(), "/etc/ceph/ceph.conf")
    #: The Ceph user the target connects as (its caps: docs/ceph.md).
    client: str = setting(Text("client.NAME (a Ceph user)", CEPH_CLIENT_RE), "client.admin")
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


@dataclass(frozen=True, kw_only=True)
class GatewayCeph(Model):
    """Where the gateways of a group coordinate: RADOS objects in a pool of the cluster
    that holds their images (docs/ceph.md)."""

    WHAT: ClassVar[str] = "the Ceph pool a gateway group coordinates in"

    pool: str = setting(Text("a Ceph pool name", CEPH_NAME_RE))
    namespace: str | None = setting(Text("a RADOS namespace name", CEPH_NAME_RE), None)
    ceph_conf: str = setting(AbsPath(), "/etc/ceph/ceph.conf")
    client: str = setting(Text("client.NAME (a Ceph user)", CEPH_CLIENT_RE), "client.admin")
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

"""The target's configuration: one model that loads from YAML, validates, and dumps back.

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
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import os
import re
import uuid
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any, ClassVar, Iterable, NoReturn, TypeVar

import yaml

from blockfabric.errors import ConfigError
from blockfabric.protocol.auth import DHGROUP_NAMES, HASH_NAMES, SUPPORTED_DHGROUPS, Secret
from blockfabric.protocol.fabrics import MAX_NQN_BYTES, NQN_PATTERN, nqn_problem
from blockfabric.fileutil import atomic_write
from blockfabric.sizes import KiB, MiB, SizeError, format_size, parse_size

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


class _Plain(str):
    """Text shown as-is after "got" in a ConfigError (``repr`` would add quotes)."""

    def __repr__(self) -> str:
        return str(self)


_ABSENT = _Plain("nothing (the key is missing)")


def _shown(value: object) -> object:
    """What to print after "got": scalars as themselves, containers by their kind."""
    if isinstance(value, dict):
        return _Plain("a mapping")
    if isinstance(value, list):
        return _Plain(f"a list of {len(value)} items" if value else "an empty list")
    if value is None:
        return _Plain("null")
    return value


@dataclass(frozen=True)
class Where:
    """A place in a config file: the file and the key path down to the value."""

    file: str
    key: str = ""

    def at(self, name: str) -> Where:
        return Where(self.file, f"{self.key}.{name}" if self.key else name)

    def index(self, i: int) -> Where:
        return Where(self.file, f"{self.key}[{i}]")

    def fail(self, expected: str, got: object = _ABSENT) -> NoReturn:
        raise ConfigError(self.file, self.key or "(top level)", expected,
                          got if got is _ABSENT else _shown(got))


# --- kinds: how one YAML value is read, checked and written back ---------------------------

class Kind:
    """Reads one YAML value (``load``), failing with what was expected, and writes it back."""

    expected = "a value"

    def load(self, value: Any, where: Where) -> Any:
        return value

    def dump(self, value: Any) -> Any:
        return value


class Int(Kind):
    def __init__(self, lo: int, hi: int, multiple_of: int = 1, unit: str = "") -> None:
        self.lo, self.hi, self.multiple_of = lo, hi, multiple_of
        step = f" in steps of {multiple_of}" if multiple_of > 1 else ""
        self.expected = f"an integer from {lo} to {hi}{step}" + (f" ({unit})" if unit else "")

    def load(self, value: Any, where: Where) -> int:
        if (isinstance(value, bool) or not isinstance(value, int)
                or not self.lo <= value <= self.hi or value % self.multiple_of):
            where.fail(self.expected, value)
        return value


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


class Bool(Kind):
    expected = "true or false"

    def load(self, value: Any, where: Where) -> bool:
        if not isinstance(value, bool):
            where.fail(self.expected, value)
        return value


class Choice(Kind):
    def __init__(self, *choices: object) -> None:
        self.choices = choices
        self.expected = "one of " + ", ".join(str(c) for c in choices)

    def load(self, value: Any, where: Where) -> Any:
        if value is None and "null" in self.choices:
            where.fail(f'{self.expected} (quote "null": bare null is YAML for no value)', value)
        if isinstance(value, bool) or value not in self.choices:
            where.fail(self.expected, value)
        return value


class Text(Kind):
    """A string matching ``pattern`` (full match) and at most ``max_bytes`` of UTF-8."""

    def __init__(self, expected: str, pattern: re.Pattern[str], max_bytes: int = 1 << 16,
                 normalize: Any = None) -> None:
        self.expected, self.pattern, self.max_bytes = expected, pattern, max_bytes
        self.normalize = normalize

    def load(self, value: Any, where: Where) -> str:
        if not isinstance(value, str):
            where.fail(f"{self.expected} (a string: quote it)", value)
        if len(value.encode()) > self.max_bytes:
            where.fail(self.expected, _Plain(f"{len(value.encode())} bytes ({value[:40]!r}...)"))
        if not self.pattern.fullmatch(value):
            where.fail(self.expected, value)
        return self.normalize(value) if self.normalize else value


class Address(Kind):
    expected = "an IPv4 or IPv6 address literal"

    def load(self, value: Any, where: Where) -> str:
        if not isinstance(value, str):   # YAML 1.1 reads e.g. 2001:0:0:0:0:0:0:1 as a number
            where.fail(f"{self.expected} (a string: quote IPv6 addresses)", value)
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            where.fail(self.expected, value)


class AbsPath(Kind):
    expected = "an absolute path"

    def load(self, value: Any, where: Where) -> str:
        if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
            where.fail(self.expected, value)
        return os.path.normpath(value)


class Size(Kind):
    """A byte size (see blockfabric.sizes), dumped in its exact binary unit."""

    def __init__(self, lo: int, hi: int | None = None, multiple_of: int = 1,
                 power_of_two: bool = False) -> None:
        self.lo, self.hi, self.multiple_of, self.power_of_two = lo, hi, multiple_of, power_of_two
        rules = []
        if lo:
            rules.append(f"at least {format_size(lo)}")
        if hi is not None:
            rules.append(f"at most {format_size(hi)}")
        if power_of_two:
            rules.append("a power of two")
        if multiple_of > 1:
            rules.append(f"a multiple of {multiple_of}")
        self.expected = f"a size ({', '.join(rules)})" if rules else "a size"

    def load(self, value: Any, where: Where) -> int:
        try:
            size = parse_size(value)
        except SizeError as exc:
            where.fail(exc.expected, value)
        if (size < self.lo or (self.hi is not None and size > self.hi) or size % self.multiple_of
                or (self.power_of_two and size & (size - 1))):
            where.fail(self.expected, value)
        return size

    def dump(self, value: int) -> str:
        return format_size(value)


class ListOf(Kind):
    def __init__(self, item: Kind, min_items: int = 0) -> None:
        self.item, self.min_items = item, min_items
        least = f"at least {min_items} " if min_items else ""
        self.expected = f"a list of {least}items, each {item.expected}"

    def load(self, value: Any, where: Where) -> tuple:
        if not isinstance(value, list) or len(value) < self.min_items:
            where.fail(self.expected, value)
        return tuple(self.item.load(v, where.index(i)) for i, v in enumerate(value))

    def dump(self, value: tuple) -> list:
        return [self.item.dump(v) for v in value]


class Nested(Kind):
    def __init__(self, model: type[Model]) -> None:
        self.model = model
        self.expected = f"a mapping ({model.WHAT})"

    def load(self, value: Any, where: Where) -> Model:
        return self.model.load_from(value, where)

    def dump(self, value: Model) -> dict:
        return value.to_dict()


def _field(kind: Kind, default: Any = dataclasses.MISSING) -> Any:
    """Declare a config field: its kind and (the one place for) its default."""
    return dataclasses.field(default=default, metadata={"kind": kind})


def _config_fields(obj: Any) -> list[dataclasses.Field]:
    return [f for f in fields(obj) if "kind" in f.metadata]


def _unique(entries: Iterable[tuple[Where, object, object]], what: str) -> None:
    """Fail at the second of two entries with the same identity (``entries`` yields
    ``(where, identity, value shown)``)."""
    seen: dict[object, str] = {}
    for where, identity, shown in entries:
        if identity in seen:
            where.fail(f"{what} not already used by {seen[identity]}", shown)
        seen[identity] = where.key


M = TypeVar("M", bound="Model")


class Model:
    """Base of the config classes: loading and dumping are driven by the declared fields."""

    WHAT: ClassVar[str] = "a config section"

    @classmethod
    def load_from(cls: type[M], data: Any, where: Where) -> M:
        if not isinstance(data, dict):
            where.fail(f"a mapping ({cls.WHAT})", data)
        specs = {f.name: f for f in _config_fields(cls)}
        for key in data:
            if key not in specs:
                hint = difflib.get_close_matches(str(key), specs, n=1, cutoff=0.6)
                tip = f" (did you mean {hint[0]!r}?)" if hint else ""
                where.at(str(key)).fail(f"one of the keys of {cls.WHAT}: "
                                        f"{', '.join(specs)}{tip}", _Plain(f"unknown key {key!r}"))
        values = {}
        for name, spec in specs.items():
            kind: Kind = spec.metadata["kind"]
            value = data.get(name)
            if value is not None or (name in data and spec.default is not None):
                values[name] = kind.load(value, where.at(name))
            elif spec.default is dataclasses.MISSING:
                where.at(name).fail(kind.expected)
        return cls(**values)._finish(where)

    def _finish(self: M, where: Where) -> M:
        """Cross-field checks and derived defaults, once every field has loaded."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration of this part; unset (None) fields are left out."""
        out = {}
        for spec in _config_fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                out[spec.name] = spec.metadata["kind"].dump(value)
        return out


# --- the configuration ---------------------------------------------------------------------

class Nqn(Text):
    """An NQN, checked as a Fabrics Connect checks one (``fabrics.nqn_problem``), so that the
    configuration never allows a host NQN that could not connect."""

    def load(self, value: Any, where: Where) -> str:
        value = super().load(value, where)
        if nqn_problem(value):
            where.fail(self.expected, value)
        return value


NQN = Nqn(f"an NQN (nqn.yyyy-mm.reverse.domain[:name], at most {MAX_NQN_BYTES} bytes)",
          NQN_PATTERN, MAX_NQN_BYTES)
NAME = Text("a name of 1 to 64 letters, digits, '_', '.' or '-'", _NAME_RE)


class DhchapSecret(Kind):
    """A DH-HMAC-CHAP secret in its text form; loads as a :class:`Secret`."""

    expected = ("a DH-HMAC-CHAP secret 'DHHC-1:XX:<base64 of key and CRC-32>:' (make one with "
                "`blockfabric gen-dhchap-key`)")

    def load(self, value: Any, where: Where) -> Secret:
        if not isinstance(value, str):
            where.fail(f"{self.expected} (a string: quote it)", value)
        try:
            return Secret.parse(value)
        except ValueError as exc:
            # never echo the secret itself: the message may end up in a log
            where.fail(f"{self.expected}; {exc}", _Plain("a secret that does not parse"))

    def dump(self, value: Secret) -> str:
        return str(value)


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

    transport: str = _field(Choice("rdma", "tcp"), "rdma")
    provider: str = _field(Choice(*PROVIDERS), "auto")
    address: str = _field(Address())
    port: int = _field(Int(1, 65535), NVME_RDMA_PORT)
    name: str | None = _field(NAME, None)
    #: NVMe/TCP only: CPDA in ICResp, the alignment ((cpda + 1) x 4 bytes) the host must
    #: pad the data of its capsules and H2CData PDUs to; 0: none (as every target does).
    cpda: int = _field(Int(0, 31), 0)
    #: Queues (admin and I/O, every host) connected through this listener at once; a
    #: Connect past it is refused with Controller Busy (0x181).  Unset: only
    #: limits.max_connections_per_host and limits.max_unconnected_queues apply.
    max_connections: int | None = _field(Int(1, 65535), None)
    #: I/O queues per controller created through this listener (at most
    #: limits.max_io_queues): Set Features Number of Queues grants no more, a Connect for a
    #: higher qid gets Connect Invalid Parameters (0x182, IPO 42).
    max_io_queues: int | None = _field(Int(1, 128), None)
    #: Queue depth of controllers created through this listener (at most limits.queue_size):
    #: advertised in CAP.MQES, a Connect asking more gets Connect Invalid Parameters (0x182,
    #: IPO 44).
    queue_size: int | None = _field(Int(16, 1024), None)

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

    pool: str = _field(Text("a Ceph pool name", _CEPH_NAME_RE))
    image: str = _field(Text("an RBD image name", _CEPH_NAME_RE))
    #: RADOS namespace inside the pool (rbd --namespace); unset: the pool's default.
    namespace: str | None = _field(Text("a RADOS namespace name", _CEPH_NAME_RE), None)
    ceph_conf: str = _field(AbsPath(), "/etc/ceph/ceph.conf")
    #: The Ceph user the target connects as (its caps: docs/ceph.md).
    client: str = _field(Text("client.NAME (a Ceph user)", _CEPH_CLIENT_RE), "client.admin")
    #: Unset: whatever ceph_conf says (by default /etc/ceph/ceph.CLIENT.keyring).
    keyring: str | None = _field(AbsPath(), None)
    #: Seconds to reach the monitors and open the image at start or reload.
    connect_timeout: int = _field(Int(1, 3600, unit="seconds"), 10)
    #: Seconds one read, write, flush or discard may wait for the cluster before it fails
    #: (and the namespace is reported unavailable: docs/ceph.md).
    op_timeout: int = _field(Int(1, 3600, unit="seconds"), 30)
    #: Seconds between checks of the image size (a resize reaches hosts as a Namespace
    #: Attribute Changed event); 0: only on reload.
    size_poll_interval: int = _field(Int(0, 3600, unit="seconds"), 5)

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

    nsid: int = _field(Int(1, MAX_NSID))
    backend: str = _field(Choice(*BACKENDS))
    #: Required except for backend rbd (whose size is the image's).
    size: int | None = _field(_NS_SIZE, None)
    block_size: int = _field(Choice(512, 4096), 4096)
    path: str | None = _field(AbsPath(), None)
    rbd: Rbd | None = _field(Nested(Rbd), None)
    read_only: bool = _field(Bool(), False)
    uuid: str | None = _field(Text("a UUID (8-4-4-4-12 hex digits)", _UUID_RE,
                                   normalize=str.lower), None)
    nguid: str | None = _field(Text("an NGUID (32 hex digits, not all zero)", _NGUID_RE,
                                    normalize=str.lower), None)
    #: The ANA group this namespace belongs to (with a ``gateway`` section); unset: derived
    #: from the nsid, 1 + (nsid - 1) % 128, so every gateway of a group derives the same.
    ana_group: int | None = _field(Int(1, ANA_GROUP_MAX), None)

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
        ids = {}
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

    nqn: str = _field(NQN)
    dhchap_secret: Secret | None = _field(DhchapSecret(), None)
    dhchap_ctrl_secret: Secret | None = _field(DhchapSecret(), None)
    dhchap_hash: str = _field(Choice(*HMAC_CHOICES), HMAC_CHOICES[0])
    dhchap_dhgroup: str = _field(Choice(*DHGROUP_CHOICES), DHGROUP_CHOICES[0])

    def _finish(self, where: Where) -> Host:
        if self.dhchap_ctrl_secret is not None and self.dhchap_secret is None:
            where.at("dhchap_secret").fail("a host secret too (the controller authenticates "
                                           "only after the host has)")
        if (self.dhchap_ctrl_secret is not None
                and self.dhchap_ctrl_secret.key == self.dhchap_secret.key):
            where.at("dhchap_ctrl_secret").fail("a secret other than dhchap_secret (with one "
                                                "key, a reflected challenge proves nothing)",
                                                _Plain("the same key"))
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

    def dump(self, value: Host) -> Any:
        return value.to_dict() if value.dhchap_secret is not None else value.nqn


@dataclass(frozen=True, kw_only=True)
class Subsystem(Model):
    """An NVM subsystem: an NQN, who may connect, and its namespaces."""

    WHAT: ClassVar[str] = "a subsystem"

    nqn: str = _field(NQN)
    serial: str | None = _field(_ascii(20), None)
    model: str = _field(_ascii(40), "blockfabric")
    allow_any_host: bool = _field(Bool(), False)
    hosts: tuple[Host, ...] = _field(ListOf(HostEntry()), ())
    namespaces: tuple[Namespace, ...] = _field(ListOf(Nested(Namespace)), ())
    listeners: tuple[str, ...] | None = _field(
        ListOf(Text("a listener's name or address:port", re.compile(r"\S+"))), None)

    def _finish(self, where: Where) -> Subsystem:
        if self.nqn == DISCOVERY_NQN:
            where.at("nqn").fail("an NQN other than the discovery NQN", self.nqn)
        if self.allow_any_host and self.hosts:
            where.at("hosts").fail("no hosts when allow_any_host is true (as nvmet refuses "
                                   "them): drop one of the two", list(self.host_nqns))
        _unique(((where.at("hosts").index(i), h.nqn, h.nqn) for i, h in enumerate(self.hosts)),
                "a host NQN")
        _unique(((where.at("namespaces").index(i).at("nsid"), ns.nsid, ns.nsid)
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

    queue_size: int = _field(Int(16, 1024), 128)
    max_io_queues: int = _field(Int(1, 128), 8)
    inline_data_size: int = _field(Size(0, 16 * KiB, multiple_of=16), 4 * KiB)
    # One keyed SGL descriptor moves at most 16 MiB - 1, so 8 MiB is the largest power of two.
    mdts: int = _field(Size(4 * KiB, 8 * MiB, multiple_of=4 * KiB, power_of_two=True), MiB)
    max_connections_per_host: int = _field(Int(1, 65535), 64)
    #: Seconds a queue may stay connected (rdma_cm) without completing a Fabrics Connect
    #: before it is disconnected, so that silent peers cannot keep connection slots.
    connect_timeout: int = _field(Int(1, 3600, unit="seconds"), 10)
    #: Queues accepted (rdma_cm) whose Fabrics Connect has not completed, across all peer
    #: addresses; past it a new connection gets CM reject NO_RESOURCES.
    max_unconnected_queues: int = _field(Int(1, 65535), 128)
    #: Connection requests each listener holds before they are whole (the soft provider
    #: reads them itself): past it the oldest is dropped for the newest.
    max_pending_requests: int = _field(Int(1, 65535), 128)
    #: Seconds a connection request may take to arrive whole before it is dropped.
    request_timeout: int = _field(Int(1, 60, unit="seconds"), 5)
    #: Bytes of frames a queue may hold unsent because its peer does not read them (soft
    #: provider; queued buffers count 128 B more each), past which the queue is cut.  0: the
    #: queue's depth x (mdts + inline_data_size + 4 KiB), what a well-behaved host can
    #: legitimately have in flight.
    max_unsent_bytes: int = _field(Size(0, 64 * 1024 * MiB), 0)
    #: Seconds a command may keep a shared bounce buffer waiting on its host (an RDMA READ
    #: of the host's data not answered, an answer not acknowledged) before the target
    #: disconnects that queue and tears its controller down, so that no host can hoard the
    #: buffers the other hosts' file-backed I/O needs.  Far above any real transfer.
    buffer_hold_timeout: int = _field(Int(1, 3600, unit="seconds"), 30)
    #: Seconds a queue that must authenticate (DH-HMAC-CHAP) may take from its Connect to a
    #: finished exchange, and a failed exchange to be answered, before its controller ends.
    auth_timeout: int = _field(Int(1, 600, unit="seconds"), 10)
    #: Failed authentications from one peer address within auth_failure_window seconds
    #: that make the target refuse that address's authenticating Connects (Controller
    #: Busy) for auth_backoff seconds.
    auth_max_failures: int = _field(Int(1, 1000), 5)
    auth_failure_window: int = _field(Int(1, 86400, unit="seconds"), 60)
    auth_backoff: int = _field(Int(1, 86400, unit="seconds"), 60)

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

    kas_ms: int = _field(Int(100, 6_553_500, multiple_of=100), 1000)
    max_timeout_ms: int = _field(Int(100, 3_600_000), 300_000)

    def _finish(self, where: Where) -> KeepAlive:
        if self.max_timeout_ms < self.kas_ms:
            where.at("max_timeout_ms").fail(f"at least kas_ms ({self.kas_ms})",
                                            self.max_timeout_ms)
        return self


@dataclass(frozen=True, kw_only=True)
class Metrics(Model):
    """Where counters are served for scraping; off unless configured."""

    WHAT: ClassVar[str] = "the metrics endpoint"

    address: str = _field(Address(), "127.0.0.1")
    port: int = _field(Int(1, 65535))


@dataclass(frozen=True, kw_only=True)
class GatewayCeph(Model):
    """Where the gateways of a group coordinate: RADOS objects in a pool of the cluster
    that holds their images (docs/ceph.md)."""

    WHAT: ClassVar[str] = "the Ceph pool a gateway group coordinates in"

    pool: str = _field(Text("a Ceph pool name", _CEPH_NAME_RE))
    namespace: str | None = _field(Text("a RADOS namespace name", _CEPH_NAME_RE), None)
    ceph_conf: str = _field(AbsPath(), "/etc/ceph/ceph.conf")
    client: str = _field(Text("client.NAME (a Ceph user)", _CEPH_CLIENT_RE), "client.admin")
    keyring: str | None = _field(AbsPath(), None)
    #: Seconds to reach the monitors at start, and the longest any one RADOS call may take.
    connect_timeout: int = _field(Int(1, 3600, unit="seconds"), 10)
    op_timeout: int = _field(Int(1, 3600, unit="seconds"), 5)


@dataclass(frozen=True, kw_only=True)
class Gateway(Model):
    """This target as one gateway of a group that exports the same subsystems and images:
    the others have the same subsystems, namespaces and ANA groups and other names and
    controller id ranges.  Ownership of each ANA group is a lease (a RADOS lock) in
    ``ceph.pool``; see docs/ceph.md for the failover it gives and how long it takes."""

    WHAT: ClassVar[str] = "this target's place in a gateway group"

    #: Unique in the group (the RADOS lock cookie, the log lines).
    name: str = _field(Text("a gateway name (letters, digits, . _ -)",
                            re.compile(r"[A-Za-z0-9_.-]{1,64}")))
    #: The group's name: gateways with the same group coordinate (its RADOS objects).
    group: str = _field(Text("a gateway group name (letters, digits, . _ -)",
                             re.compile(r"[A-Za-z0-9_.-]{1,64}")))
    #: Controller ids this gateway hands out; disjoint from every other gateway's of the
    #: group (hosts refuse a second controller with the same id in one subsystem).
    cntlid_min: int = _field(Int(1, MAX_CNTLID))
    cntlid_max: int = _field(Int(1, MAX_CNTLID))
    #: The ANA groups this gateway serves optimized when it is up (its home groups); it
    #: takes others' only while their home gateway is down, and hands them back.
    ana_groups: tuple[int, ...] = _field(ListOf(Int(1, ANA_GROUP_MAX)), ())
    #: The state reported for the groups this gateway does not own: non-optimized (I/O is
    #: still served: both paths reach the same image) or inaccessible (I/O gets ANA
    #: Inaccessible and the host uses another path).
    others: str = _field(Choice(*ANA_OTHERS), "non-optimized")
    #: Seconds an owner's lease on an ANA group lasts without renewal: a gateway that dies
    #: loses its groups this long after its last renewal.
    lease: int = _field(Int(2, 3600, unit="seconds"), 6)
    #: Seconds between renewals (and between looks at groups nobody owns).
    renew_interval: int = _field(Int(1, 600, unit="seconds"), 2)
    ceph: GatewayCeph | None = _field(Nested(GatewayCeph), None)

    def _finish(self, where: Where) -> Gateway:
        if self.cntlid_max < self.cntlid_min:
            where.at("cntlid_max").fail(f"at least cntlid_min ({self.cntlid_min})",
                                        self.cntlid_max)
        if 2 * self.renew_interval >= self.lease:
            where.at("renew_interval").fail(f"less than half the lease ({self.lease} s), so "
                                            "an owner renews at least twice per lease",
                                            self.renew_interval)
        _unique(((where.at("ana_groups").index(i), g, g)
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

    listeners: tuple[Listener, ...] = _field(ListOf(Nested(Listener), min_items=1))
    subsystems: tuple[Subsystem, ...] = _field(ListOf(Nested(Subsystem)), ())
    limits: Limits = _field(Nested(Limits), Limits())
    keep_alive: KeepAlive = _field(Nested(KeepAlive), KeepAlive())
    metrics: Metrics | None = _field(Nested(Metrics), None)
    #: This target as a member of a gateway group (ANA, failover through Ceph); unset: a
    #: standalone target.
    gateway: Gateway | None = _field(Nested(Gateway), None)
    control_socket: str = _field(AbsPath(), DEFAULT_CONTROL_SOCKET)
    #: Poll groups: processes that each serve I/O queues on a reactor of their own, so the
    #: target uses that many cores (docs/scaling.md).  1: one process, as before; ``auto``:
    #: one per CPU the process may run on.  NVMe/TCP and soft-RDMA I/O queues are spread
    #: over the groups.  Not with verbs listeners, rbd namespaces or a gateway section
    #: (yet); a reload cannot change it.
    reactors: int | str = _field(Reactors(), 1)
    #: The file this configuration came from (for messages; not part of the configuration).
    source: str = dataclasses.field(default="<dict>", compare=False)

    def _finish(self, where: Where) -> TargetConfig:
        lst = where.at("listeners")
        _unique(((lst.index(i), (ipaddress.ip_address(x.address), x.port), x.endpoint)
                 for i, x in enumerate(self.listeners)), "an address:port")
        _unique(((lst.index(i).at("name"), x.name, x.name)
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
        _unique(((subs.index(i).at("nqn"), s.nqn, s.nqn)
                 for i, s in enumerate(self.subsystems)), "an NQN")
        for attr in ("uuid", "nguid", "path", "rbd_image"):
            _unique(((subs.index(i).at("namespaces").index(j).at(attr), getattr(ns, attr),
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
        for x in self.listeners:
            if x.transport == "rdma" and x.provider != "soft":
                here.fail(f"1 with a provider: {x.provider} listener ({x.endpoint}): "
                          "rdma_cm ids cannot move between processes, poll groups serve "
                          "NVMe/TCP and the soft provider only (set provider: soft, or "
                          "reactors: 1)", _Plain(shown))
        for s in self.subsystems:
            for ns in s.namespaces:
                if ns.backend == "rbd":
                    here.fail(f"1 with backend: rbd namespaces ({s.nqn} nsid {ns.nsid}): "
                              "poll groups do not open RBD images per worker yet",
                              _Plain(shown))
        if self.gateway is not None:
            here.fail("1 in a gateway (the gateway section): ANA state is not shared with "
                      "poll groups yet", _Plain(shown))

    @classmethod
    def from_dict(cls, data: Any, path: str = "<dict>") -> TargetConfig:
        """Build and validate a configuration from plain data (as YAML loads it)."""
        if data is None:
            Where(path).fail(f"a mapping ({cls.WHAT})", _Plain("an empty file"))
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


# --- files ---------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently, which hides a half-edited config)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, path: str) -> Any:
    """Parse YAML text, turning syntax errors into a ConfigError with the line number."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise ConfigError(path, where, "valid YAML",
                          _Plain(f"a syntax error ({' '.join(str(exc.problem).split())})")) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(path, "(file)", "valid YAML",
                          _Plain(f"a syntax error ({' '.join(str(exc).split())})")) from exc


def loads(text: str, path: str = "<string>") -> TargetConfig:
    """Load and validate a configuration from YAML text (``path`` is used in messages)."""
    return TargetConfig.from_dict(parse_yaml(text, path), path=path)


def load(path: str | os.PathLike[str]) -> TargetConfig:
    """Load and validate the configuration file at ``path``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(path, "(file)", "a readable YAML file",
                          _Plain(exc.strerror or str(exc))) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "(file)", "UTF-8 text", _Plain(str(exc))) from exc
    return loads(text, path)


def default_text() -> str:
    """The YAML text of the embedded default configuration."""
    return resources.files(__package__).joinpath(DEFAULT_CONFIG_RESOURCE).read_text("utf-8")


def default_config() -> TargetConfig:
    """The embedded default: a 1 GiB ramdisk on the soft provider at 127.0.0.1:4420."""
    return loads(default_text(), f"<embedded {DEFAULT_CONFIG_RESOURCE}>")



"""The initiator's YAML: mounts that should come up at boot (configs/initiator.yaml).

One model on the configuration engine the target uses (:mod:`blockfabric.schema`): a bad file
fails whole at load with a :class:`ConfigError` naming the file, the key path and what was
expected (unknown keys with a did-you-mean), so no mount starts half-configured.  Every
connection default is :class:`~blockfabric.initiator.host.ConnectOptions`'s (and so
``blockfabric mount``'s flags', nvme-cli's); none is repeated here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from blockfabric.initiator.fuse_workers import check_count
from blockfabric.initiator.fusefs import MountOptions
from blockfabric.initiator.host import ConnectOptions
from blockfabric.initiator.multipath import (FORMS, TRANSPORTS, parse_path, parse_path_spec,
                                             parse_transport, resolve_paths)
from blockfabric.protocol.auth import Secret
from blockfabric.schema import (NQN, AbsPath, Bool, Choice, DhchapSecret, Int, Kind, ListOf,
                                Model, Nested, Plain, Text, Where, parse_yaml, read_text,
                                setting, unique)

DEFAULT_PATH = "/etc/blockfabric/initiator.yaml"
PROVIDERS = ("auto", "soft", "verbs")

#: ConnectOptions' defaults by field name: the one place a connection default is written.
CONNECT_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ConnectOptions)
                                    if f.default is not dataclasses.MISSING}

_TEXT = Text("a non-empty string", re.compile(r".+", re.DOTALL))
_PORT = Int(1, 65535, digits=True)


class _PathAddress(Kind):
    """A further path's ``traddr``: an address alone (its port goes in ``trsvcid``)."""

    expected = "an IPv4 or IPv6 address"

    def load(self, value: Any, where: Where) -> str:
        if not isinstance(value, str) or not value:
            where.fail(self.expected, value)
        try:
            address, port = parse_path(f"[{value}]" if ":" in value else value)
        except ValueError:
            try:                    # ADDR:PORT: say where the port goes
                address, port = parse_path(value)
            except ValueError:
                where.fail(self.expected, value)
        if port is not None:
            where.fail(f"{self.expected} (the port goes in trsvcid)", value)
        return address


class _Transport(Kind):
    """``rdma`` or ``tcp``, in any case (as ``tcp://`` in a path string)."""

    expected = "a transport: rdma or tcp"

    def load(self, value: Any, where: Where) -> str:
        try:
            return parse_transport(value)
        except ValueError:
            where.fail(self.expected, value)


@dataclass(frozen=True, kw_only=True)
class PathEntry(Model):
    """A further path given as a mapping (the string form is ``--path``'s)."""

    WHAT: ClassVar[str] = "a further path"

    traddr: str = setting(_PathAddress())
    #: Unset: the mount's trsvcid, as --path's PORT defaults to -s.
    trsvcid: int | None = setting(_PORT, None)
    #: Unset: the mount's transport.
    transport: str | None = setting(_Transport(), None)

    def as_tuple(self) -> tuple:
        own = (self.transport,) if self.transport is not None else ()
        return (self.traddr, self.trsvcid) + own


_PATH_ITEM = f"{FORMS} (as --path), or a mapping {{traddr, trsvcid, transport}}"


class _Path(Kind):
    """One item of ``paths:``: ``--path``'s text, or a :class:`PathEntry` mapping; loads as
    ``(address, port or None[, transport])`` for :func:`resolve_paths`."""

    expected = _PATH_ITEM

    def load(self, value: Any, where: Where) -> tuple:
        if isinstance(value, dict):
            return PathEntry.load_from(value, where).as_tuple()
        if not isinstance(value, str):
            where.fail(self.expected, value)
        try:
            return parse_path_spec(value)
        except ValueError as exc:
            where.fail(f"{exc} (or a mapping {{traddr, trsvcid, transport}})", value)


class _Options(Kind):
    """Mount options: a list of words, or one ``a,b`` string, as ``-o`` takes them."""

    expected = "valid mount options (a list, or 'a,b'): ro, allow_other, direct_io | cache, ..."

    def load(self, value: Any, where: Where) -> tuple[str, ...]:
        words = [w for w in value.split(",") if w] if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            where.fail(self.expected, value)
        try:
            MountOptions.parse(",".join(words))
        except ValueError as exc:
            where.fail(self.expected, Plain(str(exc)))
        return tuple(words)

    def dump(self, value: tuple[str, ...]) -> list[str]:
        return list(value)


def _connect(name: str, kind: Kind) -> Any:
    """A setting whose default is ConnectOptions' field of the same name."""
    return setting(kind, CONNECT_DEFAULTS[name])


@dataclass(frozen=True, kw_only=True)
class MountSpec(Model):
    """One mount: where the subsystem is, where it goes, and how."""

    WHAT: ClassVar[str] = "a mount (traddr, nqn, mountpoint, ...)"

    traddr: str = setting(_TEXT)
    nqn: str = setting(_TEXT)
    mountpoint: str = setting(AbsPath())
    #: Default: the mount point's last component.
    name: str = setting(_TEXT, "")
    trsvcid: int = _connect("trsvcid", _PORT)
    provider: str = _connect("provider", Choice(*PROVIDERS))
    #: rdma or tcp (NVMe/TCP), with its digests
    transport: str = _connect("transport", Choice(*TRANSPORTS))
    hdr_digest: bool = _connect("hdr_digest", Bool())
    data_digest: bool = _connect("data_digest", Bool())
    hostnqn: str | None = _connect("hostnqn", NQN)
    options: tuple[str, ...] = setting(_Options(), ())
    #: Processes serving the mount's FUSE requests (as --fuse-workers): the mount process
    #: and fuse_workers - 1 workers, each with its share of the I/O queues (docs/fuse.md)
    fuse_workers: int = setting(Int(1, 64, digits=True), 1)
    nr_io_queues: int = _connect("nr_io_queues", Int(1, 1024, digits=True))
    queue_size: int = _connect("queue_size", Int(16, 1024, digits=True))
    keep_alive_tmo: float = _connect("keep_alive_tmo", Int(0, 3600, unit="seconds",
                                                           digits=True))
    reconnect_delay: float = _connect("reconnect_delay", Int(1, 3600, unit="seconds",
                                                             digits=True))
    ctrl_loss_tmo: float = _connect("ctrl_loss_tmo", Int(-1, 1 << 31, unit="seconds; -1: "
                                                         "forever", digits=True))
    #: Further listeners of the subsystem (multipath): (address, port), or (address, port,
    #: transport) for one over its own transport.
    paths: list[tuple] = setting(ListOf(_Path(), noun="further paths"), ())
    dhchap_secret: Secret | None = setting(DhchapSecret(), None)       # of this host
    dhchap_ctrl_secret: Secret | None = setting(DhchapSecret(), None)  # ... and the controller

    def _finish(self, where: Where) -> MountSpec:
        if self.dhchap_ctrl_secret is not None and self.dhchap_secret is None:
            where.at("dhchap_secret").fail("a host secret too (the controller authenticates "
                                           "only after the host has)")
        try:
            paths = resolve_paths((self.traddr, self.trsvcid), list(self.paths), self.transport)
        except ValueError as exc:
            where.at("paths").fail(f"paths that differ from each other and from "
                                   f"traddr/trsvcid ({exc})", list(self.paths))
        name = self.name or os.path.basename(self.mountpoint.rstrip("/")) or "root"
        spec = dataclasses.replace(self, name=name, paths=paths)
        try:
            check_count(spec.fuse_workers, spec.mount_options(), spec.connect_options())
        except ValueError as exc:
            where.at("fuse_workers").fail(f"a count this mount can run ({exc})",
                                          spec.fuse_workers)
        return spec

    def connect_options(self) -> ConnectOptions:
        return ConnectOptions(traddr=self.traddr, subnqn=self.nqn, trsvcid=self.trsvcid,
                              hostnqn=self.hostnqn, provider=self.provider,
                              transport=self.transport, hdr_digest=self.hdr_digest,
                              data_digest=self.data_digest, nr_io_queues=self.nr_io_queues,
                              queue_size=self.queue_size, keep_alive_tmo=self.keep_alive_tmo,
                              reconnect_delay=self.reconnect_delay,
                              ctrl_loss_tmo=self.ctrl_loss_tmo, paths=list(self.paths),
                              dhchap_secret=_text(self.dhchap_secret),
                              dhchap_ctrl_secret=_text(self.dhchap_ctrl_secret))

    def mount_options(self) -> MountOptions:
        opts = MountOptions.parse(",".join(self.options))
        if self.fuse_workers != 1:
            opts.fuse_workers = self.fuse_workers
        return opts


def _text(secret: Secret | None) -> str | None:
    return None if secret is None else str(secret)


@dataclass(frozen=True, kw_only=True)
class InitiatorConfig(Model):
    """The whole initiator configuration: the mounts."""

    WHAT: ClassVar[str] = "the initiator configuration"

    mounts: tuple[MountSpec, ...] = setting(ListOf(Nested(MountSpec)), ())
    #: The file this configuration came from (for messages; not part of the configuration).
    path: str = dataclasses.field(default="<dict>", compare=False)

    def _finish(self, where: Where) -> InitiatorConfig:
        at = where.at("mounts")
        for key in ("mountpoint", "name"):
            unique(((at.index(i).at(key), getattr(m, key) if key == "name" else
                     os.path.abspath(m.mountpoint), getattr(m, key))
                    for i, m in enumerate(self.mounts)), f"a {key}")
        return dataclasses.replace(self, path=where.file)

    def find(self, name: str) -> MountSpec | None:
        """The entry called ``name``, or mounted at ``name`` (with or without a leading /,
        as a systemd instance name gives it)."""
        as_path = os.path.abspath("/" + name.lstrip("/"))
        for spec in self.mounts:
            if name == spec.name or as_path == os.path.abspath(spec.mountpoint):
                return spec
        return None


def load(path: str) -> InitiatorConfig:
    """Load and validate the initiator configuration file at ``path``."""
    return loads(read_text(path), path)


def loads(text: str, path: str = "<string>") -> InitiatorConfig:
    """Load and validate the initiator configuration from YAML text (``path`` for messages).
    An empty file, or ``mounts:`` with every entry commented out, is a config of no mounts."""
    doc = parse_yaml(text, path)
    if doc is None:
        doc = {}
    if isinstance(doc, dict) and doc.get("mounts", ()) is None:
        doc = {k: v for k, v in doc.items() if k != "mounts"}
    return InitiatorConfig.load_from(doc, Where(path))

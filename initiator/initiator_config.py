"""The initiator's YAML: mounts that should come up at boot (configs/initiator.yaml).

One model, loaded and validated in one place: a bad file fails whole at load with a
:class:`ConfigError` naming the file, the key path and what was expected, so no mount starts
half-configured.  Defaults match ``blockfabric mount``'s flags (and so nvme-cli's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from blockfabric.errors import ConfigError
from blockfabric.initiator.fusefs import MountOptions
from blockfabric.initiator.host import ConnectOptions
from blockfabric.initiator.multipath import (FORMS, parse_path, parse_path_spec, parse_transport,
                                             resolve_paths)
from blockfabric.protocol.auth import Secret

DEFAULT_PATH = "/etc/blockfabric/initiator.yaml"
PROVIDERS = ("auto", "soft", "verbs")


@dataclass
class MountSpec:
    """One mount: where the subsystem is, where it goes, and how."""

    traddr: str
    nqn: str
    mountpoint: str
    name: str = ""
    trsvcid: int = 4420
    provider: str = "auto"
    #: rdma or tcp (NVMe/TCP), with its digests
    transport: str = "rdma"
    hdr_digest: bool = False
    data_digest: bool = False
    hostnqn: str | None = None
    options: list[str] = field(default_factory=list)
    nr_io_queues: int = 2
    queue_size: int = 128
    keep_alive_tmo: int = 5
    reconnect_delay: int = 10
    ctrl_loss_tmo: int = 600
    #: Further listeners of the subsystem (multipath): (address, port), or (address, port,
    #: transport) for one over its own transport.
    paths: list[tuple] = field(default_factory=list)
    dhchap_secret: str | None = None        # DH-HMAC-CHAP secret of this host
    dhchap_ctrl_secret: str | None = None   # ... and of the controller (bidirectional)

    def connect_options(self) -> ConnectOptions:
        return ConnectOptions(traddr=self.traddr, subnqn=self.nqn, trsvcid=self.trsvcid,
                              hostnqn=self.hostnqn, provider=self.provider,
                              transport=self.transport, hdr_digest=self.hdr_digest,
                              data_digest=self.data_digest, nr_io_queues=self.nr_io_queues, queue_size=self.queue_size,
                              keep_alive_tmo=self.keep_alive_tmo,
                              reconnect_delay=self.reconnect_delay,
                              ctrl_loss_tmo=self.ctrl_loss_tmo, paths=list(self.paths),
                              dhchap_secret=self.dhchap_secret,
                              dhchap_ctrl_secret=self.dhchap_ctrl_secret)

    def mount_options(self) -> MountOptions:
        return MountOptions.parse(",".join(self.options))


@dataclass
class InitiatorConfig:
    path: str
    mounts: list[MountSpec]

    def find(self, name: str) -> MountSpec | None:
        """The entry called ``name``, or mounted at ``name`` (with or without a leading /,
        as a systemd instance name gives it)."""
        as_path = os.path.abspath("/" + name.lstrip("/"))
        for spec in self.mounts:
            if name == spec.name or as_path == os.path.abspath(spec.mountpoint):
                return spec
        return None


_REQUIRED = ("traddr", "nqn", "mountpoint")
_INTS = {"trsvcid": (1, 65535), "nr_io_queues": (1, 1024), "queue_size": (16, 1024),
         "keep_alive_tmo": (0, 3600), "reconnect_delay": (1, 3600),
         "ctrl_loss_tmo": (-1, 1 << 31)}


def load(path: str) -> InitiatorConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(path, "(file)", "a readable YAML file", exc.strerror) from exc
    return loads(text, path)


def loads(text: str, path: str = "<string>") -> InitiatorConfig:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, "(file)", "valid YAML", str(exc).splitlines()[0]) from exc
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(path, "(top level)", "a mapping with the key 'mounts'", doc)
    unknown = set(doc) - {"mounts"}
    if unknown:
        raise ConfigError(path, sorted(unknown)[0], "only 'mounts' at the top level")
    raw = doc.get("mounts") or []
    if not isinstance(raw, list):
        raise ConfigError(path, "mounts", "a list of mounts", raw)
    mounts = [_spec(path, f"mounts[{i}]", item) for i, item in enumerate(raw)]
    seen: dict[str, str] = {}
    for i, spec in enumerate(mounts):
        for key, value in (("mountpoint", os.path.abspath(spec.mountpoint)), ("name", spec.name)):
            if (key, value) in seen:
                raise ConfigError(path, f"mounts[{i}].{key}",
                                  f"a {key} not used by {seen[(key, value)]}", value)
            seen[(key, value)] = f"mounts[{i}]"
    return InitiatorConfig(path, mounts)


def _spec(path: str, where: str, item: Any) -> MountSpec:
    if not isinstance(item, dict):
        raise ConfigError(path, where, "a mapping (traddr, nqn, mountpoint, ...)", item)
    known = {f.name for f in fields(MountSpec)}
    for key in item:
        if key not in known:
            raise ConfigError(path, f"{where}.{key}", f"one of {', '.join(sorted(known))}")
    for key in _REQUIRED:
        if not isinstance(item.get(key), str) or not item[key]:
            raise ConfigError(path, f"{where}.{key}", "a non-empty string", item.get(key))
    if not os.path.isabs(item["mountpoint"]):
        raise ConfigError(path, f"{where}.mountpoint", "an absolute path", item["mountpoint"])
    values = dict(item)
    for key in _INTS:
        if key in values:
            values[key] = _int(path, f"{where}.{key}", key, values[key])
    if values.get("transport", "rdma") not in ("rdma", "tcp"):
        raise ConfigError(path, f"{where}.transport", "rdma or tcp", values["transport"])
    for key in ("hdr_digest", "data_digest"):
        if not isinstance(values.get(key, False), bool):
            raise ConfigError(path, f"{where}.{key}", "true or false", values[key])
    if values.get("provider", "auto") not in PROVIDERS:
        raise ConfigError(path, f"{where}.provider", f"one of {', '.join(PROVIDERS)}",
                          values["provider"])
    opts = values.get("options", [])
    if isinstance(opts, str):
        opts = [w for w in opts.split(",") if w]
    if not isinstance(opts, list) or not all(isinstance(w, str) for w in opts):
        raise ConfigError(path, f"{where}.options", "a list of mount options (or 'a,b')", opts)
    values["options"] = opts
    try:
        MountOptions.parse(",".join(opts))
    except ValueError as exc:
        raise ConfigError(path, f"{where}.options", "valid mount options", str(exc)) from exc
    for key in ("name", "hostnqn"):
        if key in values and values[key] is not None and not isinstance(values[key], str):
            raise ConfigError(path, f"{where}.{key}", "a string", values[key])
    for key in ("dhchap_secret", "dhchap_ctrl_secret"):
        if values.get(key) is not None:
            try:
                Secret.parse(values[key])
            except ValueError as exc:      # the secret itself is not repeated
                raise ConfigError(path, f"{where}.{key}", "a DH-HMAC-CHAP secret "
                                  f"'DHHC-1:XX:<base64 of key and CRC-32>:'; {exc}",
                                  "a secret that does not parse") from None
    if values.get("dhchap_ctrl_secret") is not None and values.get("dhchap_secret") is None:
        raise ConfigError(path, f"{where}.dhchap_secret", "a host secret too (the "
                          "controller authenticates only after the host has)")
    values.setdefault("name", os.path.basename(values["mountpoint"].rstrip("/")) or "root")
    values["paths"] = _paths(path, f"{where}.paths", values.get("paths"),
                             (values["traddr"], values.get("trsvcid", 4420)),
                             values.get("transport", "rdma"))
    return MountSpec(**values)


_PATH_ITEM = f"{FORMS} (as --path), or a mapping {{traddr, trsvcid, transport}}"


def _paths(path: str, where: str, raw: Any, primary: tuple[str, int],
           transport: str) -> list[tuple]:
    """``paths:``: further listeners, each "[tcp://|rdma://]addr:port" or {traddr:, trsvcid:,
    transport:}; the port defaults to the entry's trsvcid, as --path's does to -s, the
    transport to the entry's."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(path, where, f"a list of further paths, each {_PATH_ITEM}", raw)
    parsed: list[tuple[str, int | None]] = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if isinstance(item, str):
            try:
                parsed.append(parse_path_spec(item))
            except ValueError as exc:
                raise ConfigError(path, at, f"{exc} (or a mapping {{traddr, trsvcid, "
                                  "transport}})",
                                  item) from exc
        elif isinstance(item, dict):
            parsed.append(_path_map(path, at, item))
        else:
            raise ConfigError(path, at, _PATH_ITEM, item)
    try:
        return resolve_paths(primary, parsed, transport)
    except ValueError as exc:
        raise ConfigError(path, where, f"paths that differ from each other and from "
                          f"traddr/trsvcid ({exc})") from exc


def _path_map(path: str, at: str, item: dict) -> tuple:
    for key in item:
        if key not in ("traddr", "trsvcid", "transport"):
            raise ConfigError(path, f"{at}.{key}", "one of traddr, trsvcid, transport")
    own: tuple = ()
    if item.get("transport") is not None:
        try:
            own = (parse_transport(item["transport"]),)
        except ValueError as exc:
            raise ConfigError(path, f"{at}.transport", str(exc), item["transport"]) from None
    addr = item.get("traddr")
    if not isinstance(addr, str) or not addr:
        raise ConfigError(path, f"{at}.traddr", "an IPv4 or IPv6 address", addr)
    try:
        address, port = parse_path(f"[{addr}]" if ":" in addr else addr)
    except ValueError:
        port = -1
    if port is not None:
        raise ConfigError(path, f"{at}.traddr", "an IPv4 or IPv6 address (the port goes in "
                          "trsvcid)", addr)
    if item.get("trsvcid") is None:
        return (address, None) + own
    return (address, _int(path, f"{at}.trsvcid", "trsvcid", item["trsvcid"])) + own


def _int(path: str, where: str, kind: str, raw: Any) -> int:
    """An integer setting within its _INTS bounds (digits in a string are accepted)."""
    low, high = _INTS[kind]
    value = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(path, where, f"an integer {low}..{high}", raw)
    return value

"""The target config model: shipped configs, round trips, derived identifiers, atomic dump."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfabric.errors import ConfigError
from blockfabric.sizes import GiB, KiB, MiB
from blockfabric.target import config as cfgmod
from blockfabric.target.config import TargetConfig, default_config, load, loads

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted([ROOT / "configs" / "target.yaml",
                  *(ROOT / "configs" / "examples").glob("*.yaml")])


def test_embedded_default_is_the_shipped_default() -> None:
    assert cfgmod.default_text() == (ROOT / "configs" / "target.yaml").read_text()


def test_default_config_is_a_soft_loopback_ramdisk() -> None:
    cfg = default_config()
    (listener,) = cfg.listeners
    assert (listener.provider, listener.address, listener.port) == ("soft", "127.0.0.1", 4420)
    (sub,) = cfg.subsystems
    assert sub.nqn == "nqn.2026-12.io.blockfabric:ram0" and sub.allow_any_host
    (ns,) = sub.namespaces
    assert (ns.nsid, ns.backend, ns.size, ns.block_size) == (1, "ramdisk", GiB, 4096)
    assert ns.nblocks == GiB // 4096


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path: Path) -> None:
    cfg = load(path)
    assert cfg.source == str(path)
    assert TargetConfig.from_dict(cfg.to_dict()) == cfg
    assert loads(cfg.to_yaml()) == cfg


def test_examples_cover_file_backends_allow_lists_and_two_providers() -> None:
    cfgs = [load(p) for p in SHIPPED]
    namespaces = [ns for c in cfgs for s in c.subsystems for ns in s.namespaces]
    assert {"ramdisk", "file", "null"} <= {ns.backend for ns in namespaces}
    assert any(s.hosts and not s.allow_any_host for c in cfgs for s in c.subsystems)
    assert any({x.provider for x in c.listeners} >= {"soft", "verbs"} for c in cfgs)


MINIMAL = "listeners: [{address: 127.0.0.1}]\n"


def test_defaults_are_filled_in() -> None:
    cfg = loads(MINIMAL + "subsystems: [{nqn: 'nqn.2026-12.io.x:a', namespaces: "
                          "[{nsid: 7, backend: ramdisk, size: 1MiB}]}]\n")
    (listener,) = cfg.listeners
    assert (listener.transport, listener.provider, listener.port, listener.name) == (
        "rdma", "auto", 4420, None)
    sub = cfg.subsystems[0]
    assert (sub.model, sub.allow_any_host, sub.hosts, sub.listeners) == (
        "blockfabric", False, (), None)
    ns = sub.namespaces[0]
    assert (ns.block_size, ns.read_only, ns.path) == (4096, False, None)
    limits = cfg.limits
    assert (limits.queue_size, limits.max_io_queues, limits.inline_data_size, limits.mdts,
            limits.max_connections_per_host, limits.connect_timeout) == (
        128, 8, 4 * KiB, MiB, 64, 10)
    assert (cfg.keep_alive.kas_ms, cfg.metrics) == (1000, None)
    assert cfg.control_socket == "/run/blockfabric/target.sock"
    # Unset values stay out of the effective dict; explicit nulls mean "unset" too.
    assert "name" not in cfg.to_dict()["listeners"][0]
    assert "metrics" not in cfg.to_dict()
    assert loads(MINIMAL + "metrics: null\n") == loads(MINIMAL)


def test_derived_identifiers_are_stable_and_distinct() -> None:
    text = MINIMAL + """subsystems:
  - nqn: nqn.2026-12.io.x:a
    namespaces: [{nsid: 1, backend: ramdisk, size: 1MiB}, {nsid: 2, backend: "null", size: 1MiB}]
  - nqn: nqn.2026-12.io.x:b
    namespaces: [{nsid: 1, backend: ramdisk, size: 1MiB}]
"""
    first, second = loads(text), loads(text)
    assert first == second
    namespaces = [ns for s in first.subsystems for ns in s.namespaces]
    assert len({ns.uuid for ns in namespaces}) == 3
    assert len({ns.nguid for ns in namespaces}) == 3
    assert len({s.serial for s in first.subsystems}) == 2
    for ns in namespaces:
        assert str(uuid.UUID(ns.uuid)) == ns.uuid
        assert len(bytes.fromhex(ns.nguid)) == 16
    assert all(len(s.serial) == 20 and s.serial.isascii() for s in first.subsystems)


def test_explicit_identifiers_are_kept_and_normalised() -> None:
    cfg = loads(MINIMAL + """subsystems:
  - nqn: nqn.2026-12.io.x:a
    serial: "0042"
    namespaces:
      - {nsid: 1, backend: ramdisk, size: 1MiB, uuid: 8461E01D-D0AC-5CAD-99EC-C786FE9EB7DC,
         nguid: A9181484343B7DBCEF4D6F71A86B2B1D}
""")
    sub = cfg.subsystems[0]
    assert sub.serial == "0042"
    assert sub.namespaces[0].uuid == "8461e01d-d0ac-5cad-99ec-c786fe9eb7dc"
    assert sub.namespaces[0].nguid == "a9181484343b7dbcef4d6f71a86b2b1d"
    assert "'0042'" in cfg.to_yaml()   # quoted on dump, or it would come back as an int


def test_ipv6_addresses_are_canonical_and_endpoints_bracketed() -> None:
    cfg = loads("listeners:\n  - address: ::1\n  - {address: '2001:DB8:0::10'}\n")
    assert [x.address for x in cfg.listeners] == ["::1", "2001:db8::10"]
    assert [x.endpoint for x in cfg.listeners] == ["[::1]:4420", "[2001:db8::10]:4420"]


def test_unquoted_ipv6_that_yaml_reads_as_a_number_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match="quote IPv6"):
        loads("listeners:\n  - address: 2001:0:0:0:0:0:0:1\n")


def test_ipv4_and_ipv6_wildcards_may_share_a_port() -> None:
    cfg = loads("listeners: [{address: 0.0.0.0}, {address: '::'}]\n")
    assert len(cfg.listeners) == 2


def test_listeners_for_honours_restrictions_by_name_or_endpoint() -> None:
    cfg = loads("""listeners:
  - {name: a, address: 127.0.0.1}
  - {name: b, address: 127.0.0.1, port: 4421}
  - {address: 127.0.0.2, port: 8009}
subsystems:
  - {nqn: 'nqn.2026-12.io.x:all', allow_any_host: true}
  - {nqn: 'nqn.2026-12.io.x:some', listeners: [b, '127.0.0.2:8009']}
""")
    every, some = cfg.subsystems
    assert cfg.listeners_for(every) == cfg.listeners
    assert [x.endpoint for x in cfg.listeners_for(some)] == ["127.0.0.1:4421", "127.0.0.2:8009"]
    assert cfg.subsystem("nqn.2026-12.io.x:some") is some and cfg.subsystem("nqn.x") is None
    assert every.allows("nqn.2014-08.org.nvmexpress:uuid:any") and not some.allows("nqn.h")


def test_yaml_anchors_and_merge_keys_work() -> None:
    cfg = loads(MINIMAL + """subsystems:
  - nqn: nqn.2026-12.io.x:a
    namespaces:
      - &ns {nsid: 1, backend: ramdisk, size: 1MiB}
      - {<<: *ns, nsid: 2}
""")
    assert [ns.nsid for ns in cfg.subsystems[0].namespaces] == [1, 2]


def test_error_carries_file_key_and_expectation() -> None:
    with pytest.raises(ConfigError) as info:
        TargetConfig.from_dict({"listeners": [{"address": "127.0.0.1", "port": 0}]},
                               path="/etc/x.yaml")
    error = info.value
    assert (error.path, error.key, error.got) == ("/etc/x.yaml", "listeners[0].port", 0)
    assert "1 to 65535" in info.value.expected


# --- generated configurations round-trip ----------------------------------------------------

_namespace = st.fixed_dictionaries(
    {"backend": st.sampled_from(["ramdisk", "null", "file"]),
     "blocks": st.integers(1, 1 << 20), "block_size": st.sampled_from([512, 4096])},
    optional={"read_only": st.booleans()})


@st.composite
def _configs(draw: st.DrawFn) -> dict:
    subsystems = []
    for s in range(draw(st.integers(0, 3))):
        namespaces = []
        nsids = draw(st.lists(st.integers(1, 1024), unique=True, max_size=4))
        for nsid in nsids:
            ns = draw(_namespace)
            entry = {"nsid": nsid, "backend": ns["backend"], "block_size": ns["block_size"],
                     "size": ns["blocks"] * ns["block_size"]}
            if ns["backend"] == "file":
                entry["path"] = f"/srv/bf/s{s}-n{nsid}.img"
            if "read_only" in ns:
                entry["read_only"] = ns["read_only"]
            namespaces.append(entry)
        sub = {"nqn": f"nqn.2026-12.io.blockfabric:s{s}", "namespaces": namespaces}
        if draw(st.booleans()):
            sub["allow_any_host"] = True
        else:
            sub["hosts"] = [f"nqn.2014-08.org.nvmexpress:uuid:{uuid.UUID(int=h)}"
                            for h in draw(st.lists(st.integers(0, 1 << 128 - 1), unique=True,
                                                   max_size=3))]
        subsystems.append(sub)
    ports = draw(st.lists(st.integers(1, 65535), min_size=1, max_size=3, unique=True))
    return {"listeners": [{"address": "127.0.0.1", "port": p,
                           "provider": draw(st.sampled_from(["auto", "soft", "verbs"]))}
                          for p in ports],
            "subsystems": subsystems,
            "limits": {"queue_size": draw(st.integers(16, 1024)),
                       "mdts": 4096 << draw(st.integers(0, 11))}}


@settings(derandomize=True, max_examples=60, deadline=None)
@given(_configs())
def test_generated_configs_round_trip(data: dict) -> None:
    cfg = TargetConfig.from_dict(data)
    effective = cfg.to_dict()
    assert TargetConfig.from_dict(effective) == cfg
    assert TargetConfig.from_dict(effective).to_dict() == effective
    assert loads(cfg.to_yaml()) == cfg


# --- atomic dump ----------------------------------------------------------------------------

def test_dump_replaces_atomically_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "target.yaml"
    path.write_text("old contents\n")
    old_inode = path.stat().st_ino
    cfg = default_config()
    cfg.dump(path)
    assert load(path) == cfg
    st_ = path.stat()
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_ino != old_inode          # a new file renamed over, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target.yaml"]


def test_failed_dump_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        default_config().dump(target)        # rename over a non-empty directory fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]
    assert (target / "keep").read_text() == "x"


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_dump_fsyncs_file_then_renames_then_fsyncs_directory(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    out = tmp_path / "cfg" / "target.yaml"
    out.parent.mkdir()
    code = (f"from blockfabric.target.config import default_config; "
            f"default_config().dump({str(out)!r})")
    subprocess.run(["strace", "-o", str(trace), "-e", "trace=fsync,fdatasync,rename,renameat,"
                    "renameat2", sys.executable, "-c", code], check=True, timeout=60)
    calls = [line.split("(")[0] for line in trace.read_text().splitlines()
             if line.startswith(("fsync", "fdatasync", "rename"))]
    assert calls[0] == "fsync" and calls[1].startswith("rename") and calls[2] == "fsync", calls
    assert os.stat(out).st_size > 0


def test_listener_limits_and_cpda() -> None:
    """A listener's limits may only lower the global ones; cpda is NVMe/TCP's."""
    good = loads("listeners:\n  - {transport: tcp, address: 127.0.0.1, port: 4420, cpda: 7,"
                 " max_connections: 10, max_io_queues: 2, queue_size: 32}\n")
    lst = good.listeners[0]
    assert (lst.cpda, lst.max_connections, lst.max_io_queues, lst.queue_size) == (7, 10, 2, 32)
    assert loads("listeners:\n  - {address: 127.0.0.1}\n").listeners[0].max_connections is None
    for text, match in (
            ("  - {address: 127.0.0.1, cpda: 1}\n", "cpda applies to NVMe/TCP"),
            ("  - {transport: tcp, address: 127.0.0.1, cpda: 32}\n", "0 to 31"),
            ("  - {address: 127.0.0.1, max_io_queues: 9}\n", r"at most limits.max_io_queues"),
            ("  - {address: 127.0.0.1, queue_size: 256}\nlimits: {queue_size: 64}\n",
             r"at most limits.queue_size \(64\)")):
        with pytest.raises(ConfigError, match=match):
            loads("listeners:\n" + text)

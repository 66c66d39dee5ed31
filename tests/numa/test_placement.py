"""NUMA placement decided from a fake sysfs tree of several nodes (blockfabric/numa.py), and
the memory syscalls on this machine (one node: they succeed or degrade with a warning)."""

from __future__ import annotations

import logging
import mmap

import pytest

from blockfabric import numa
from blockfabric.errors import ConfigError
from blockfabric.numa import Placement, PlacementError, Topology, resolve
from blockfabric.target import config as cfg

from .conftest import make_sysfs


def test_cpu_lists_parse_and_format_like_the_kernel():
    assert numa.parse_cpulist("0-3,8") == {0, 1, 2, 3, 8}
    assert numa.parse_cpulist(" 0-7:2 ") == {0, 2, 4, 6}
    assert numa.parse_cpulist(5) == {5}
    assert numa.parse_cpulist("") == frozenset()
    assert numa.format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("3-1", "a", "1,,2", "-1", "0-3:0", "1-"):
        with pytest.raises(ValueError):
            numa.parse_cpulist(bad)


def test_topology_reads_nodes_cpus_and_each_nics_node(four_nodes):
    topo = Topology(four_nodes)
    assert topo.nodes() == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}, 2: {8, 9, 10, 11},
                            3: {12, 13, 14, 15}}
    assert topo.node_of_cpus({5, 6}) == 1 and topo.node_of_cpus({3, 4}) is None
    assert topo.nic_node("eth0") == (1, "netdev eth0")
    assert topo.nic_node("eth0", rdma=True) == (1, "RDMA device mlx5_0 of eth0")
    # a soft RDMA device has no PCI function: its parent netdev's node
    assert topo.nic_node("eth1", rdma=True) == (3, "RDMA device rxe0 of eth1")
    assert topo.nic_node("vlan10")[0] == 1          # through lower_eth0
    assert topo.nic_node("bond0")[0] is None        # its legs disagree
    assert topo.nic_node("lo")[0] is None           # numa_node -1
    assert topo.nic_node("nosuch")[0] is None
    assert topo.nic_node("../../etc")[0] is None


def test_sysfs_root_comes_from_the_environment(four_nodes, monkeypatch):
    monkeypatch.setenv(numa.SYSFS_ENV, str(four_nodes))
    assert sorted(Topology().nodes()) == [0, 1, 2, 3]


def test_auto_places_on_the_nic_node_and_its_cpus(four_nodes):
    topo = Topology(four_nodes)
    nics = [("listener 10.0.0.1:4420", *topo.nic_node("eth0", rdma=True)),
            ("listener 0.0.0.0:4420", None, "wildcard address: any NIC")]
    p = resolve("auto", None, nics, topology=topo)
    assert p.cpus == {4, 5, 6, 7} and p.node == 1 and p.policy == "preferred"
    assert "mlx5_0" in p.reason


def test_explicit_node_or_cpus_win_over_the_nic(four_nodes):
    topo = Topology(four_nodes)
    nics = [("listener a", 1, "netdev eth0")]
    p = resolve(2, None, nics, topology=topo, policy="bind")
    assert (p.cpus, p.node, p.policy) == ({8, 9, 10, 11}, 2, "bind")
    p = resolve("auto", frozenset({12, 13}), nics, topology=topo)
    assert (p.cpus, p.node) == ({12, 13}, 3)        # memory follows the CPUs' node
    p = resolve(2, frozenset({0}), nics, topology=topo)
    assert (p.cpus, p.node) == ({0}, 2)             # both given: both as given
    p = resolve("none", frozenset({1}), nics, topology=topo)
    assert (p.cpus, p.node) == ({1}, None)
    assert resolve("none", None, nics, topology=topo) == Placement(reason="numa_node: none")


def test_nics_on_different_nodes_place_nothing_and_say_why(four_nodes):
    topo = Topology(four_nodes)
    p = resolve("auto", None, [("listener a", 1, "eth0"), ("listener b", 3, "eth1")],
                topology=topo)
    assert not p.placed and "listener a on node 1; listener b on node 3" in p.reason
    assert not resolve("auto", None, [("l", None, "lo")], topology=topo).placed


def test_a_one_node_machine_changes_nothing(tmp_path):
    topo = Topology(make_sysfs(tmp_path / "sys", {0: "0-7"}, netdevs={"eth0": 0}))
    p = resolve("auto", None, [("listener a", 0, "netdev eth0")], topology=topo)
    assert p == Placement(reason="one NUMA node") and not p.placed
    # a kernel without NUMA (no node directory) is one node too
    bare = tmp_path / "bare"
    (bare / "devices/system/cpu").mkdir(parents=True)
    (bare / "devices/system/cpu/online").write_text("0-3\n")
    assert Topology(bare).nodes() == {0: {0, 1, 2, 3}}


def test_nodes_and_cpus_not_present_are_refused_naming_the_key(four_nodes):
    topo = Topology(four_nodes)
    with pytest.raises(PlacementError) as exc:
        resolve(7, None, topology=topo)
    assert exc.value.key == "numa_node" and "0, 1, 2, 3" in str(exc.value)
    with pytest.raises(PlacementError) as exc:
        resolve("auto", frozenset({3, 16, 17}), topology=topo)
    assert exc.value.key == "cpus" and "16-17 not online" in str(exc.value)


def test_config_keys_validate_against_the_machine(four_nodes, monkeypatch):
    monkeypatch.setenv(numa.SYSFS_ENV, str(four_nodes))
    base = {"listeners": [{"address": "127.0.0.1"}]}
    conf = cfg.TargetConfig.from_dict(dict(base, numa_node=3, cpus="12-13,15",
                                           numa_memory="bind"), "t.yaml")
    assert (conf.numa_node, conf.cpus, conf.numa_memory) == (3, {12, 13, 15}, "bind")
    assert conf.to_dict()["cpus"] == "12-13,15"
    assert cfg.TargetConfig.from_dict(base).numa_node == "auto"
    for key, value, words in (("numa_node", 4, "a node of this machine (0, 1, 2, 3)"),
                              ("numa_node", "far", "auto, none or a NUMA node number"),
                              ("numa_node", True, "auto, none"),
                              ("cpus", "0-3,x", "CPU list"),
                              ("cpus", "", "CPU list"),
                              ("cpus", [1, 2], "CPU list"),
                              ("cpus", "14-20", "16-20 not online"),
                              ("numa_memory", "interleave", "preferred, bind")):
        with pytest.raises(ConfigError) as exc:
            cfg.TargetConfig.from_dict(dict(base, **{key: value}), "t.yaml")
        assert exc.value.key == key and words in str(exc.value), str(exc.value)


def test_worker_placement_spreads_the_cpus_over_workers():
    p = Placement(frozenset(range(4, 12)), 1, reason="auto")
    shares = [numa.worker_placement(p, i, 4).cpus for i in range(4)]
    assert shares == [{4, 5}, {6, 7}, {8, 9}, {10, 11}]
    assert all(numa.worker_placement(p, i, 4).node == 1 for i in range(4))
    many = [numa.worker_placement(p, i, 10).cpus for i in range(10)]
    assert many[0] == {4} and many[7] == {11} and many[8] == {4}     # wraps round
    assert numa.worker_placement(numa.NONE, 0, 2) == numa.NONE


# --- the syscalls, on this machine --------------------------------------------------------

def test_mbind_on_this_machine_binds_or_degrades_cleanly(caplog):
    region = mmap.mmap(-1, 1 << 20)
    try:
        try:
            numa.mbind(region, 0, "bind")
        except OSError as exc:          # a kernel without NUMA: ENOSYS
            pytest.skip(f"mbind unavailable here: {exc}")
        addr, _ = numa.region_address(region)
        assert numa.region_policy(addr) == ("bind", 0)
        region[:3 * mmap.PAGESIZE] = b"x" * 3 * mmap.PAGESIZE     # fault three pages in
        maps = {start: (policy, pages) for start, policy, pages in numa.numa_maps()}
        assert maps[addr][0] == "bind:0" and maps[addr][1].get(0, 0) >= 3
        # a node this machine does not have: refused by the kernel, reported, no exception
        with pytest.raises(OSError):
            numa.mbind(region, 63)
    finally:
        region.close()


def test_bind_region_follows_the_applied_placement_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(numa, "_current", Placement(node=0, policy="preferred"))
    monkeypatch.setattr(numa, "_mbind_warned", False)
    region = mmap.mmap(-1, 8 * mmap.PAGESIZE)
    try:
        if not numa.bind_region(region, "test regions"):
            pytest.skip("mbind unavailable here")
        region[:mmap.PAGESIZE] = b"y" * mmap.PAGESIZE
        report = {m["what"]: m for m in numa.memory_report()}["test regions"]
        assert report["policy"] == "prefer:0" and report["pages_by_node"] == {"0": 1}
        assert report["bytes"] == 8 * mmap.PAGESIZE
        monkeypatch.setattr(numa, "_current", Placement(node=63))
        with caplog.at_level(logging.WARNING, "blockfabric.numa"):
            assert not numa.bind_region(region, "far")
            assert not numa.bind_region(region, "far")
        assert len([r for r in caplog.records if "mbind to node 63" in r.message]) == 1
    finally:
        region.close()
    assert "test regions" not in {m["what"] for m in numa.memory_report()}   # closed: gone


def test_unplaced_process_binds_nothing(monkeypatch):
    monkeypatch.setattr(numa, "_current", numa.NONE)
    region = mmap.mmap(-1, mmap.PAGESIZE)
    assert not numa.bind_region(region, "x")
    region.close()


def test_place_worker_without_a_placement_touches_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(numa, "apply", lambda p, what="": calls.append(p) or p)
    assert numa.place_worker(numa.NONE, 1, 4) == numa.NONE and calls == []
    p = Placement(frozenset({2, 3}), 0, reason="cpus")
    assert numa.place_worker(p, 1, 2).cpus == {3} and calls[0].cpus == {3}


def test_place_target_reads_each_listeners_nic(tmp_path, monkeypatch):
    """lo has node 1 in the fake tree; a wildcard listener says nothing; an address no
    interface has says so (nothing is applied here: apply is replaced)."""
    monkeypatch.setenv(numa.SYSFS_ENV, str(make_sysfs(tmp_path / "sys", {0: "0-1", 1: "2-3"},
                                                      netdevs={"lo": 1})))
    applied = []
    monkeypatch.setattr(numa, "apply", lambda p, what="": applied.append(p) or p)
    assert numa.nic_of_address("0.0.0.0") == (None, "wildcard address: any NIC")
    assert numa.nic_of_address("192.0.2.77")[0] is None
    conf = cfg.TargetConfig.from_dict({"listeners": [
        {"address": "127.0.0.1", "transport": "tcp"},
        {"address": "0.0.0.0", "port": 4421}]})
    p = numa.place_target(conf)
    assert (p.cpus, p.node) == ({2, 3}, 1) and applied == [p]
    assert "listener 127.0.0.1:4420: netdev lo on node 1" in p.reason
    none = cfg.TargetConfig.from_dict({"listeners": [{"address": "0.0.0.0"}]})
    assert not numa.place_target(none).placed and len(applied) == 1

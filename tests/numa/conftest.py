"""A fake sysfs tree (``BLOCKFABRIC_SYSFS``) with several NUMA nodes and NICs on them."""

from __future__ import annotations

import pathlib

import pytest


def make_sysfs(root: pathlib.Path, nodes: dict[int, str], *, online: str | None = None,
               netdevs: dict[str, int] | None = None,
               rdma: dict[str, tuple[str, int | None]] | None = None,
               lowers: dict[str, list[str]] | None = None) -> pathlib.Path:
    """``nodes``: node -> cpulist; ``netdevs``: ifname -> numa_node (-1: none);
    ``rdma``: device -> (its netdev, its numa_node or None for a soft device with a
    parent); ``lowers``: ifname -> the interfaces below it (a VLAN, a bond)."""
    def write(rel: str, text: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    if online is None:
        from blockfabric.numa import format_cpulist, parse_cpulist
        online = format_cpulist(set().union(*(parse_cpulist(c) for c in nodes.values())))
    write("devices/system/cpu/online", online)
    for node, cpus in nodes.items():
        write(f"devices/system/node/node{node}/cpulist", cpus)
    (root / "devices/system/node/possible").write_text("0\n")   # not a node directory
    for ifname, node in (netdevs or {}).items():
        write(f"class/net/{ifname}/device/numa_node", str(node))
    for ifname, below in (lowers or {}).items():
        (root / f"class/net/{ifname}").mkdir(parents=True, exist_ok=True)
        for low in below:
            (root / f"class/net/{ifname}/lower_{low}").symlink_to(root / f"class/net/{low}")
    for dev, (ifname, node) in (rdma or {}).items():
        if node is None:
            write(f"class/infiniband/{dev}/parent", ifname)
        else:
            write(f"class/infiniband/{dev}/device/numa_node", str(node))
        write(f"class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0", ifname)
    return root


@pytest.fixture
def four_nodes(tmp_path):
    """Four nodes of four CPUs; eth0 (and its RDMA device mlx5_0) on node 1, eth1 on node
    3, lo without a node, vlan10 on eth0, bond0 over eth0 and eth1."""
    return make_sysfs(tmp_path / "sys", {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"},
                      netdevs={"eth0": 1, "eth1": 3, "lo": -1},
                      rdma={"mlx5_0": ("eth0", 1), "rxe0": ("eth1", None)},
                      lowers={"vlan10": ["eth0"], "bond0": ["eth0", "eth1"]})

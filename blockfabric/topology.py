"""Where things are on this machine: CPU lists, NUMA nodes and their CPUs, a NIC's node.

:class:`Topology` reads the machine from sysfs: the nodes present and their CPUs
(``devices/system/node/nodeN/cpulist``), the online CPUs, and a NIC's node (the RDMA
device's ``class/infiniband/DEV/device/numa_node``, or the netdev's
``class/net/IF/device/numa_node``, following ``lower_*`` links through VLANs and bonds).
Every read goes through one root, ``/sys`` unless ``BLOCKFABRIC_SYSFS`` names another
(operators debugging a placement, tests with a fake tree of several nodes).
:func:`interface_of` (the interface that owns a listener's address) and
:func:`route_interface` (the interface a host reaches a target through) ask the kernel by
netlink (pyroute2); loopback and virtual devices have no node.  Only reads: deciding and
applying a placement is :mod:`blockfabric.numa`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

#: Environment variable naming the sysfs root (default /sys).
SYSFS_ENV = "BLOCKFABRIC_SYSFS"


# --------------------------------------------------------------------------- CPU lists

def parse_cpulist(text: str | int) -> frozenset[int]:
    """The kernel's CPU list syntax (``0-3,8``, ``0-7:2`` with a stride), as in
    ``cpulist`` files and ``taskset -c``.  Raises ValueError saying what is wrong."""
    if isinstance(text, bool):
        raise ValueError("a CPU list such as \"0-3,8\"")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"CPU {text} is negative")
        return frozenset((text,))
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        rng, _, stride_text = part.partition(":")
        lo_text, dash, hi_text = rng.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
            stride = int(stride_text) if stride_text else 1
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or range (a-b, a-b:stride)") \
                from None
        if lo < 0 or hi < lo or stride < 1 or hi >= 1 << 16:
            raise ValueError(f"{part!r} is not a CPU range from low to high")
        cpus.update(range(lo, hi + 1, stride))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8}`` -> ``0-3,8``."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# --------------------------------------------------------------------------- sysfs

def sysfs_root() -> Path:
    return Path(os.environ.get(SYSFS_ENV) or "/sys")


def read_text(path: Path) -> str | None:
    """A small text file (sysfs, procfs), stripped; None if it cannot be read."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


class Topology:
    """The machine as sysfs under ``root`` describes it (read on each call: cheap, and a
    CPU may go offline)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else sysfs_root()

    def online_cpus(self) -> frozenset[int]:
        text = read_text(self.root / "devices/system/cpu/online")
        if text is None:
            return frozenset(range(os.cpu_count() or 1))
        return parse_cpulist(text)

    def nodes(self) -> dict[int, frozenset[int]]:
        """Node number -> its online CPUs, for every node present.  A kernel without NUMA
        (no node directory) is one node 0 with every online CPU."""
        base = self.root / "devices/system/node"
        out: dict[int, frozenset[int]] = {}
        try:
            entries = list(base.iterdir())
        except OSError:
            entries = []
        online = self.online_cpus()
        for entry in entries:
            name = entry.name
            if not (name.startswith("node") and name[4:].isdigit()):
                continue
            text = read_text(entry / "cpulist")
            try:
                cpus = parse_cpulist(text) if text is not None else frozenset()
            except ValueError:
                cpus = frozenset()
            out[int(name[4:])] = cpus & online
        return dict(sorted(out.items())) or {0: online}

    def node_of_cpus(self, cpus: Iterable[int]) -> int | None:
        """The one node holding all of ``cpus``; None when they span nodes."""
        cpus = set(cpus)
        found = {n for n, node_cpus in self.nodes().items() if cpus & node_cpus}
        return found.pop() if len(found) == 1 else None

    def _node_file(self, path: Path) -> int | None:
        text = read_text(path)
        try:
            node = int(text) if text is not None else -1
        except ValueError:
            return None
        return node if node >= 0 else None

    def netdev_node(self, ifname: str, _depth: int = 0) -> int | None:
        """The node of network interface ``ifname``'s device; through VLANs, bonds and
        macvlans (``lower_*`` links) when all the devices below agree; None for loopback
        and other virtual devices."""
        if not ifname or "/" in ifname or ifname in (".", ".."):
            return None
        dev = self.root / "class/net" / ifname
        node = self._node_file(dev / "device/numa_node")
        if node is not None or _depth > 4:
            return node
        try:
            lowers = [e.name[6:] for e in dev.iterdir() if e.name.startswith("lower_")]
        except OSError:
            return None
        found = {self.netdev_node(low, _depth + 1) for low in lowers}
        return found.pop() if len(found) == 1 else None

    def rdma_devices(self, ifname: str) -> list[str]:
        """The RDMA devices serving netdev ``ifname`` (RoCE GIDs on it, a device whose PCI
        function is it, or a soft device whose parent it is)."""
        base = self.root / "class/infiniband"
        try:
            devs = sorted(e.name for e in base.iterdir())
        except OSError:
            return []
        out = []
        for dev in devs:
            d = base / dev
            if (d / "device/net" / ifname).exists() or read_text(d / "parent") == ifname:
                out.append(dev)
                continue
            try:
                ndevs = [read_text(f) for f in d.glob("ports/*/gid_attrs/ndevs/*")]
            except OSError:
                ndevs = []
            if ifname in ndevs:
                out.append(dev)
        return out

    def rdma_node(self, dev: str) -> int | None:
        """The node of RDMA device ``dev`` (a soft device: its parent netdev's)."""
        d = self.root / "class/infiniband" / dev
        node = self._node_file(d / "device/numa_node")
        if node is None:
            parent = read_text(d / "parent")
            if parent:
                node = self.netdev_node(parent)
        return node

    def nic_node(self, ifname: str | None, rdma: bool = False) -> tuple[int | None, str]:
        """The node of the NIC behind ``ifname`` and how it was found (for the logs and
        ``status``).  ``rdma``: ask the RDMA device first (it is what moves the data)."""
        if not ifname:
            return None, "no interface"
        if rdma:
            for dev in self.rdma_devices(ifname):
                node = self.rdma_node(dev)
                if node is not None:
                    return node, f"RDMA device {dev} of {ifname}"
        node = self.netdev_node(ifname)
        if node is None:
            return None, f"{ifname} has no NUMA node (loopback or virtual)"
        return node, f"netdev {ifname}"


# --------------------------------------------------------------------------- interfaces

def interface_of(address: str) -> str | None:
    """The interface that owns ``address`` (a listener's); None for a wildcard address or
    one no interface has."""
    import ipaddress
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    try:
        from pyroute2 import IPRoute
        with IPRoute() as ipr:
            for msg in ipr.get_addr(family=10 if ip.version == 6 else 2):
                if msg.get_attr("IFA_ADDRESS") == str(ip) or msg.get_attr("IFA_LOCAL") == str(ip):
                    return _ifname(ipr, msg["index"])
    except Exception as exc:  # noqa: BLE001 - best effort: no placement, not no target
        log.debug("interface of %s: %s", address, exc)
    return None


def route_interface(address: str) -> str | None:
    """The interface the kernel routes ``address`` through (the host's side)."""
    try:
        from pyroute2 import IPRoute
        with IPRoute() as ipr:
            routes = ipr.route("get", dst=address)
            if routes:
                oif = routes[0].get_attr("RTA_OIF")
                if oif is not None:
                    return _ifname(ipr, oif)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("route to %s: %s", address, exc)
    return None


def _ifname(ipr: Any, index: int) -> str | None:
    links = ipr.get_links(index)
    return links[0].get_attr("IFLA_IFNAME") if links else None


def nic_of_address(address: str, rdma: bool = False,
                   topology: Topology | None = None) -> tuple[int | None, str]:
    """The node of the NIC owning local ``address`` (a listener's), and how it was found."""
    import ipaddress
    try:
        if ipaddress.ip_address(address).is_unspecified:
            return None, "wildcard address: any NIC"
    except ValueError:
        return None, "not an address"
    ifname = interface_of(address)
    if ifname is None:
        return None, "no interface has this address"
    return (topology or Topology()).nic_node(ifname, rdma)

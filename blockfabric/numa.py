"""NUMA placement: which node a NIC is on, that node's CPUs, pinning, and memory binding.

A reactor on the far socket from its NIC, or registered memory on the far node, costs every
I/O a trip across the inter-socket link.  This module finds where things are and puts a
process (its threads and its memory) next to its NIC:

- :class:`Topology` reads the machine from sysfs: the nodes present and their CPUs
  (``devices/system/node/nodeN/cpulist``), the online CPUs, and a NIC's node (the RDMA
  device's ``class/infiniband/DEV/device/numa_node``, or the netdev's
  ``class/net/IF/device/numa_node``, following ``lower_*`` links through VLANs and bonds).
  Every read goes through one root, ``/sys`` unless ``BLOCKFABRIC_SYSFS`` names another
  (operators debugging a placement, tests with a fake tree of several nodes).
- :func:`interface_of` (the interface that owns a listener's address) and
  :func:`route_interface` (the interface a host reaches a target through) ask the kernel by
  netlink (pyroute2); loopback and virtual devices have no node.
- :func:`resolve` turns ``numa_node: auto | none | N`` and ``cpus:`` into a
  :class:`Placement`; :func:`apply` pins every thread of the process (``sched_setaffinity``)
  and sets the memory policy of the calling thread (``set_mempolicy``, inherited by the
  threads it starts); :func:`bind_region` binds one mmap'd region (``mbind``) before it is
  touched, which :class:`~blockfabric.fabric.buffers.BufferPool` and the ramdisk backend do
  for their memory once a placement is applied.  Where the kernel refuses (no NUMA support,
  a node that is not there, an architecture whose syscall numbers are not known here) the
  process runs unplaced and a warning says why.
- :func:`worker_placement` cuts a placement into one CPU set per worker (poll groups).

docs/numa.md is the operator's side of this.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import logging
import mmap
import os
import platform
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable

from blockfabric.errors import BlockfabricError

log = logging.getLogger(__name__)

#: Environment variable naming the sysfs root (default /sys).
SYSFS_ENV = "BLOCKFABRIC_SYSFS"

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_F_ADDR = 1 << 1
POLICIES = {"preferred": MPOL_PREFERRED, "bind": MPOL_BIND}

#: (mbind, set_mempolicy, get_mempolicy) per machine; aarch64 and riscv64 use the generic
#: table (asm-generic/unistd.h).  Unknown architectures run unplaced, with a warning.
SYSCALLS = {
    "x86_64": (237, 238, 239),
    "aarch64": (235, 237, 236),
    "arm64": (235, 237, 236),
    "riscv64": (235, 237, 236),
}

_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


class PlacementError(BlockfabricError, ValueError):
    """A placement setting that cannot be honoured on this machine; ``key`` names it."""

    def __init__(self, key: str, expected: str, got: object) -> None:
        super().__init__(f"{key}: expected {expected}, got {got}")
        self.key, self.expected, self.got = key, expected, got


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


def _read(path: Path) -> str | None:
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
        text = _read(self.root / "devices/system/cpu/online")
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
            text = _read(entry / "cpulist")
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
        text = _read(path)
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
            if (d / "device/net" / ifname).exists() or _read(d / "parent") == ifname:
                out.append(dev)
                continue
            try:
                ndevs = [_read(f) for f in d.glob("ports/*/gid_attrs/ndevs/*")]
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
            parent = _read(d / "parent")
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


# --------------------------------------------------------------------------- placement

@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a process runs: ``cpus`` (None: not pinned) and the ``node`` its memory comes
    from under ``policy`` (None: the kernel's default, local allocation).  ``reason``
    says why, for the logs and ``status``."""

    cpus: frozenset[int] | None = None
    node: int | None = None
    policy: str = "preferred"
    reason: str = "not placed"

    @property
    def placed(self) -> bool:
        return self.cpus is not None or self.node is not None

    def as_dict(self) -> dict[str, Any]:
        return {"cpus": format_cpulist(self.cpus) if self.cpus is not None else None,
                "node": self.node, "memory_policy": self.policy if self.node is not None
                else "default", "reason": self.reason}


NONE = Placement()


def resolve(numa_node: str | int, cpus: frozenset[int] | None,
            nics: Iterable[tuple[str, int | None, str]] = (), *,
            policy: str = "preferred", topology: Topology | None = None,
            keys: tuple[str, str] = ("numa_node", "cpus")) -> Placement:
    """The placement for ``numa_node`` (``auto``, ``none`` or a node number) and ``cpus``
    (None: unset), given the NICs of the listeners or routes as (label, node, how).

    ``auto``: the NICs' node when they agree and the machine has more than one node (else
    nothing: a one-node machine runs as if unplaced); with ``cpus`` set, the node holding
    those CPUs.  An explicit node or CPU list always wins over the NICs.  Raises
    :class:`PlacementError` naming the key (``keys``) for a node or CPU not present."""
    topo = topology or Topology()
    nodes = topo.nodes()
    if cpus is not None:
        online = topo.online_cpus()
        if not cpus:
            raise PlacementError(keys[1], "at least one CPU", '""')
        missing = cpus - online
        if missing:
            raise PlacementError(keys[1], f"online CPUs of this machine ({format_cpulist(online)})",
                                 f"{format_cpulist(cpus)} ({format_cpulist(missing)} not online)")
    if isinstance(numa_node, int) and not isinstance(numa_node, bool):
        if numa_node not in nodes:
            raise PlacementError(keys[0], f"auto, none or a node of this machine "
                                 f"({', '.join(map(str, nodes))})", numa_node)
        node_cpus = nodes[numa_node]
        return Placement(cpus if cpus is not None else (node_cpus or None), numa_node, policy,
                         f"{keys[0]}: {numa_node}" + (f", {keys[1]}" if cpus is not None else ""))
    if numa_node == "none":
        return Placement(cpus, None, policy, f"{keys[1]} (memory not placed)"
                         if cpus is not None else f"{keys[0]}: none")
    if numa_node != "auto":
        raise PlacementError(keys[0], "auto, none or a node number", numa_node)
    if cpus is not None:
        node = topo.node_of_cpus(cpus) if len(nodes) > 1 else None
        return Placement(cpus, node, policy, f"{keys[1]}" + (
            f" (all on node {node})" if node is not None else ""))
    if len(nodes) <= 1:
        return Placement(reason="one NUMA node")
    nics = list(nics)
    known = {node for _label, node, _how in nics if node is not None}
    if not known:
        return Placement(reason="no NIC with a NUMA node" + (
            f" ({'; '.join(f'{label}: {how}' for label, _n, how in nics)})" if nics else ""))
    if len(known) > 1:
        where = "; ".join(f"{label} on node {node}" for label, node, _h in nics
                          if node is not None)
        return Placement(reason=f"NICs on different nodes ({where}): set {keys[0]}")
    node = known.pop()
    how = "; ".join(f"{label}: {h}" for label, n, h in nics if n == node)
    return Placement(nodes[node] or None, node, policy, f"auto: {how} on node {node}")


def worker_placement(placement: Placement, index: int, count: int) -> Placement:
    """Worker ``index`` of ``count`` (poll groups): its share of the placement's CPUs, in
    contiguous slices so that SMT siblings numbered together stay together; with more
    workers than CPUs they wrap round.  The memory node is the placement's."""
    if placement.cpus is None or count < 1:
        return placement
    ordered = sorted(placement.cpus)
    if count >= len(ordered):
        share = frozenset((ordered[index % len(ordered)],))
    else:
        lo = index * len(ordered) // count
        hi = (index + 1) * len(ordered) // count
        share = frozenset(ordered[lo:hi])
    return dataclasses.replace(placement, cpus=share,
                               reason=f"{placement.reason}; worker {index} of {count}")


def place_worker(placement: Placement, index: int, count: int) -> Placement:
    """In worker ``index`` of ``count`` (a poll group's process, a bench job's): apply its
    share of ``placement`` (:func:`worker_placement`) to this process, first thing, before
    it starts threads or allocates its registered memory.  Returns what was applied."""
    share = worker_placement(placement, index, count)
    return apply(share, f"worker {index}") if share.placed else share


# --------------------------------------------------------------------------- syscalls

_libc: Any = None


def _syscall(which: int, *args: Any) -> int:
    """Call mbind (0), set_mempolicy (1) or get_mempolicy (2); raises OSError."""
    global _libc
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, f"memory policy syscalls not known for {platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    rc = _libc.syscall(ctypes.c_long(numbers[which]), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def _nodemask(node: int) -> tuple[Any, int]:
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    return mask, words * _ULONG_BITS + 1


def set_mempolicy(node: int | None, policy: str = "preferred") -> None:
    """The calling thread's memory policy (and that of the threads it starts afterwards):
    ``node`` under ``policy``, or the default (None)."""
    if node is None:
        _syscall(1, ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0))
        return
    mask, maxnode = _nodemask(node)
    _syscall(1, ctypes.c_int(POLICIES[policy]), mask, ctypes.c_ulong(maxnode))


def _address(region: Any) -> tuple[int, int]:
    """Start and length of a writable mmap (or a buffer exposing its memory)."""
    c = ctypes.c_char.from_buffer(region)
    try:
        return ctypes.addressof(c), len(region)
    finally:
        del c


def mbind(region: Any, node: int, policy: str = "preferred") -> None:
    """Bind ``region`` (a writable mmap) to ``node``: pages not yet touched are allocated
    there (MPOL_BIND: only there; MPOL_PREFERRED: there while it has room)."""
    addr, length = _address(region)
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    mask, maxnode = _nodemask(node)
    _syscall(0, ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(POLICIES[policy]),
             mask, ctypes.c_ulong(maxnode), ctypes.c_uint(0))


def region_policy(addr: int) -> tuple[str, int | None]:
    """The policy (name, node) of the mapping at ``addr``, read back with get_mempolicy."""
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * 16)()
    maxnode = 16 * _ULONG_BITS + 1
    _syscall(2, ctypes.byref(mode), mask, ctypes.c_ulong(maxnode), ctypes.c_void_p(addr),
             ctypes.c_ulong(MPOL_F_ADDR))
    names = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind"}
    node = next((w * _ULONG_BITS + b for w in range(len(mask)) for b in range(_ULONG_BITS)
                 if mask[w] >> b & 1), None)
    return names.get(mode.value & 0xFF, str(mode.value)), node


# --------------------------------------------------------------------------- applying

_lock = threading.Lock()
_current: Placement = NONE
_mbind_warned = False
#: Regions bound by bind_region, for status: id -> (what, weakref to the mmap)
_regions: dict[int, tuple[str, Any]] = {}


def current() -> Placement:
    """The placement :func:`apply` put this process in (NONE before)."""
    return _current


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process (and those it starts later) onto ``cpus``."""
    cpus = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass                # a thread that ended meanwhile
    os.sched_setaffinity(0, cpus)


def apply(placement: Placement, what: str = "process") -> Placement:
    """Put this process where ``placement`` says: pin all its threads, and set the memory
    policy of the calling thread (call it before the threads that allocate are started, and
    before the memory is touched).  A refusal from the kernel is a warning, and what could
    not be applied is left out of the placement returned (and of :func:`current`)."""
    global _current
    cpus, node = placement.cpus, placement.node
    if cpus is not None:
        try:
            pin_process(cpus)
        except OSError as exc:
            log.warning("%s: not pinned to CPUs %s: %s", what, format_cpulist(cpus), exc)
            cpus = None
    if node is not None:
        try:
            set_mempolicy(node, placement.policy)
        except OSError as exc:
            log.warning("%s: memory not placed on node %d (%s): %s; running with the "
                        "default policy", what, node, placement.policy, exc)
            node = None
    applied = dataclasses.replace(placement, cpus=cpus, node=node)
    with _lock:
        _current = applied
    if applied.placed:
        log.info("%s placed: CPUs %s, memory %s (%s)", what,
                 format_cpulist(cpus) if cpus is not None else "any",
                 f"{placement.policy} node {node}" if node is not None else "default",
                 placement.reason)
    return applied


def bind_region(region: Any, what: str) -> bool:
    """Bind a freshly made mmap to the current placement's node (no-op when memory is not
    placed); False (and one warning per process) if the kernel refuses."""
    global _mbind_warned
    placement = _current
    if placement.node is None:
        return False
    try:
        mbind(region, placement.node, placement.policy)
    except (OSError, TypeError, ValueError, BufferError) as exc:
        if not _mbind_warned:
            _mbind_warned = True
            log.warning("%s: mbind to node %d failed: %s (memory follows the thread's "
                        "policy instead)", what, placement.node, exc)
        return False
    with _lock:
        _regions[id(region)] = (what, weakref.ref(region))
    return True


def bound_regions() -> list[tuple[str, int, int]]:
    """(what, start, length) of the regions bound and still open (where they are now: a
    ramdisk that grew may have moved)."""
    out = []
    with _lock:
        for key, (what, ref) in list(_regions.items()):
            region = ref()
            try:
                if region is None or region.closed:
                    raise ValueError("closed")
                out.append((what, *_address(region)))
            except (ValueError, TypeError, BufferError):
                del _regions[key]
    return out


def numa_maps(pid: int | str = "self") -> list[tuple[int, str, dict[int, int]]]:
    """``/proc/PID/numa_maps``: (start, policy, {node: pages present}) per mapping."""
    out: list[tuple[int, str, dict[int, int]]] = []
    try:
        with open(f"/proc/{pid}/numa_maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        pages = {}
        for p in parts[2:]:
            if p[:1] == "N" and "=" in p and p[1:p.index("=")].isdigit():
                pages[int(p[1:p.index("=")])] = int(p[p.index("=") + 1:])
        out.append((int(parts[0], 16), parts[1], pages))
    return out


def memory_report(regions: list[tuple[str, int, int]] | None = None) -> list[dict[str, Any]]:
    """Where the bound regions' memory lives, per kind of region (``what``): how many
    regions and bytes, their policy as the kernel shows it (``prefer:1``, ``bind:1``) and
    the pages present per node (from /proc/self/numa_maps, whose read walks every present
    page: take ``regions`` from :func:`bound_regions` where the memory is owned, and read
    this on another thread)."""
    maps = numa_maps()
    kinds: dict[str, dict[str, Any]] = {}
    for what, addr, length in bound_regions() if regions is None else regions:
        entry = kinds.setdefault(what, {"what": what, "regions": 0, "bytes": 0,
                                        "policies": set(), "pages": {}})
        entry["regions"] += 1
        entry["bytes"] += length
        for start, policy, counts in maps:
            if addr <= start < addr + length:
                entry["policies"].add(policy)
                for node, n in counts.items():
                    entry["pages"][node] = entry["pages"].get(node, 0) + n
    return [{"what": e["what"], "regions": e["regions"], "bytes": e["bytes"],
             "policy": ",".join(sorted(e["policies"])) or "?",
             "pages_by_node": {str(n): c for n, c in sorted(e["pages"].items())}}
            for e in kinds.values()]


def thread_report(topology: Topology | None = None) -> dict[str, Any]:
    """Where the calling thread runs: its allowed CPUs, their node(s), the CPU it last ran
    on (from /proc/self/task/TID/stat)."""
    topo = topology or Topology()
    cpus = os.sched_getaffinity(0)
    tid = threading.get_native_id()
    last = None
    text = _read(Path(f"/proc/self/task/{tid}/stat"))
    if text:
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 36:
            last = int(fields[36])          # field 39, "processor"
    nodes = sorted(n for n, c in topo.nodes().items() if c & cpus)
    return {"tid": tid, "cpus": format_cpulist(cpus), "nodes": nodes, "last_cpu": last}


def place_target(config: Any) -> Placement:
    """Resolve and apply a target configuration's ``numa_node``, ``cpus`` and
    ``numa_memory`` (duck-typed: the target's config model), with the listeners' NICs for
    ``auto``.  Call it before the daemon allocates its memory or starts its threads."""
    if config.numa_node == "none" and config.cpus is None:
        return NONE
    topo = Topology()
    nics = []
    if config.numa_node == "auto" and config.cpus is None and len(topo.nodes()) > 1:
        for lconf in config.listeners:
            nics.append((f"listener {lconf.endpoint}",
                         *nic_of_address(lconf.address, lconf.transport == "rdma", topo)))
    placement = resolve(config.numa_node, config.cpus, nics, policy=config.numa_memory,
                        topology=topo)
    if not placement.placed:
        log.log(logging.DEBUG if placement.reason == "one NUMA node" else logging.INFO,
                "target not placed: %s", placement.reason)
        return placement
    return apply(placement, "target")


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


def place_host(address: str, cpus: frozenset[int] | None, rdma: bool = True,
               apply_now: bool = True) -> Placement:
    """The host side (mount, bench): ``cpus`` if given, else the node of the NIC the
    kernel routes ``address`` through, when the machine has more than one node; applied
    to this process unless ``apply_now`` is false (a parent that places its workers with
    :func:`worker_placement`).  Best-effort: anything that fails is logged and the process
    runs unplaced; a CPU that is not online raises :class:`PlacementError`."""
    topo = Topology()
    nics = []
    try:
        if cpus is None and len(topo.nodes()) > 1:
            ifname = route_interface(address)
            node, how = topo.nic_node(ifname, rdma) if ifname else (None, "no route")
            nics.append((f"route to {address}", node, how))
        placement = resolve("auto", cpus, nics, topology=topo, keys=("numa_node", "--cpus"))
    except PlacementError:
        raise
    except Exception as exc:  # noqa: BLE001 - best effort
        log.warning("host placement: %s; not placed", exc)
        return NONE
    if not placement.placed:
        log.debug("host not placed: %s", placement.reason)
        return placement
    return apply(placement, "host") if apply_now else placement

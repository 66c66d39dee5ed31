"""NUMA placement: deciding where a process goes, pinning it, and binding its memory.

A reactor on the far socket from its NIC, or registered memory on the far node, costs every
I/O a trip across the inter-socket link.  This module finds where things are and puts a
process (its threads and its memory) next to its NIC:

- :mod:`blockfabric.topology` finds where things are (:class:`Topology` from sysfs, the
  interface of an address or a route by netlink, CPU lists); :mod:`blockfabric.mempolicy`
  holds the memory policy system calls.  Their names are also importable from here.
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

import dataclasses
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable

from blockfabric.errors import BlockfabricError
# what callers knew as numa.X before discovery and the syscalls moved out (numa.md, tests)
from blockfabric.mempolicy import (POLICIES, mbind, region_address,  # noqa: F401
                                   region_policy, set_mempolicy)
from blockfabric.topology import (SYSFS_ENV, Topology, format_cpulist,  # noqa: F401
                                  interface_of, nic_of_address, parse_cpulist, read_text,
                                  route_interface)

log = logging.getLogger(__name__)


class PlacementError(BlockfabricError, ValueError):
    """A placement setting that cannot be honoured on this machine; ``key`` names it."""

    def __init__(self, key: str, expected: str, got: object) -> None:
        super().__init__(f"{key}: expected {expected}, got {got}")
        self.key, self.expected, self.got = key, expected, got


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
                out.append((what, *region_address(region)))
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
    text = read_text(Path(f"/proc/self/task/{tid}/stat"))
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

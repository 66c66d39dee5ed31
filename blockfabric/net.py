"""Network namespaces joined by veth, for multi-host tests and tools (pyroute2; needs root).

:func:`netns_pair` makes two namespaces, a veth pair between them and addresses in private
ranges (IPv4 in 10.0.0.0/8, IPv6 in fd00::/8, no DAD so they work at once), and always tears
everything down.  Names carry a random suffix so parallel runs do not clash.
"""

from __future__ import annotations

import contextlib
import os
import random
import uuid
from dataclasses import dataclass
from typing import Iterator

IFA_F_NODAD = 0x02


@dataclass(frozen=True)
class NetnsPair:
    """Two namespaces joined by one veth pair; index 0 is side A, 1 is side B."""

    names: tuple[str, str]
    ifnames: tuple[str, str]
    ipv4: tuple[str, str]
    ipv6: tuple[str, str]


def _is_root() -> bool:
    return os.geteuid() == 0


def create_netns_pair(prefix: str = "bf", rng: random.Random | None = None) -> NetnsPair:
    """Create the namespaces, the veth pair and the addresses; undo all of it on failure."""
    from pyroute2 import IPRoute, NetNS, netns

    rng = rng or random.Random(uuid.uuid4().int)
    tag = uuid.uuid4().hex[:8]
    names = (f"{prefix}-{tag}-a", f"{prefix}-{tag}-b")
    ifnames = (f"{prefix}{tag}a"[:15], f"{prefix}{tag}b"[:15])
    net = (rng.randrange(64, 250), rng.randrange(0, 256))
    ipv4 = (f"10.{net[0]}.{net[1]}.1", f"10.{net[0]}.{net[1]}.2")
    site = rng.getrandbits(40)
    base = f"fd{site >> 32:02x}:{(site >> 16) & 0xFFFF:x}:{site & 0xFFFF:x}"
    ipv6 = (f"{base}::1", f"{base}::2")
    pair = NetnsPair(names, ifnames, ipv4, ipv6)
    try:
        for name in names:
            netns.create(name)
        with IPRoute() as ipr:
            ipr.link("add", ifname=ifnames[0], kind="veth", peer={"ifname": ifnames[1]})
            for name, ifname in zip(names, ifnames):
                ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], net_ns_fd=name)
        for name, ifname, a4, a6 in zip(names, ifnames, ipv4, ipv6):
            with NetNS(name) as ns:
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
                index = ns.link_lookup(ifname=ifname)[0]
                ns.addr("add", index=index, address=a4, prefixlen=24)
                ns.addr("add", index=index, address=a6, prefixlen=64, flags=IFA_F_NODAD)
                ns.link("set", index=index, state="up")
    except BaseException:
        destroy_netns_pair(pair)
        raise
    return pair


def destroy_netns_pair(pair: NetnsPair) -> None:
    """Remove both namespaces (the veth pair goes with them); never raises for leftovers."""
    from pyroute2 import netns

    for name in pair.names:
        with contextlib.suppress(OSError, FileNotFoundError):
            netns.remove(name)


@contextlib.contextmanager
def netns_pair(prefix: str = "bf", rng: random.Random | None = None) -> Iterator[NetnsPair]:
    """A :class:`NetnsPair` for the duration of the block, always torn down."""
    pair = create_netns_pair(prefix, rng)
    try:
        yield pair
    finally:
        destroy_netns_pair(pair)


def enter_netns(name: str) -> None:
    """Move this process (its future sockets) into namespace ``name``."""
    from pyroute2 import netns

    netns.setns(name)


def can_create_netns() -> tuple[bool, str]:
    """(possible, reason): network namespaces need root."""
    if not _is_root():
        return False, "network namespaces need root"
    return True, ""

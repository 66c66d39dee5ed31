"""Which providers and topologies the RDMA contract suite runs over.

BLOCKFABRIC_TEST_PROVIDERS (default "soft,verbs") names the providers; a provider that is
not present here (verbs without pyverbs or without a device) is skipped with the reason.
BLOCKFABRIC_TEST_ADDR (default 127.0.0.1) is the address to listen on, so the same suite
runs on rxe0 in the lab.  Soft runs in four topologies, each with thread and poll progress:
both ends in this process (connected through the same-host unix socket), in two peer
processes over TCP loopback (same-host connections off), in two peer processes whose
memory is shared slabs, so RDMA READ and WRITE data moves through shared memory ("shm"),
and in two peer processes in two network namespaces joined by veth (TCP).  ``soft_world``
is soft alone (in this process and in two), whatever BLOCKFABRIC_TEST_PROVIDERS says, for
the checks stricter than the contract.
"""

from __future__ import annotations

import os

import pytest

from blockfabric.errors import ProviderUnavailable

from .agent import AgentCore, LocalAgent, RemoteAgent, make_provider
from .harness import World

PROVIDERS = [p.strip() for p in os.environ.get("BLOCKFABRIC_TEST_PROVIDERS", "soft,verbs")
             .split(",") if p.strip()]
ADDRESS = os.environ.get("BLOCKFABRIC_TEST_ADDR", "127.0.0.1")


def _variants(providers: list[str] = PROVIDERS,
              soft_topologies: tuple = ("local", "proc", "shm", "netns")) -> list:
    out = []
    for provider in providers:
        if provider == "soft":
            for topo in soft_topologies:
                marks = [pytest.mark.netns] if topo == "netns" else []
                for progress in ("thread", "poll"):
                    out.append(pytest.param(("soft", progress, topo),
                                            id=f"soft-{progress}-{topo}", marks=marks))
        else:
            for topo in ("local", "proc"):
                out.append(pytest.param((provider, None, topo), id=f"{provider}-{topo}"))
    return out


def _provider_present(name: str) -> str | None:
    """None when usable, else why not."""
    try:
        provider = make_provider(name, None)
    except (ProviderUnavailable, ImportError) as exc:
        return f"RDMA provider {name!r} unavailable: {exc}"
    if not provider.devices():
        return f"RDMA provider {name!r}: no RDMA device found"
    return None


@pytest.fixture(scope="session")
def _worlds(request):
    """World objects, made on first use and kept for the session (agents are costly)."""
    made: dict = {}
    cleanups: list = []

    def get(variant: tuple) -> World:
        if variant in made:
            return made[variant]
        provider, progress, topo = variant
        why = _provider_present(provider) if provider != "soft" else None
        if why:
            made[variant] = why
            return why
        if topo == "local":
            shared = make_provider(provider, progress)
            a, b = LocalAgent(AgentCore(shared)), LocalAgent(AgentCore(shared))
            world = World("-".join(map(str, variant)), a, b, ADDRESS)
            if hasattr(shared, "close"):
                cleanups.append(shared.close)
        elif topo == "proc":
            shm = False if provider == "soft" else None
            a, b = RemoteAgent(provider, progress, shm=shm), RemoteAgent(provider, progress,
                                                                        shm=shm)
            world = World("-".join(map(str, variant)), a, b, ADDRESS)
        elif topo == "shm":
            a = RemoteAgent(provider, progress, shm=True, shared=True)
            b = RemoteAgent(provider, progress, shm=True, shared=True)
            world = World("-".join(map(str, variant)), a, b, ADDRESS)
        else:
            from blockfabric.net import can_create_netns, create_netns_pair, destroy_netns_pair
            ok, reason = can_create_netns()
            if not ok:
                made[variant] = reason
                return reason
            pair = create_netns_pair("bft")
            cleanups.append(lambda: destroy_netns_pair(pair))
            a = RemoteAgent(provider, progress, netns=pair.names[0])
            b = RemoteAgent(provider, progress, netns=pair.names[1])
            world = World("-".join(map(str, variant)), a, b, pair.ipv4[1], pair.ipv6[1])
        cleanups.extend([a.close, b.close])
        made[variant] = world
        return world

    yield get
    for fn in reversed(cleanups):
        try:
            fn()
        except Exception:  # noqa: BLE001  (teardown must go on)
            pass


@pytest.fixture(params=_variants())
def world(request, _worlds) -> World:
    """Two agents ready to connect; everything they made is closed after the test."""
    got = _worlds(request.param)
    if isinstance(got, str):
        pytest.skip(got)
    yield got
    got.reset()


@pytest.fixture(params=_variants(["soft"], ("local", "proc", "shm")))
def soft_world(request, _worlds) -> World:
    """A soft-provider world, for the strict checks where real devices are looser."""
    got = _worlds(request.param)
    yield got
    got.reset()


@pytest.fixture
def pair(world):
    """A connected pair of ends (A active, B passive) with default capabilities."""
    ends = world.connect()
    assert not isinstance(ends, dict), f"connect failed: {ends}"
    return ends

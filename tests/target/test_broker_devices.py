"""One protection domain per RDMA device in a target process, shared by all its queues, and
its buffers registered once (issue 19).

On verbs every CM id holds its own handle (a VerbsContext) of the one opened device; the
broker keyed its PDs by ``id(cmid.context)``, so each accepted queue got a PD of its own and,
on it, its own control, zero and 64-slot bounce pools, none freed until the target stopped:
the e2e memory bound saw 67 MiB > 64 MiB on verbs.  The handles here are what VerbsContext
is, over a soft device (no NIC needed); tests/lab/verbsfix.sh counts the target's PDs and
registered bytes on rxe (``rdma res``)."""

from __future__ import annotations

import threading
import types

import pytest

from blockfabric.fabric.reactor import Reactor
from blockfabric.rdma import base, get_provider
from blockfabric.rdma.verbs.resources import Device, VerbsContext
from blockfabric.target.broker import BufferBroker
from blockfabric.target.config import default_config


def _device(name: str) -> Device:
    """A Device's bookkeeping without opening anything (VerbsContext only counts on it)."""
    dev = Device.__new__(Device)
    dev._registry, dev._lock, dev.name, dev.refs = {}, threading.Lock(), name, 0
    return dev


def test_verbs_handles_of_one_device_share_its_key():
    rxe0, other = _device("rxe0"), _device("mlx5_0")
    a, b = VerbsContext(rxe0), VerbsContext(rxe0)
    assert a is not b and rxe0.refs == 2
    assert a.device_key == b.device_key
    assert VerbsContext(other).device_key != a.device_key


class Handle(base.Context):
    """One CM id's own handle of a shared device, as VerbsContext is (here a soft one)."""

    def __init__(self, device: base.Context) -> None:
        self.device, self.name = device, device.name

    @property
    def device_key(self) -> object:
        return ("handle-of", id(self.device))

    def alloc_pd(self) -> base.PD:
        return self.device.alloc_pd()

    def create_cq(self, depth: int = 256) -> base.CQ:
        return self.device.create_cq(depth)

    def close(self) -> None:
        pass


@pytest.fixture
def broker():
    b = BufferBroker(Reactor("test"), default_config, lambda *args: None)
    yield b
    b.stop()
    b.close()


def test_queues_of_one_device_share_one_pd_and_its_registered_buffers(broker):
    device = get_provider("soft").context  # type: ignore[attr-defined]
    registered = len(device.lkeys)
    first, second = (types.SimpleNamespace(context=Handle(device)) for _ in range(2))
    pd = broker.pd_for(first)
    assert broker.pd_for(second) is pd
    for cmid in (first, second):                 # each queue's admin data and padding
        queue = types.SimpleNamespace(pd=broker.pd_for(cmid))
        _view, _sge, release = broker.control_buffer(queue, 512)
        release(None)
        broker.zeros(queue, 4096)
    # one control pool and one zero region, registered for the first queue only
    assert len(device.lkeys) - registered == 2
    assert len(broker._pds) == 1


def test_another_device_gets_its_own_pd(broker):
    soft = get_provider("soft").context  # type: ignore[attr-defined]
    one = types.SimpleNamespace(context=Handle(soft))
    other = types.SimpleNamespace(context=Handle(types.SimpleNamespace(
        name="soft1", alloc_pd=soft.alloc_pd)))  # type: ignore[arg-type]
    assert broker.pd_for(one) is not broker.pd_for(other)

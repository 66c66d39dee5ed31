"""Which controller a poll-group worker gives a handed-over queue to.  A controller the
worker kept after its last queue went (a command still in flight: Preempt and Abort waits
on its count) must not be taken by a new controller whose cntlid wrapped around to it,
unless that is the same host on the same subsystem: otherwise its queues would reach the
old subsystem's namespaces (found in review)."""

from __future__ import annotations

from types import SimpleNamespace as NS

from blockfabric.target.worker import Worker

X, Y = object(), object()       # two subsystems' objects in the worker


def worker_with(ctrl) -> NS:
    return NS(controllers={5: ctrl}, subsystems={"nqn.x": X, "nqn.y": Y})


def meta(subnqn: str = "nqn.x", hostnqn: str = "nqn.host-a", hostid: bytes = b"H" * 16):
    return {"cntlid": 5, "subnqn": subnqn, "hostnqn": hostnqn, "hostid": hostid}


def test_the_same_host_on_the_same_subsystem_gets_its_controller():
    ctrl = NS(cntlid=5, dead=False, hostid=b"H" * 16, hostnqn="nqn.host-a", subsystem=X)
    assert Worker._controller(worker_with(ctrl), meta()) is ctrl


def test_a_wrapped_cntlid_of_another_subsystem_or_host_gets_a_new_one():
    ctrl = NS(cntlid=5, dead=False, hostid=b"H" * 16, hostnqn="nqn.host-a", subsystem=X)
    w = worker_with(ctrl)
    assert Worker._controller(w, meta(subnqn="nqn.y")) is None          # same host id
    assert Worker._controller(w, meta(hostnqn="nqn.host-b")) is None    # a copied host id
    assert Worker._controller(w, meta(hostid=b"I" * 16)) is None
    assert Worker._controller(NS(controllers={}, subsystems={}), meta()) is None


def test_a_dead_controller_is_never_reused():
    ctrl = NS(cntlid=5, dead=True, hostid=b"H" * 16, hostnqn="nqn.host-a", subsystem=X)
    assert Worker._controller(worker_with(ctrl), meta()) is None

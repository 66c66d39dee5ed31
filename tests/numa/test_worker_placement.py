"""A poll group's worker takes its share of the coordinator's NUMA placement."""

from __future__ import annotations

import json

from blockfabric import numa
from blockfabric.target import pollgroups, worker


def test_worker_applies_its_share_of_the_coordinators_placement(monkeypatch):
    seen = []
    monkeypatch.setattr(numa, "place_worker",
                        lambda placement, index, count: seen.append((placement, index, count)))
    monkeypatch.setenv(pollgroups.PLACEMENT_ENV, json.dumps(
        {"cpus": [2, 3, 4, 5], "node": 1, "policy": "bind", "reason": "NIC", "count": 3}))
    worker.apply_placement(2)
    (placement, index, count), = seen
    assert (placement.cpus, placement.node, placement.policy) == (frozenset({2, 3, 4, 5}), 1,
                                                                   "bind")
    assert (index, count) == (2, 3)
    # and the share it takes is its own slice of the CPUs, on the same node
    share = numa.worker_placement(placement, index, count)
    assert share.cpus == frozenset({4, 5}) and share.node == 1


def test_worker_without_a_placed_coordinator_does_nothing(monkeypatch):
    monkeypatch.setattr(numa, "place_worker", lambda *a: (_ for _ in ()).throw(AssertionError))
    monkeypatch.delenv(pollgroups.PLACEMENT_ENV, raising=False)
    worker.apply_placement(1)


def test_a_bad_placement_message_is_logged_not_fatal(monkeypatch, caplog):
    monkeypatch.setenv(pollgroups.PLACEMENT_ENV, "{not json")
    worker.apply_placement(1)
    assert "placement not applied" in caplog.text

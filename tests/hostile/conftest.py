"""Hostile-peer fixtures: a ramdisk target with a small per-host connection limit, a good
host running a verify load beside the attacker, and the attacker's own controller."""

from __future__ import annotations

import threading

import pytest

from blockfabric.initiator.host import connect

from e2e.conftest import (HOSTNQN, NQN, OTHER_HOSTNQN, free_port, ram_config,  # noqa: F401
                          start_target)
from faults.verifyload import verify_load

MAX_CONN = 6


@pytest.fixture
def target(start_target, request):
    """Parametrize indirectly with a mapping to set further ``limits`` keys."""
    port = free_port()
    config = ram_config(port)
    config["limits"] = {"max_connections_per_host": MAX_CONN, **getattr(request, "param", {})}
    proc = start_target(config)
    proc.port = port
    return proc


class Bystander:
    """A well-behaved host on 127.0.0.1 verifying its data in a thread while an attack runs;
    :meth:`finish` returns its counts, which must show no error and no mismatch."""

    def __init__(self, port: int) -> None:
        self.ctrl = connect("127.0.0.1", NQN, port, provider="soft", hostnqn=OTHER_HOSTNQN,
                            nr_io_queues=1, keep_alive_tmo=2.0)
        self.stop = threading.Event()
        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(
            verify_load(self.ctrl, 60, threads=2, region_blocks=128, stop=self.stop)))
        self.thread.start()

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join(30)
        self.ctrl.close()
        return self.result


@pytest.fixture
def bystander(target):
    b = Bystander(target.port)
    yield b
    if b.thread.is_alive():
        b.stop.set()
        b.thread.join(30)
        b.ctrl.close()


def assert_undisturbed(result: dict) -> None:
    assert result["errors"] == 0 and result["mismatches"] == 0, result
    assert result["ios"] > 0 and result["recovery"]["losses"] == 0, result

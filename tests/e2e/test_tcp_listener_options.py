"""Listener options through the real daemon and real connections: NVMe/TCP data alignment
(the host's HPDA, the listener's CPDA) with R2Ts and C2HData both ways, and the per-listener
limits (max_connections, max_io_queues, queue_size) on both transports."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from blockfabric.initiator.host import NvmeError, connect
from blockfabric.protocol import StatusCode

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN, addr_of, free_port, ram_config, via

#: sizes that go in the capsule (4 KiB), in one R2T, and in several R2Ts (8 x 128 KiB)
SIZES = (4096, 64 << 10, 1 << 20)


@pytest.mark.parametrize("digests", [False, True])
def test_padded_pdus_both_ways(start_target, digests):
    """A host asking HPDA 7 (32-byte aligned C2HData) of a listener with CPDA 5 (24-byte
    aligned capsule and H2CData data): each end checks the other's PDO exactly, so data
    that arrives at all arrived padded as asked; it is verified byte for byte."""
    port = free_port()
    config = ram_config(port, transport="tcp")
    config["listeners"][0]["cpda"] = 5
    target = start_target(config)
    with connect("127.0.0.1", NQN, port, transport="tcp", hpda=7, hostnqn=HOSTNQN,
                 nr_io_queues=2, hdr_digest=digests, data_digest=digests) as ctrl:
        ns = ctrl.namespaces[1]
        offset = 0
        for size in SIZES:
            data = os.urandom(size)
            ns.write(offset, data)
            assert ns.read(offset, size) == data
            offset += size
    assert "protocol error" not in target.log, target.log


def _wait_line(target, *parts: str, timeout: float = 5) -> bool:
    """A line of the target's log holds every one of ``parts`` (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(all(p in line for p in parts) for line in target.log.splitlines()):
            return True
        time.sleep(0.02)
    return False


def _limited_target(start_target, transport: str, **keys):
    port = free_port()
    config = ram_config(port, transport=transport)
    config["listeners"][0].update(keys)
    proc = start_target(config)
    proc.port = port
    return proc


def test_listener_max_connections(start_target, transport):
    """max_connections 2: a host with an admin and an I/O queue holds both; another host's
    Connect is refused with Controller Busy while the first carries on, and is served once
    the first has gone."""
    target = _limited_target(start_target, transport, max_connections=2)
    with connect(addr_of(transport), NQN, target.port, **via(transport), hostnqn=HOSTNQN,
                 nr_io_queues=1) as first:
        ns = first.namespaces[1]
        with pytest.raises(NvmeError) as info:
            connect(addr_of(transport), NQN, target.port, **via(transport), hostnqn=OTHER_HOSTNQN,
                    nr_io_queues=1, connect_timeout=5.0)
        assert info.value.status == StatusCode.CONNECT_CTRL_BUSY, info.value
        data = os.urandom(8192)
        ns.write(0, data)
        assert ns.read(0, 8192) == data
    assert target.wait_log("its max_connections is 2", 5), target.log
    with connect(addr_of(transport), NQN, target.port, **via(transport), hostnqn=OTHER_HOSTNQN,
                 nr_io_queues=1) as second:
        assert second.namespaces[1].read(0, 8192) == data


def test_listener_io_queues_and_depth(start_target, transport):
    """max_io_queues 2 and queue_size 32 on the listener (the limits allow 8 and 128): a
    host asking 4 queues of 64 gets 2 of 32 (Set Features, MAXCMD); a Connect for qid 3 or
    deeper than 32 is refused with Connect Invalid Parameters naming the field, and the
    host's queues carry on."""
    target = _limited_target(start_target, transport, max_io_queues=2, queue_size=32)
    with connect(addr_of(transport), NQN, target.port, **via(transport), hostnqn=HOSTNQN,
                 nr_io_queues=4, queue_size=64) as ctrl:
        assert [q.depth for q in ctrl.io_queues] == [32, 32]
    with connect(addr_of(transport), NQN, target.port, **via(transport), hostnqn=HOSTNQN,
                 nr_io_queues=2) as ctrl:
        ctrl.io_queues.pop().close()        # qid 2 is free again (once the target saw it)
        assert _wait_line(target, f"ctrl {ctrl.cntlid} hostnqn=", " qid=2: ", "disconnected")
        for qid, depth, ipo in ((3, 16, 42), (2, 64, 44)):
            queue = ctrl.open_queue(qid, depth)
            try:
                with pytest.raises(NvmeError) as info:
                    ctrl.fabrics_connect(queue, qid, depth - 1, 0)
            finally:
                queue.close()
            assert info.value.status == StatusCode.CONNECT_INVALID_PARAM, info.value
            assert info.value.result & 0xFFFF == ipo, hex(info.value.result)
        ns = ctrl.namespaces[1]
        data = os.urandom(4096)
        ns.write(4096, data)
        assert ns.read(4096, 4096) == data


def test_reload_changes_a_listeners_limit_and_cpda(start_target):
    """SIGHUP with a higher max_connections and a CPDA on the same listener: the next
    Connect counts against the new limit and the next connection gets the new CPDA, while
    the connected host carries on."""
    target = _limited_target(start_target, "tcp", max_connections=2)
    with connect("127.0.0.1", NQN, target.port, transport="tcp", hostnqn=HOSTNQN,
                 nr_io_queues=1) as first:
        assert first.io_queues[0].tx_align == 4
        target.config["listeners"][0].update(max_connections=4, cpda=3)
        target.path.write_text(yaml.safe_dump(target.config))
        target.proc.send_signal(signal.SIGHUP)
        assert target.wait_log("reloaded ", 10), target.log
        with connect("127.0.0.1", NQN, target.port, transport="tcp", hostnqn=OTHER_HOSTNQN,
                     nr_io_queues=1) as second:
            assert second.io_queues[0].tx_align == 16       # (3 + 1) dwords
            data = os.urandom(8192)
            second.namespaces[1].write(0, data)
            assert first.namespaces[1].read(0, 8192) == data

"""Data integrity through the real daemon: ramdisk and file, several queues, many in flight."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from blockfabric.initiator.host import HostMemory, IoCommand, NvmeError, connect
from blockfabric.protocol import IOOpcode, StatusCode
from blockfabric.net import can_create_netns, netns_pair

from .conftest import HOSTNQN, NQN, addr_of, free_port, ram_config, via
from .workload import verify_workload


def test_random_io_ramdisk_many_in_flight_on_several_queues(any_target):
    with connect(addr_of(any_target.transport), NQN, any_target.port, **any_target.via,
                 hostnqn=HOSTNQN, nr_io_queues=3, queue_size=32) as ctrl:
        assert len(ctrl.io_queues) == 3
        summary = verify_workload(ctrl.namespaces[1], seed=7, ops=300, inflight=48)
        stats = ctrl.queue_stats()
    assert summary["bytes_verified"] > 0
    for qid in (1, 2, 3):
        assert stats[qid]["completed"] > 0, stats
        assert stats[qid]["errors"] == 0, stats
    assert max(stats[q]["max_inflight"] for q in (1, 2, 3)) > 1, stats


def test_random_io_file_backend(start_target, tmp_path, transport, reactors):
    port = free_port()
    path = tmp_path / "vol.img"
    start_target(ram_config(port, transport=transport, reactors=reactors, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(path), "size": "32MiB",
         "block_size": 512}]))
    with connect(addr_of(transport), NQN, port, **via(transport), hostnqn=HOSTNQN,
                 nr_io_queues=2) as ctrl:
        ns = ctrl.namespaces[1]
        assert ns.block_size == 512 and ns.size == 32 << 20
        summary = verify_workload(ns, seed=11, ops=200, max_blocks=300, inflight=24)
    assert summary["bytes_verified"] > 0


def test_flushed_writes_are_in_the_backing_file_after_the_target_is_killed(start_target,
                                                                           tmp_path):
    port = free_port()
    path = tmp_path / "vol.img"
    target = start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(path), "size": "16MiB"}]))
    payload = os.urandom(1 << 20)
    small = os.urandom(4096)
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN) as ctrl:
        ns = ctrl.namespaces[1]
        ns.write(4096, payload)             # keyed SGL, target RDMA READs it
        ns.write(8 << 20, small)            # in-capsule
        ns.flush()
        target.stop(signal.SIGKILL)
    data = path.read_bytes()
    assert data[4096:4096 + len(payload)] == payload
    assert data[8 << 20:(8 << 20) + 4096] == small


def test_commands_complete_out_of_order(start_target, tmp_path):
    """On one queue: 1 MiB reads of a file-backed namespace go through the target's backend
    pool, while 4 KiB in-capsule writes to a ramdisk namespace complete inline on the
    target's reactor, so later commands overtake earlier ones."""
    port = free_port()
    start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(tmp_path / "slow.img"), "size": "16MiB"},
        {"nsid": 2, "backend": "ramdisk", "size": "16MiB"}]))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as ctrl:
        slow, fast = ctrl.namespaces[1], ctrl.namespaces[2]
        for _ in range(5):
            futures = [slow.submit_read(i << 20, 1 << 20) for i in range(4)]
            futures += [fast.submit_write(i * 4096, os.urandom(4096)) for i in range(16)]
            for fut in futures:
                fut.result()
        stats = ctrl.queue_stats()[1]
    assert stats["max_inflight"] > 1, stats
    assert stats["out_of_order"] > 0, stats


def test_reads_and_writes_larger_than_mdts_are_split(any_target):
    with connect(addr_of(any_target.transport), NQN, any_target.port, **any_target.via,
                 hostnqn=HOSTNQN) as ctrl:
        ns = ctrl.namespaces[1]
        data = os.urandom(3 << 20)          # 3 MiB: three 1 MiB commands
        ns.write(1 << 20, data)
        assert hashlib.sha256(ns.read(1 << 20, len(data))).digest() == \
            hashlib.sha256(data).digest()


@pytest.mark.netns
def test_verify_workload_between_network_namespaces(start_target, transport):
    ok, reason = can_create_netns()
    if not ok:
        pytest.skip(reason)
    if transport == "verbs":
        pytest.skip("network namespaces joined by veth: the lab's rxe0 is in the guest's "
                    "root namespace")
    with netns_pair("bfe2e") as pair:
        port = free_port()
        start_target(ram_config(port, address=pair.ipv4[0], transport=transport),
                     netns=pair.names[0])
        res = subprocess.run(
            [sys.executable, "-m", "tests.e2e.workload", "--traddr", pair.ipv4[0],
             "--trsvcid", str(port), "--nqn", NQN, "--hostnqn", HOSTNQN, "--seed", "3",
             "--ops", "150", "--netns", pair.names[1], "--transport", transport],
            capture_output=True, text=True, timeout=120,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["bytes_verified"] > 0
        assert summary["queues"]["1"]["completed"] + summary["queues"]["2"]["completed"] > 150


def test_a_failing_completion_callback_does_not_lose_other_completions(ram_target, caplog):
    """Completions are drained from the CQ in batches; one callback raising must not drop
    the rest of its batch (their commands would never complete)."""
    from blockfabric.protocol import IOOpcode, ReadWrite

    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as ctrl:
        ns = ctrl.namespaces[1]
        queue = ctrl.io_queues[0]

        def boom(cqe, data, error):
            raise RuntimeError("callback bug")

        for i in range(8):
            ctrl.submit(queue, ReadWrite(IOOpcode.READ, 1, i, 0).to_sqe(), boom, data_in=4096)
        futures = [ns.submit_read(i * 4096, 4096) for i in range(32)]
        for fut in futures:
            assert len(fut.result(timeout=10)) == 4096
    assert "callback bug" in caplog.text


class _Parent:
    """An IoCommand parent that records where and how each completion arrived."""

    def __init__(self) -> None:
        self.errors: list = []
        self.threads: set = set()
        self.done = threading.Event()
        self.expect = 0

    def io_done(self, _cmd, error) -> None:
        self.errors.append(error)
        self.threads.add(threading.get_ident())
        if len(self.errors) == self.expect:
            self.done.set()


def test_reused_io_commands_split_at_mdts_and_complete_on_the_reactor(ram_target):
    """The lean path: one list of IoCommand objects, filled again by plan_io for every I/O
    (pieces at the transfer limit included) and sent by issue(); the data moves straight
    from and into the caller's registered memory, and every completion runs on the
    reactor thread."""
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=2, queue_size=32) as ctrl:
        ns = ctrl.namespaces[1]
        length = 3 * ctrl.max_transfer + 4096            # four pieces, the last one short
        mem = HostMemory(ctrl.pd, length)
        try:
            payload = os.urandom(length)
            mem.view[:length] = payload
            cmds: list[IoCommand] = []
            for opcode, offset in ((IOOpcode.WRITE, 8192), (IOOpcode.READ, 8192)):
                if opcode == IOOpcode.READ:
                    mem.view[:length] = bytes(length)
                parent = _Parent()
                n = ctrl.plan_io(cmds, parent, ns, opcode, offset, length, mem.addr,
                                 mem.rkey, mem.view[:length] if opcode == IOOpcode.WRITE
                                 else None)
                assert n == 4 and len(cmds) == 4
                for cmd in cmds:
                    cmd.parent = parent
                parent.expect = n
                first = cmds[0]
                for cmd in cmds[:n]:
                    ctrl.issue(cmd)
                assert parent.done.wait(20)
                assert parent.errors == [None] * n
                assert parent.threads == {ctrl.reactor.thread.ident}
                assert cmds[0] is first          # the same objects, filled again
            assert bytes(mem.view[:length]) == payload
            for cmd in cmds:
                cmd.data = None
            # a status error reaches the parent as NvmeError, with the command's status
            parent = _Parent()
            parent.expect = 1
            ctrl.plan_io(cmds, parent, ns, IOOpcode.READ, ns.size, 4096, mem.addr, mem.rkey)
            cmds[0].parent = parent
            ctrl.issue(cmds[0])
            assert parent.done.wait(20)
            assert isinstance(parent.errors[0], NvmeError)
            assert parent.errors[0].status == StatusCode.LBA_OUT_OF_RANGE
        finally:
            mem.close()


def test_a_full_queue_on_the_reactor_thread_raises_instead_of_waiting_for_itself(
        ram_target):
    """Only the reactor frees command slots: a submission there that finds none raises at
    once (the old queue waited for itself, for ever)."""
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1, queue_size=4) as ctrl:
        ns = ctrl.namespaces[1]
        queue = ctrl.io_queues[0]
        mem = HostMemory(ctrl.pd, 4096)
        parent = _Parent()
        parent.expect = queue.depth
        outcome: list = []

        def fill() -> None:
            cmds = [IoCommand(ctrl, parent) for _ in range(queue.depth + 1)]
            for cmd in cmds:
                ctrl.plan_io([cmd], parent, ns, IOOpcode.READ, 0, 4096, mem.addr, mem.rkey)
            try:
                for cmd in cmds:
                    queue.submit_rw(cmd, cmd.opcode, cmd.nsid, cmd.slba, cmd.nlb, cmd.addr,
                                    cmd.length, cmd.rkey)
            except TimeoutError as exc:
                outcome.append(exc)
        try:
            ctrl.reactor.call_sync(fill)
            assert len(outcome) == 1 and "no free command slot" in str(outcome[0])
            assert parent.done.wait(20) and parent.errors == [None] * queue.depth
            assert queue.stats.as_dict()["inflight"] == 0
            assert queue.stats.max_inflight == queue.depth
        finally:
            mem.close()


def test_in_capsule_data_of_the_wrong_length_is_refused_before_a_slot_is_taken(any_target):
    """A write whose in-capsule data is not the command's length is a caller's error: it
    raises, on the reactor thread and off it, and leaves every command slot free (it used
    to keep the slot it had taken)."""
    with connect(addr_of(any_target.transport), NQN, any_target.port, **any_target.via,
                 hostnqn=HOSTNQN, nr_io_queues=1, queue_size=4) as ctrl:
        queue = ctrl.io_queues[0]
        if not queue.inline_size:
            pytest.skip("this queue takes no in-capsule data")
        mem = HostMemory(ctrl.pd, 4096)
        outcome: list = []

        def submit() -> None:
            try:
                queue.submit_rw(None, IOOpcode.WRITE, 1, 0, 0, mem.addr, 4096, mem.rkey,
                                mem.view[:2048])
            except ValueError as exc:
                outcome.append(exc)
        try:
            submit()                                # off the reactor thread
            ctrl.reactor.call_sync(submit)          # on it
            assert len(outcome) == 2 and all("2048 bytes" in str(e) for e in outcome), outcome
            assert len(queue._free) == queue.depth
            ns = ctrl.namespaces[1]
            ns.write(0, b"\x5a" * 4096)             # the queue still serves
            assert ns.read(0, 4096) == b"\x5a" * 4096
        finally:
            mem.close()

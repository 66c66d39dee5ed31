"""Poll groups (``reactors: 2``): I/O queues of one controller spread over processes, a
worker that dies takes only its queues with it, reservations hold in every group, status
counts add up, and what poll groups cannot serve is refused at load, naming the key."""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from blockfabric.errors import BlockfabricError
from blockfabric.initiator import resv
from blockfabric.initiator.host import (CAPSULE_CONNECT_DATA, ConnectOptions, Controller,
                                        NvmeError, connect)
from blockfabric.protocol import SQE, ConnectCommand, ConnectData, StatusCode
from blockfabric.target import config as cfg
from blockfabric.target.backends import RamdiskBackend

from helpers.targetstatus import settled, status

from .conftest import (BIN, HOSTNQN, NQN, OTHER_HOSTNQN, RDMA, addr_of, free_port, listener,
                       ram_config, via)
from .workload import verify_workload

CONFLICT = 0x083
THIRD_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:33333333-2222-3333-4444-555555555555"


@pytest.fixture
def two_groups(start_target, tmp_path):
    port = free_port()
    config = ram_config(port, transport="tcp", reactors=2)
    config["listeners"].append(listener(free_port()))       # and RDMA (soft, or verbs)
    config["control_socket"] = str(tmp_path / "control.sock")
    config["metrics"] = {"port": free_port()}
    proc = start_target(config)
    proc.port, proc.rdma_port = port, config["listeners"][1]["port"]
    proc.socket, proc.metrics = config["control_socket"], config["metrics"]["port"]
    return proc


def test_io_queues_of_one_controller_spread_over_groups_and_counts_add_up(two_groups):
    with connect("127.0.0.1", NQN, two_groups.port, transport="tcp", hostnqn=HOSTNQN,
                 nr_io_queues=4, queue_size=32) as ctrl:
        summary = verify_workload(ctrl.namespaces[1], seed=3, ops=400, inflight=64)
        stats = ctrl.queue_stats()
        # the workers' counts reach the coordinator a moment later: wait for every kind
        # (the last reads come after the last writes)
        st = settled(two_groups.socket, lambda s: all(
            sum(g["io"][key] for g in s["groups"]) == s["controllers"][0]["io"][key]
            and all(g["io"][key] for g in s["groups"])
            for key in ("reads", "writes", "read_bytes", "written_bytes")))
        text = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket",
                               two_groups.socket], capture_output=True, text=True,
                              check=True).stdout
    assert summary["bytes_verified"] > 0
    assert all(stats[q]["completed"] > 0 and stats[q]["errors"] == 0 for q in (1, 2, 3, 4))
    (c,) = st["controllers"]
    placed = {q["qid"]: q["group"] for q in c["queues"]}
    assert placed[0] == 0                                       # admin: the coordinator
    assert sorted(placed[q] for q in (1, 2, 3, 4)) == [0, 0, 1, 1], placed
    groups = st["groups"]
    assert [g["index"] for g in groups] == [0, 1] and groups[1]["pid"] != groups[0]["pid"]
    assert [g["queues"] for g in groups] == [2, 2]
    # every group served I/O, and the totals are the sums of the groups
    for key in ("reads", "writes", "read_bytes", "written_bytes"):
        assert all(g["io"][key] > 0 for g in groups), (key, groups)
        total = sum(g["io"][key] for g in groups)
        assert total == c["io"][key] == st["subsystems"][0]["io"][key] \
            == st["subsystems"][0]["namespaces"][0]["io"][key], key
    assert "poll groups: 2" in text and "@g1" in text, text
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{two_groups.metrics}/metrics",
                                  timeout=10).read().decode()
    assert 'blockfabric_poll_group_queues{group="1"} 0' in body, body     # disconnected
    assert 'blockfabric_poll_group_io_total{group="1",op="write"}' in body
    assert 'blockfabric_poll_group_cpu_seconds_total{group="1"}' in body


def test_a_controller_reset_stops_io_on_every_group(two_groups):
    """After the host disables the controller (CC.EN 1 -> 0, a reset) every I/O queue
    answers Command Sequence Error, as nvmet does: those the coordinator serves and those
    handed to the other poll group alike (its worker is told)."""
    with connect("127.0.0.1", NQN, two_groups.port, transport="tcp", hostnqn=HOSTNQN,
                 nr_io_queues=4) as ctrl:
        ctrl.namespaces[1].write(0, b"\x11" * 4096)
        ctrl.property_set(0x14, 0)          # CC: EN 1 -> 0
        statuses = []
        for queue in ctrl.io_queues:
            done: concurrent.futures.Future = concurrent.futures.Future()
            ctrl.submit(queue, SQE(opcode=0x02, nsid=1), lambda cqe, data, err:
                        done.set_result((cqe, err)), data_in=4096)
            cqe, err = done.result(10)
            assert err is None
            statuses.append(cqe.status)
        assert statuses == [StatusCode.CMD_SEQ_ERROR] * 4, statuses
    assert "Traceback" not in two_groups.log


def test_killing_a_worker_fails_only_its_queues(two_groups):
    """Two hosts of one I/O queue each: the TCP one's goes to the worker (a tie goes to a
    worker), the soft-RDMA one's then to the coordinator (less loaded).  SIGKILL the worker:
    the TCP host's queue fails and it reconnects (its data intact: the ramdisk is the
    coordinator's shared memory); the RDMA host keeps its controller; a new worker takes
    new queues."""
    tcp = Controller(ConnectOptions(traddr="127.0.0.1", trsvcid=two_groups.port, subnqn=NQN,
                                    transport="tcp", hostnqn=HOSTNQN, nr_io_queues=1,
                                    keep_alive_tmo=1.0, reconnect_delay=0.3,
                                    ctrl_loss_tmo=30)).connect()
    rdma = Controller(ConnectOptions(traddr=addr_of(), trsvcid=two_groups.rdma_port,
                                     subnqn=NQN, **via(), hostnqn=OTHER_HOSTNQN,
                                     nr_io_queues=1)).connect()
    try:
        payload = os.urandom(1 << 20)
        tcp.namespaces[1].write(0, payload)
        st = status(two_groups.socket)
        old = st["groups"][1]["pid"]
        before = {c["hostnqn"]: c["cntlid"] for c in st["controllers"]}
        where = {c["hostnqn"]: [q["group"] for q in c["queues"] if q["qid"]]
                 for c in st["controllers"]}
        assert where == {HOSTNQN: [1], OTHER_HOSTNQN: [0]}, where
        os.kill(old, signal.SIGKILL)
        assert two_groups.wait_log("poll group 1 (pid", 10), two_groups.log
        # the TCP host reconnects and reads what it wrote; the RDMA host never noticed
        assert tcp.namespaces[1].read(0, len(payload)) == payload
        verify_workload(rdma.namespaces[1], seed=5, ops=100, inflight=8)
        verify_workload(tcp.namespaces[1], seed=6, ops=100, inflight=8)
        st = settled(two_groups.socket, lambda s: s["groups"][1]["alive"])
        after = {c["hostnqn"]: c["cntlid"] for c in st["controllers"]}
        assert after[OTHER_HOSTNQN] == before[OTHER_HOSTNQN]
        assert after[HOSTNQN] != before[HOSTNQN]          # a new controller: reconnected
        assert st["groups"][1]["alive"] and st["groups"][1]["pid"] != old
        # the new worker takes new queues, over either transport
        for kind, port in (("tcp", two_groups.port), (RDMA, two_groups.rdma_port)):
            with connect(addr_of(kind), NQN, port, **via(kind), hostnqn=THIRD_HOSTNQN,
                         nr_io_queues=2) as third:
                verify_workload(third.namespaces[1], seed=7, ops=50, inflight=8)
                st = status(two_groups.socket)
            (c,) = [c for c in st["controllers"] if c["hostnqn"] == THIRD_HOSTNQN]
            assert 1 in [q["group"] for q in c["queues"]], (kind, c)
        assert "exited" in two_groups.log
    finally:
        tcp.close()
        rdma.close()


def _connect_and_vanish(ctrl, qid: int) -> None:
    """Send queue ``qid``'s Fabrics Connect and disconnect at once, without waiting for
    the answer (a host that gives up on a slow Connect, or dies after sending it)."""
    queue = ctrl.open_queue(qid, 16)
    data = ConnectData(hostid=ctrl.hostid, cntlid=ctrl.cntlid, subnqn=NQN,
                       hostnqn=ctrl.hostnqn).pack()
    sqe = ConnectCommand(recfmt=0, qid=qid, sqsize=15, cattr=0, kato=0).to_sqe()
    ctrl.submit(queue, sqe, lambda *_: None, data_out=data,
                inline=queue.inline_size >= CAPSULE_CONNECT_DATA)
    queue.close()


@pytest.mark.parametrize("transport", [RDMA, "tcp"])
def test_a_queue_that_ends_as_its_connect_is_checked_frees_its_qid(two_groups, transport):
    """An I/O queue handed to the worker ends (the host disconnects) as its Connect is
    checked: the coordinator has bound the qid to the controller, the worker drops the
    queue (RDMA: the Connect may still be with the coordinator; NVMe/TCP: the worker finds
    the connection gone).  The qid is freed all the same, so the host's next Connect of it
    is taken; left bound, every later one is refused as "already connected" and the host
    never gets its queue back (a FUSE worker reconnecting through a target restart, on verbs
    in the lab, was refused for all of ctrl_loss_tmo)."""
    port = two_groups.port if transport == "tcp" else two_groups.rdma_port
    opts = ConnectOptions(traddr=addr_of(transport), trsvcid=port, subnqn=NQN,
                          **via(transport), hostnqn=HOSTNQN, nr_io_queues=2)
    host = Controller(opts)
    host.io_share = (1, 2)          # connects qid 2 only: qid 1 is left for the test
    host.connect()
    other = connect(addr_of(transport), NQN, port, **via(transport), hostnqn=OTHER_HOSTNQN,
                    nr_io_queues=1)
    try:
        st = status(two_groups.socket)
        where = {c["hostnqn"]: [q["group"] for q in c["queues"] if q["qid"]]
                 for c in st["controllers"]}
        # one I/O queue in each group: a tie, so each qid 1 below goes to the worker
        assert sorted(where[HOSTNQN] + where[OTHER_HOSTNQN]) == [0, 1], where
        with target_log_on_error(two_groups):
            for _ in range(20):
                _connect_and_vanish(host, 1)
            # the target frees each qid once it has seen its queue go, which may come
            # after the next Connect (as a restarted FUSE worker does, try for a while)
            deadline = time.monotonic() + 10
            while True:
                queue = host.open_queue(1, 16)
                try:
                    assert host.fabrics_connect(queue, 1, 15, 0) == host.cntlid
                    break
                except NvmeError as exc:
                    queue.close()
                    assert exc.status == StatusCode.CMD_SEQ_ERROR, exc
                    assert time.monotonic() < deadline, "qid 1 was never freed"
                    time.sleep(0.1)
            host.io_queues.append(queue)
            verify_workload(host.namespaces[1], seed=9, ops=50, inflight=8)
    finally:
        other.close()
        host.close()


def test_reservations_hold_in_every_group(two_groups):
    """Host A holds Write Exclusive; host B's writes conflict on every one of its queues,
    whichever group serves it, and A's succeed on all of its; B's preempt-and-abort is in
    force in every group when it answers."""
    opts = dict(traddr="127.0.0.1", trsvcid=two_groups.port, subnqn=NQN, transport="tcp",
                nr_io_queues=2)
    a = Controller(ConnectOptions(hostnqn=HOSTNQN, hostid=b"A" * 16, **opts)).connect()
    b = Controller(ConnectOptions(hostnqn=OTHER_HOSTNQN, hostid=b"B" * 16, **opts)).connect()
    try:
        st = status(two_groups.socket)
        for c in st["controllers"]:
            assert sorted(q["group"] for q in c["queues"] if q["qid"]) == [0, 1], c
        na, nb = a.namespaces[1], b.namespaces[1]
        resv.register(na, nrkey=0xA)
        resv.register(nb, nrkey=0xB)
        resv.acquire(na, crkey=0xA, rtype=1)            # write exclusive
        # each host's commands go round-robin over its queues: four of each reach both
        for i in (1, 2, 3, 4):
            na.write(4096 * i, b"a" * 4096)
            with pytest.raises(NvmeError) as err:
                nb.write(4096 * i, b"b" * 4096)
            assert err.value.status == CONFLICT, i
            assert nb.read(4096 * i, 4096) == b"a" * 4096
        resv.acquire(nb, crkey=0xB, prkey=0xA, rtype=1, racqa=2)     # preempt and abort
        for i in (1, 2, 3, 4):
            with pytest.raises(NvmeError) as err:
                na.write(4096 * i, b"x" * 4096)
            assert err.value.status == CONFLICT, i
            nb.write(4096 * i, b"b" * 4096)
        assert na.read(4096, 4 * 4096) == b"b" * 4 * 4096
        # four conflicts each, two per queue, so two in each group; counted in the one
        # controller whichever group answered them
        st = settled(two_groups.socket, lambda s: sorted(
            c["io"]["errors"] for c in s["controllers"]) == [4, 4])
        assert sorted(c["io"]["errors"] for c in st["controllers"]) == [4, 4], st
    finally:
        a.close()
        b.close()


def test_shared_ramdisk_is_one_memory_in_every_mapping():
    """A ramdisk of a target with poll groups is a memfd: another mapping of it (a worker's)
    sees every write, and Write Zeroes frees whole pages without leaving the old bytes
    behind (MADV_DONTNEED would, on shared memory)."""
    RamdiskBackend.shared = True
    try:
        vol = RamdiskBackend(1 << 20)
    finally:
        RamdiskBackend.shared = False
    other = RamdiskBackend(1 << 20, fd=os.dup(vol.memfd))
    try:
        vol.write(8192, b"z" * 3 * mmap.PAGESIZE)
        assert bytes(other.memory[8192:8192 + 3 * mmap.PAGESIZE]) == b"z" * 3 * mmap.PAGESIZE
        vol.write_zeroes(8192, 3 * mmap.PAGESIZE)
        assert bytes(other.memory[8192:8192 + 3 * mmap.PAGESIZE]) == bytes(3 * mmap.PAGESIZE)
    finally:
        other.close()
        vol.close()


def test_rbd_namespaces_and_a_gateway_load_with_poll_groups():
    # served since issue 19 (tests/ceph: test_rbd.py, test_gateway.py with 2 reactors)
    config = {**ram_config(4420, transport="tcp", reactors=2), "subsystems": [
        {"nqn": NQN, "allow_any_host": True, "namespaces": [
            {"nsid": 1, "backend": "rbd", "rbd": {"pool": "p", "image": "i"}}]}],
        "gateway": {"name": "a", "group": "g", "cntlid_min": 1, "cntlid_max": 9,
                    "ana_groups": [1]}}
    assert cfg.TargetConfig.from_dict(config).reactor_count == 2


@pytest.mark.parametrize("provider", ["verbs", "auto"])
def test_verbs_and_auto_listeners_take_poll_groups(provider):
    """The rdma_cm id stays in the coordinator, the QP is the worker's (issue 19; the
    connection itself is tested in the lab: tests/lab/pollgroups.sh)."""
    config = {**ram_config(4420, transport="tcp", reactors=2),
              "listeners": [{"address": "127.0.0.1", "port": 4420, "provider": provider}]}
    assert cfg.TargetConfig.from_dict(config).reactor_count == 2


@pytest.mark.parametrize("value", [0, -1, 257, True, "all", 1.5])
def test_reactors_values(value):
    with pytest.raises(BlockfabricError, match="reactors: expected an integer from 1 to 256 "
                                                 'or "auto"'):
        cfg.TargetConfig.from_dict({**ram_config(4420, transport="tcp"), "reactors": value})
    auto = cfg.TargetConfig.from_dict({**ram_config(4420, transport="tcp"), "reactors": "auto"})
    assert auto.reactor_count == len(os.sched_getaffinity(0))
    assert cfg.TargetConfig.from_dict(ram_config(4420)).reactor_count == 1


def test_a_reload_cannot_change_reactors(two_groups, tmp_path):
    import yaml
    config = yaml.safe_load(two_groups.path.read_text())
    two_groups.path.write_text(yaml.safe_dump({**config, "reactors": 1}))
    two_groups.proc.send_signal(signal.SIGHUP)
    st = settled(two_groups.socket, lambda s: s["last_reload_error"])
    assert "reactors: 2 -> 1: cannot change on reload" in st["last_reload_error"]
    assert len(st["groups"]) == 2
    # limits may change: the workers get them too, and serve on
    two_groups.path.write_text(yaml.safe_dump({**config, "limits": {"mdts": "256KiB"}}))
    two_groups.proc.send_signal(signal.SIGHUP)
    st = settled(two_groups.socket, lambda s: s["reloads"] == 1)
    assert st["reloads"] == 1 and st["last_reload_error"] is None
    with connect("127.0.0.1", NQN, two_groups.port, transport="tcp", hostnqn=HOSTNQN,
                 nr_io_queues=2) as ctrl:
        verify_workload(ctrl.namespaces[1], seed=9, ops=100, inflight=16)


@contextlib.contextmanager
def target_log_on_error(target):
    """The target's log in the message of whatever fails inside (the host's own error says
    only what the host saw: "peer disconnected")."""
    try:
        yield
    except Exception as exc:
        raise AssertionError(f"{exc!r}; the target's log:\n{target.log}") from exc


@contextlib.contextmanager
def silent_host_writing(socket_path: str, port: int, transport: str, kato: float,
                        seconds: float):
    """A host that sends no Keep Alive (``kato``) but writes on its I/O queue, which is in
    the worker, every 50 ms for ``seconds``; then silent (the caller waits for the expiry).
    Closed at the end, whatever the target did to it meanwhile.  ``transport`` rdma is the
    run's RDMA transport (:data:`RDMA`: soft, or verbs)."""
    kind = RDMA if transport == "rdma" else transport
    ctrl = connect(addr_of(kind), NQN, port, **via(kind), hostnqn=HOSTNQN,
                   nr_io_queues=1, keep_alive_tmo=kato, send_keep_alive=False,
                   ctrl_loss_tmo=0)
    ns = ctrl.namespaces[1]
    failed: list[BaseException] = []

    def write() -> None:
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                ns.write(0, b"k" * 4096)
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            failed.append(exc)

    # the writes start at once: `status` below is a process of its own, and under TCG (the
    # lab) its start alone took longer than KATO, so the controller had expired before the
    # first write when they came after it
    writer = threading.Thread(target=write)
    writer.start()
    try:
        (c,) = status(socket_path)["controllers"]
        assert {q["qid"]: q["group"] for q in c["queues"]} == {0: 0, 1: 1}
        writer.join()
        assert not failed, failed
        assert ns.read(0, 4096) == b"k" * 4096
        yield
    finally:
        writer.join()
        try:
            ctrl.close()
        except Exception:  # noqa: BLE001  (the target ended it: that is the point)
            pass


def test_a_late_worker_report_does_not_end_an_active_controller(start_target, tmp_path):
    """The workers report each controller's last command every 0.5 s; on a busy machine a
    report can come late.  Before ending a controller served in a worker, the keep-alive
    asks its groups for their reports now: here the periodic ones come every 30 s, so only
    that question keeps the host (I/O on the worker's queue, no Keep Alive) alive; once
    the host falls silent the controller still ends."""
    port = free_port()
    config = ram_config(port, transport="tcp", reactors=2)
    config["control_socket"] = str(tmp_path / "control.sock")
    target = start_target(config, env={"BLOCKFABRIC_POLL_STATS_INTERVAL": "30"})
    kato = 1.0
    with silent_host_writing(config["control_socket"], port, "tcp", kato, 4 * kato):
        assert "keep-alive timeout" not in target.log, target.log
        assert target.wait_log("keep-alive timeout", 4 * kato + 5), target.log


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_io_on_a_workers_queue_keeps_a_silent_host_alive(two_groups, transport):
    """A host that sends no Keep Alive (KATO 3 s) but does I/O on a queue in the worker:
    the worker's reports (each controller's last command, in its 0.5 s stats) count as
    activity, so the controller lives on; once the host falls silent it expires within
    KATO plus the reports' allowance (groupstate.ACTIVITY_LAG)."""
    from blockfabric.target.groupstate import ACTIVITY_LAG
    kato = 3.0      # (2 s failed once in CI at load 11, the host lost: the log says why next time)
    port = two_groups.port if transport == "tcp" else two_groups.rdma_port
    with target_log_on_error(two_groups), \
            silent_host_writing(two_groups.socket, port, transport, kato, 3 * kato):
        assert "keep-alive timeout" not in two_groups.log, two_groups.log
        silent = time.monotonic()
        assert two_groups.wait_log("keep-alive timeout", kato + ACTIVITY_LAG + 5), \
            two_groups.log
        took = time.monotonic() - silent
        assert kato - 0.1 <= took <= kato + ACTIVITY_LAG + 2, took


SLOW_WORKER = """\
import os, time
with open("/proc/self/cmdline", "rb") as f:
    if b"blockfabric.target.worker" in f.read():
        time.sleep({seconds!r})
        if {exit!r}:
            os._exit({exit!r})
"""


@pytest.mark.parametrize("case", ["slow", "dies"])
def test_a_worker_that_does_not_start_fails_the_start_saying_why(tmp_path, case):
    """A worker slower than ``limits.worker_start_timeout`` (here: its interpreter held up
    in sitecustomize, as a loaded or emulated machine does) or one that exits at once: the
    target refuses to start, names the group, the reason and the key, and leaves no worker
    behind."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WORKER.format(
        seconds=6 if case == "slow" else 0, exit=0 if case == "slow" else 3))
    config = {**ram_config(free_port(), transport="tcp", reactors=2),
              "limits": {"worker_start_timeout": 2}}
    path = tmp_path / "target.yaml"
    import yaml
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=str(site))
    t0 = time.monotonic()
    done = subprocess.run([str(BIN / "blockfabric-target"), "run", "-C", str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    if case == "slow":
        assert ("poll group 1 did not start: not ready within 2 s "
                "(limits.worker_start_timeout;") in done.stderr, done.stderr
        assert time.monotonic() - t0 < 6 + 20    # gave up at the timeout, not the worker
        pid = int(re.search(r"pid (\d+) is still starting", done.stderr).group(1))
        assert not os.path.exists(f"/proc/{pid}"), "the worker outlived its target"
    else:
        assert "poll group 1 did not start: its process" in done.stderr, done.stderr
        assert "exited with status 3" in done.stderr, done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_through_the_coordinator(tmp_path, sig):
    """systemd's stop signals every process of the unit (KillMode=control-group, the
    default) and a terminal's Ctrl-C the whole foreground group: the worker leaves its
    ending to the coordinator, which drains it (the host's I/O in the worker answered, the
    volumes flushed), and the target exits 0 with no traceback from any process."""
    import yaml
    config = ram_config(free_port(), transport="tcp", reactors=2)
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C", str(path), "-v"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    import threading
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not any("ready:" in ln for ln in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        ctrl = connect("127.0.0.1", NQN, config["listeners"][0]["port"], transport="tcp",
                       hostnqn=HOSTNQN, nr_io_queues=1, ctrl_loss_tmo=0)
        ns = ctrl.namespaces[1]
        ns.write(0, b"d" * 4096)
        os.killpg(proc.pid, sig)
        rc = proc.wait(30)
        reader.join(5)
        log = "".join(lines)
        assert rc == 0, log
        assert "Traceback" not in log, log
        assert "group 1: coordinator gone" not in log, log
        # the worker is counted as a group draining, not as a command in flight
        assert "0 command(s) in flight, 1 controller(s), 1 poll group(s) draining" in log, log
        assert "drained: volumes flushed" in log, log
        with contextlib.suppress(Exception):
            ctrl.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

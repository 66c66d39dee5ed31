"""Controller life: keep-alive, discovery filtering, and hostile command streams."""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from blockfabric.initiator.host import (ConnectOptions, Controller, NvmeError, QueueDead,
                                        connect, discover)
from blockfabric.protocol import (SQE, CQE, KeyedSGL, OffsetSGL,
                                  StatusCode)
from blockfabric.target.groupstate import ACTIVITY_LAG

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN, addr_of, free_port, ram_config, via

KATO_GRACE = 1.0  # seconds past KATO within which the target must notice (timer slack)


def test_keep_alive_expiry_tears_the_controller_down(ram_target):
    kato = 1.0
    # a controller with a queue in a poll-group worker gets ACTIVITY_LAG more (the
    # worker's reports of its commands come every 0.5 s)
    grace = KATO_GRACE + (ACTIVITY_LAG if ram_target.config.get("reactors", 1) > 1 else 0)
    ctrl = connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                   nr_io_queues=1, keep_alive_tmo=kato, send_keep_alive=False,
                   ctrl_loss_tmo=0)     # 0: no reconnect, so I/O fails at once
    try:
        cntlid = ctrl.cntlid
        ctrl.namespaces[1].write(0, b"k" * 4096)          # activity re-arms the timer
        idle_from = time.monotonic()
        assert ram_target.wait_log(f"ctrl {cntlid} ", 1)
        assert ram_target.wait_log("keep-alive timeout", kato + grace + 0.5)
        expired_after = time.monotonic() - idle_from
        assert expired_after <= kato + grace, expired_after
        # The controller's queues are gone: I/O fails instead of hanging.
        with pytest.raises((QueueDead, ConnectionError)):
            for _ in range(20):
                ctrl.namespaces[1].read(0, 4096)
                time.sleep(0.05)
        # An I/O queue Connect naming the old controller is refused with 0x182 | DNR.
        late = Controller(ConnectOptions(traddr=addr_of(), subnqn=NQN,
                                         trsvcid=ram_target.port, **via(),
                                         hostnqn=HOSTNQN))
        late.reactor.start()
        try:
            late.cntlid = cntlid
            late.inline_size = 4096
            queue = late.open_queue(1, 16)
            with pytest.raises(NvmeError) as err:
                late.fabrics_connect(queue, 1, 15, 0)
            assert (err.value.status, err.value.dnr) == (StatusCode.CONNECT_INVALID_PARAM, True)
        finally:
            late.close()
    finally:
        ctrl.close()


def test_keep_alive_sent_by_the_host_keeps_an_idle_controller(ram_target):
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1, keep_alive_tmo=1.0) as ctrl:
        time.sleep(2.5)                                   # idle well past KATO
        ctrl.namespaces[1].write(0, b"a" * 4096)
        assert ctrl.namespaces[1].read(0, 4096) == b"a" * 4096
        assert ctrl.queue_stats()[0]["completed"] >= 10   # connect + >= 4 keep-alives
    assert "keep-alive timeout" not in ram_target.log


def test_discovery_shows_a_host_only_what_it_may_use(start_target):
    port = free_port()
    config = ram_config(port)
    config["subsystems"].append({
        "nqn": "nqn.2026-12.io.blockfabric:private", "allow_any_host": False,
        "hosts": [OTHER_HOSTNQN],
        "namespaces": [{"nsid": 1, "backend": "null", "size": "1GiB"}]})
    start_target(config)
    seen = {e.subnqn for e in discover(addr_of(), port, **via(), hostnqn=HOSTNQN)}
    assert seen == {NQN}
    seen = {e.subnqn for e in discover(addr_of(), port, **via(),
                                       hostnqn=OTHER_HOSTNQN)}
    assert seen == {NQN, "nqn.2026-12.io.blockfabric:private"}
    entry = discover(addr_of(), port, **via(), hostnqn=HOSTNQN)[0]
    assert (entry.traddr, entry.trsvcid, entry.trtype, entry.adrfam) == \
        (addr_of(), str(port), 1, 1)


def test_normal_shutdown_completes_and_flushes(start_target, tmp_path):
    port = free_port()
    path = tmp_path / "v.img"
    target = start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(path), "size": "4MiB"}]))
    ctrl = connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN)
    ctrl.namespaces[1].write(0, b"s" * 4096)
    ctrl.shutdown()
    assert (ctrl.property_get(0x1C, 4) >> 2) & 3 == 2        # CSTS.SHST = complete
    ctrl.close()
    assert path.read_bytes()[:4096] == b"s" * 4096
    assert target.alive()


def test_a_flush_of_every_namespace_with_none_succeeds(start_target):
    """Flush with NSID FFFFFFFFh on a subsystem without namespaces (``namespaces: []``):
    nothing to flush, so success, not an internal error (and no traceback)."""
    port = free_port()
    target = start_target(ram_config(port, namespaces=[]))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN, nr_io_queues=1) as ctrl:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        ctrl.submit(ctrl.io_queues[0], SQE(opcode=0x00, nsid=0xFFFFFFFF),
                    lambda cqe, data, err: fut.set_result((cqe, err)))
        cqe, err = fut.result(10)
        assert err is None and cqe.status == StatusCode.SUCCESS, cqe
    assert target.alive() and "Traceback" not in target.log


@pytest.mark.parametrize("command, expected", [
    *[(f"Get Features {fid:#04x}", (SQE(opcode=0x0A, cdw10=fid), 0, StatusCode.SUCCESS))
      for fid in (0x01, 0x02, 0x04, 0x05, 0x0A)],
    ("Set Features AEC, a bit of no event", (SQE(opcode=0x09, cdw10=0x0B, cdw11=0x1), 0,
                                             StatusCode.INVALID_FIELD)),
    ("Keep Alive with a data buffer", (SQE(opcode=0x18), 4096,
                                       StatusCode.SGL_DATA_LENGTH_INVALID)),
])
def test_admin_commands_answer_as_nvmet(ram_target, command, expected):
    """Statuses as the kernel's nvmet gives them: the mandatory features without a setting
    here read 0, an asynchronous event configuration naming no event this target knows is
    Invalid Field (DNR), and a Keep Alive with a data buffer is Data SGL Length Invalid."""
    sqe, data_in, status = expected
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as ctrl:
        done: concurrent.futures.Future = concurrent.futures.Future()
        ctrl.submit(ctrl.admin, sqe, lambda cqe, data, err: done.set_result((cqe, err)),
                    data_in=data_in)
        cqe, err = done.result(10)
        assert err is None and cqe.status == status, (command, cqe)
        assert cqe.dnr == (status != StatusCode.SUCCESS)
        ctrl.namespaces[1].write(0, b"n" * 4096)         # the controller carries on
        assert ctrl.namespaces[1].read(0, 4096) == b"n" * 4096


def test_aer_limit(ram_target):
    """AERs stay outstanding; past the advertised limit (aerl + 1) the target answers 0x105."""
    from blockfabric.protocol import AsyncEventRequest
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as ctrl:
        limit = ctrl.identify.aerl + 1
        answers = []
        for _ in range(limit + 2):
            ctrl.admin.submit(AsyncEventRequest().to_sqe(),
                              lambda cqe, err: answers.append((cqe, err)))
        deadline = time.monotonic() + 5
        while len(answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # the host library keeps one AER of its own outstanding, so at least 2 are refused
        assert len(answers) >= 2, answers
        assert all(c.status == StatusCode.AER_LIMIT_EXCEEDED for c, _ in answers), answers
        ctrl.namespaces[1].write(0, bytes(4096))     # the controller carries on


# -- hostile command streams -------------------------------------------------------

# Asynchronous Event Requests are left out: a target holds them until an event, by design
# (test_aer_limit covers them).  0x0C on an I/O queue is Verify, which is in.
OPCODES = [0x00, 0x01, 0x02, 0x04, 0x05, 0x08, 0x09, 0x0C, 0x7F, 0x7E, 0xFF,  # I/O, bad
           0x02, 0x06, 0x09, 0x0A, 0x18, 0x80]                              # admin, bad


@st.composite
def capsules(draw):
    """A capsule: mostly well formed, with any field turned hostile."""
    opcode = draw(st.sampled_from(OPCODES))
    nsid = draw(st.sampled_from([0, 1, 2, 0xFFFFFFFF, draw(st.integers(0, 2**32 - 1))]))
    dwords = [draw(st.sampled_from([0, 1, 7, 0xFFFF, 0xFFFFFFFF,
                                    draw(st.integers(0, 2**32 - 1))])) for _ in range(6)]
    sgl = draw(st.sampled_from(["null", "keyed", "keyed-badkey", "offset", "garbage"]))
    length = draw(st.sampled_from([0, 1, 512, 4096, 8192, (1 << 24) - 1]))
    flags = draw(st.sampled_from([0x40, 0x40, 0x00, 0x41, 0x80]))
    inline = draw(st.sampled_from([0, 0, 16, 4096]))
    queue = draw(st.sampled_from(["admin", "io"]))
    if queue == "admin" and opcode == 0x0C:
        queue = "io"
    return opcode, nsid, dwords, sgl, length, flags, inline, queue


def build(ctrl: Controller, spec) -> tuple[bytes, str]:
    opcode, nsid, dwords, sgl_kind, length, flags, inline, queue = spec
    arena = ctrl.arena
    sgl = {"null": KeyedSGL(),
           "keyed": KeyedSGL(arena.mr.addr, min(length, 65536), arena.mr.rkey),
           "keyed-badkey": KeyedSGL(arena.mr.addr, length, arena.mr.rkey ^ 0x5A5A),
           "offset": OffsetSGL(0, length),
           "garbage": KeyedSGL()}[sgl_kind]
    sqe = SQE(opcode, flags, 0, nsid, 0, 0, 0, sgl, *dwords)
    raw = bytearray(sqe.pack())
    if sgl_kind == "garbage":
        raw[24:40] = random.Random(length + nsid).randbytes(16)
    return bytes(raw) + bytes(inline), queue


@pytest.fixture(scope="module")
def fuzz_target(module_ram_target):
    return module_ram_target


@settings(max_examples=25, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],   # no shrinking: a hang
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(capsules(), min_size=1, max_size=12))
def test_random_command_streams_never_kill_the_target(fuzz_target, stream):
    with connect(addr_of(), NQN, fuzz_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1, queue_size=16) as ctrl:
        for spec in stream:
            capsule, which = build(ctrl, spec)
            queue = ctrl.admin if which == "admin" else ctrl.io_queues[0]
            if queue.dead_reason:
                continue       # a hostile SGL may legitimately cost the host its queue
            try:
                cqe = ctrl.raw(queue, capsule, timeout=30)
            except QueueDead:
                continue
            except TimeoutError:
                raise AssertionError(f"no answer in 30 s to {which} capsule {capsule.hex()}"
                                     f"\n--- target log tail ---\n"
                                     f"{''.join(fuzz_target.lines[-30:])}") from None
            assert isinstance(cqe, CQE)
    assert fuzz_target.alive(), fuzz_target.log
    # Valid commands from a fresh connection still work.
    with connect(addr_of(), NQN, fuzz_target.port, **via(),
                 hostnqn=HOSTNQN) as ctrl:
        data = os.urandom(8192)
        ctrl.namespaces[1].write(40960, data)
        assert ctrl.namespaces[1].read(40960, 8192) == data

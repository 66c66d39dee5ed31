"""The reservation state machine (blockfabric.target.reservations), sans I/O: nvmet's
semantics (drivers/nvme/target/pr.c) command by command, the access table for all six
types, and the stores' persistence rules."""

from __future__ import annotations

import json
import os

import pytest

from blockfabric.protocol import resv
from blockfabric.protocol.resv import LogType
from blockfabric.protocol.status import StatusCode
from blockfabric.target import reservations
from blockfabric.target.resvstore import FileStore, MemoryStore, StoreError

A, B, C = (bytes([n]) * 16 for n in (0xA, 0xB, 0xC))
OK, CONFLICT, INVALID = reservations.OK, reservations.CONFLICT, StatusCode.INVALID_FIELD
REG, UNREG, REPL = 0, 1, 2
ACQ, PRE, PRE_ABORT = 0, 1, 2


def reg(st, host, key, action=REG, crkey=0, iekey=False, cptpl=0, capable=True):
    return reservations.register(st, host, action, iekey, cptpl, crkey, key, ptpl_capable=capable)


def ok(out: reservations.Outcome) -> reservations.State:
    assert out.status == OK, out.status
    return out.state


def setup(*hosts, holder=None, rtype=0) -> reservations.State:
    """Each host registered with key 0x10 + its index; ``holder`` acquires ``rtype``."""
    st = reservations.State()
    for i, h in enumerate(hosts):
        st = ok(reg(st, h, 0x10 + i))
    if holder is not None:
        st = ok(reservations.acquire(st, holder, ACQ, False, rtype, st.key_of(holder), 0))
    return st


def test_blktests_050_generation_trace():
    """nvme/050.out: gen 1 register, 2 replace, 3 unregister, 4 register (+acquire: no
    bump), 5 preempt to type 2, 5 after release."""
    st = ok(reg(reservations.State(), A, 4))
    assert st.gen == 1
    st = ok(reg(st, A, 5, REPL, crkey=4))
    assert (st.gen, st.key_of(A)) == (2, 5)
    st = ok(reg(st, A, 0, UNREG, crkey=5))
    assert (st.gen, st.regs) == (3, ())
    st = ok(reg(st, A, 4))
    st = ok(reservations.acquire(st, A, ACQ, False, 1, 4, 0))
    assert (st.gen, st.rtype, reservations.report(st).registrants[0].holder) == (4, 1, True)
    st = ok(reservations.acquire(st, A, PRE, False, 2, 4, 4))
    assert (st.gen, st.rtype) == (5, 2)
    st = ok(reservations.release(st, A, 0, False, 2, 4))
    assert (st.gen, st.rtype, st.holder) == (5, 0, None)


def test_register_rules():
    st = ok(reg(reservations.State(), A, 7))
    assert ok(reg(st, A, 7)).gen == 2                        # same key again: success
    assert reg(st, A, 8).status == CONFLICT                  # another key
    assert reg(st, A, 0, UNREG, crkey=6).status == CONFLICT
    assert ok(reg(st, A, 0, UNREG, iekey=True)).regs == ()   # IEKEY ignores CRKEY
    assert reg(st, B, 0, UNREG).status == CONFLICT           # not registered
    assert reg(st, B, 9, REPL).status == CONFLICT
    assert ok(reg(st, B, 9, REPL, iekey=True)).key_of(B) == 9   # 1.3 IEKEY: registers
    assert reg(st, B, 0, REPL, iekey=True).status == INVALID
    assert reg(st, A, 1, action=3).status == StatusCode.INVALID_OPCODE
    assert reg(st, B, 1, cptpl=1).status == INVALID          # CPTPL 1 is reserved
    assert reg(st, B, 1, cptpl=3, capable=False).status == INVALID
    assert ok(reg(st, B, 1, cptpl=3)).ptpl
    assert not ok(reg(ok(reg(st, B, 1, cptpl=3)), B, 1, cptpl=2)).ptpl


def test_unregister_holder_releases_or_passes():
    for rtype in (1, 2):
        st = ok(reg(setup(A, B, holder=A, rtype=rtype), A, 0, UNREG, crkey=0x10))
        assert (st.rtype, st.holder) == (0, None)
    out = reg(setup(A, B, C, holder=A, rtype=3), A, 0, UNREG, crkey=0x10)
    assert ok(out).rtype == 0
    assert {(n.hostid, n.log_type) for n in out.notices} == \
        {(B, LogType.RESERVATION_RELEASED), (C, LogType.RESERVATION_RELEASED)}
    st = ok(reg(setup(A, B, holder=A, rtype=6), A, 0, UNREG, crkey=0x10))
    assert (st.rtype, st.holder) == (6, B)                   # all registrants: passes on
    st = ok(reg(st, B, 0, UNREG, crkey=0x11))
    assert (st.rtype, st.holder) == (0, None)                # the last one: none left


def test_replace_keeps_the_reservation():
    st = ok(reg(setup(A, B, holder=A, rtype=1), A, 0x99, REPL, crkey=0x10))
    assert (st.holder, st.rtype, st.key_of(A)) == (A, 1, 0x99)


def test_acquire_rules():
    st = setup(A, B)
    assert reservations.acquire(st, A, ACQ, True, 1, 0x10, 0).status == INVALID      # IEKEY
    assert reservations.acquire(st, A, ACQ, False, 7, 0x10, 0).status == INVALID     # rtype
    assert reservations.acquire(st, A, ACQ, False, 0, 0x10, 0).status == INVALID
    assert reservations.acquire(st, A, ACQ, False, 1, 0x99, 0).status == CONFLICT    # wrong key
    assert reservations.acquire(st, C, ACQ, False, 1, 0, 0).status == CONFLICT    # not registered
    assert reservations.acquire(st, A, 3, False, 1, 0x10, 0).status == StatusCode.INVALID_OPCODE
    held = ok(reservations.acquire(st, A, ACQ, False, 1, 0x10, 0))
    assert held.gen == st.gen                                  # acquire: no bump
    assert ok(reservations.acquire(held, A, ACQ, False, 1, 0x10, 0)) == held
    assert reservations.acquire(held, A, ACQ, False, 2, 0x10, 0).status == CONFLICT
    assert reservations.acquire(held, B, ACQ, False, 1, 0x11, 0).status == CONFLICT
    allregs = setup(A, B, holder=A, rtype=5)
    assert ok(reservations.acquire(allregs, B, ACQ, False, 5, 0x11, 0)) == allregs   # B holds too


def test_preempt_cases():
    # no holder: unregister by key (conflict when none matches)
    st = setup(A, B, C)
    out = reservations.acquire(st, A, PRE, False, 1, 0x10, 0x11)
    assert ok(out).regs == ((A, 0x10), (C, 0x12)) and ok(out).rtype == 0
    assert out.notices == [reservations.Notice(B, LogType.REGISTRATION_PREEMPTED)]
    assert reservations.acquire(st, A, PRE, False, 1, 0x10, 0x77).status == CONFLICT
    # the holder preempts itself: a type change, "released" to the others
    st = setup(A, B, holder=A, rtype=1)
    out = reservations.acquire(st, A, PRE, False, 3, 0x10, 0x10)
    assert (ok(out).rtype, ok(out).holder, ok(out).gen) == (3, A, st.gen + 1)
    assert out.notices == [reservations.Notice(B, LogType.RESERVATION_RELEASED)]
    # PRKEY = the holder's key: the caller takes over, the old holder is unregistered
    out = reservations.acquire(st, B, PRE_ABORT, False, 2, 0x11, 0x10)
    st2 = ok(out)
    assert (st2.holder, st2.rtype, st2.regs) == (B, 2, ((B, 0x11),))
    assert out.fenced == [A]
    assert reservations.Notice(A, LogType.REGISTRATION_PREEMPTED) in out.notices
    # another PRKEY: unregisters those, the reservation stays; 0 is Invalid Field
    st = setup(A, B, C, holder=A, rtype=1)
    assert ok(reservations.acquire(st, B, PRE, False, 1, 0x11, 0x12)).regs == ((A, 0x10), (B, 0x11))
    assert reservations.acquire(st, B, PRE, False, 1, 0x11, 0).status == INVALID
    # all registrants, PRKEY 0: the caller holds the new type, all others go
    st = setup(A, B, C, holder=A, rtype=6)
    out = reservations.acquire(st, C, PRE_ABORT, False, 1, 0x12, 0)
    assert (ok(out).holder, ok(out).rtype, ok(out).regs) == (C, 1, ((C, 0x12),))
    assert sorted(out.fenced) == [A, B]
    # all registrants, PRKEY != 0: by key
    assert ok(reservations.acquire(st, C, PRE, False, 6, 0x12, 0x10)).regs == ((B, 0x11), (C, 0x12))


def test_release_and_clear():
    st = setup(A, B, C, holder=A, rtype=4)
    assert ok(reservations.release(st, B, 0, False, 4, 0x11)) == st    # not the holder: no effect
    assert reservations.release(st, A, 0, False, 1, 0x10).status == CONFLICT     # type mismatch
    assert reservations.release(st, A, 0, True, 4, 0x10).status == INVALID      # IEKEY
    assert reservations.release(st, A, 0, False, 4, 0x99).status == CONFLICT
    out = reservations.release(st, A, 0, False, 4, 0x10)
    assert (ok(out).rtype, ok(out).gen) == (0, st.gen)
    assert {n.hostid for n in out.notices} == {B, C}
    assert reservations.release(setup(A, B, holder=A, rtype=1), A, 0, False, 1, 0x10).notices == []
    out = reservations.release(st, B, 1, False, 0, 0x11)                          # clear
    assert (ok(out).regs, ok(out).rtype, ok(out).gen) == ((), 0, st.gen + 1)
    assert {(n.hostid, n.log_type) for n in out.notices} == \
        {(A, LogType.RESERVATION_PREEMPTED), (C, LogType.RESERVATION_PREEMPTED)}


# who may read / write: holder A, registrant B, non-registrant C (nvmet's table)
ACCESS = {
    # rtype: (B read, B write, C read, C write)
    1: (True, False, True, False),
    2: (False, False, False, False),
    3: (True, True, True, False),
    4: (True, True, False, False),
    5: (True, True, True, False),
    6: (True, True, False, False),
}


@pytest.mark.parametrize("rtype", sorted(ACCESS))
def test_access_table(rtype):
    st = setup(A, B, holder=A, rtype=rtype)
    assert not st.conflicts(A, False) and not st.conflicts(A, True)
    b_read, b_write, c_read, c_write = ACCESS[rtype]
    assert (not st.conflicts(B, False), not st.conflicts(B, True),
            not st.conflicts(C, False), not st.conflicts(C, True)) == ACCESS[rtype]
    assert (st.holds(B)) == (rtype in (5, 6))
    report = reservations.report(st)
    assert [r.holder for r in report.registrants] == [True, rtype in (5, 6)]
    assert b_read or not b_write


def test_report_packing_and_truncation():
    st = setup(A, B, C, holder=B, rtype=2)
    status = reservations.report(st)
    data = status.pack(64 + 64 * 2)
    back = resv.ReservationStatus.unpack(data)
    assert (back.gen, back.rtype, back.regctl, len(back.registrants)) == (3, 2, 3, 2)
    assert back.registrants[1] == resv.Registrant(0xFFFF, True, B, 0x11)
    assert data[5:7] == (3).to_bytes(2, "little")              # regctl at the odd offset
    assert resv.ReservationStatus.unpack(status.pack(64 + 64 * 3)).registrants[2].hostid == C


def test_state_json_round_trip_and_hostile():
    st = setup(A, B, holder=A, rtype=3)
    assert reservations.State.from_json(st.to_json()) == st
    for bad in ("", "{}", '{"gen":0,"rtype":9,"holder":null,"regs":[],"ptpl":false}',
                json.dumps({"gen": 0, "rtype": 1, "holder": "aa" * 16, "regs": [],
                            "ptpl": False}),
                json.dumps({"gen": 0, "rtype": 0, "holder": None, "regs": [["00", 1]],
                            "ptpl": False})):
        with pytest.raises(ValueError):
            reservations.State.from_json(bad)


def test_file_store_ptpl_and_corruption(tmp_path):
    vol = tmp_path / "vol.img"
    vol.write_bytes(b"")
    store = FileStore(str(vol))
    assert store.ptpl_capable
    out = store.update(lambda s: reg(s, A, 5))
    assert out.state.version == 1 and store.load().key_of(A) == 5
    assert FileStore(str(vol)).load(fresh_start=True).regs == ()      # no PTPL: gone
    store.update(lambda s: reg(s, A, 5, cptpl=3))
    store.update(lambda s: reservations.acquire(s, A, ACQ, False, 1, 5, 0))
    again = FileStore(str(vol)).load(fresh_start=True)                 # PTPL: kept
    assert (again.rtype, again.holder, again.key_of(A), again.ptpl) == (1, A, 5, True)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    (tmp_path / "vol.img.resv").write_text('{"gen": 1, "rtype"')        # torn by hand
    with pytest.raises(StoreError):
        FileStore(str(vol)).load()
    with pytest.raises(StoreError):
        store.update(lambda s: reg(s, B, 1))


def test_memory_store_refuses_nothing_but_keeps_nothing():
    store = MemoryStore()
    assert not store.ptpl_capable
    assert store.update(lambda s: reg(s, A, 1, cptpl=3, capable=False)).status == INVALID
    assert store.update(lambda s: reg(s, A, 1)).state.version == 1

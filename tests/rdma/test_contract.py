"""The RDMA contract: what every provider must do, run over every provider and topology."""

from __future__ import annotations

import errno
import os
import random
import time

import pytest

from blockfabric.rdma import CMEventType, QPState, WcFlags, WcOpcode, WcStatus, WrOpcode

from .harness import LOCAL, RW, recv_wr, wr

OK = WcStatus.SUCCESS
ERR = QPState.ERR
MiB = 1 << 20


# Where devices legitimately differ, the contract names the set real devices use; the soft
# provider's own (first) choice is pinned in test_soft.py.
# A SEND longer than the receive: soft, like the IBTA's NAK-Invalid-Request, REM_INV_REQ_ERR
# at the sender and LOC_LEN_ERR at the receiver; rxe reports REM_OP_ERR and LOC_QP_OP_ERR.
TOO_LONG_AT_SENDER = {WcStatus.REM_INV_REQ_ERR, WcStatus.REM_OP_ERR}
TOO_LONG_AT_RECEIVER = {WcStatus.LOC_LEN_ERR, WcStatus.LOC_QP_OP_ERR}
# A receive or send naming an lkey that does not exist: LOC_PROT_ERR (soft), LOC_QP_OP_ERR (rxe).
BAD_LKEY = {WcStatus.LOC_PROT_ERR, WcStatus.LOC_QP_OP_ERR}
# rdma_cm pads private data to the whole field: connect, accept, reject.
PRIVATE_DATA_FIELD = {"connect": 56, "accept": 196, "reject": 148}


def one(wcs: list[dict]) -> dict:
    assert len(wcs) == 1, wcs
    return wcs[0]


def assert_private_data(got: bytes, sent: bytes, field: str) -> None:
    """What was sent, then zeros: either exactly (soft) or padded to the field (rdma_cm)."""
    assert got[:len(sent)] == sent, (got.hex(), sent.hex())
    assert len(got) in (len(sent), PRIVATE_DATA_FIELD[field]), len(got)
    assert not any(got[len(sent):]), got.hex()


# ---------------------------------------------------------------------- connection management


@pytest.mark.parametrize("req_len,rep_len", [(0, 0), (32, 32), (56, 196), (1, 7)])
def test_private_data_in_connect_and_accept(world, req_len, rep_len):
    rng = random.Random(req_len * 1000 + rep_len)
    req, rep = rng.randbytes(req_len), rng.randbytes(rep_len)
    ends = world.connect(private_data=req, accept_data=rep)
    assert not isinstance(ends, dict), ends
    assert_private_data(bytes.fromhex(world.last_request["private_data"]), req, "connect")
    assert_private_data(world.last_reply, rep, "accept")


def test_reject_carries_private_data(world):
    result = world.connect(private_data=b"\x01" * 32, reject=True,
                           accept_data=bytes([0, 0, 4, 0]))
    assert list(result) == ["rejected"], result
    assert_private_data(bytes.fromhex(result["rejected"]), bytes([0, 0, 4, 0]), "reject")


def test_connect_private_data_over_56_bytes_is_einval(world):
    token = world.a.call("connect_start", address=world.address, port=1,
                         private_data=(b"x" * 57).hex())["token"]
    result = world.a.call("connect_wait", token=token)
    assert result.get("errno") == errno.EINVAL, result


def test_ipv6(world):
    address = world.address6 or os.environ.get("BLOCKFABRIC_TEST_ADDR6", "::1")
    ends = world.connect(private_data=b"v6", address=address)
    assert not isinstance(ends, dict), ends
    a, b = ends
    src, dst = a.reg(64, LOCAL, seed=6), b.reg(64, RW)
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [src.sge()], dst))
    assert one(a.poll())["status"] == OK
    assert b.digest(dst) == a.digest(src)


@pytest.mark.parametrize("who", ["active", "passive"])
@pytest.mark.parametrize("how", ["disconnect", "close"])
def test_disconnect_reaches_the_other_side(pair, who, how):
    a, b = pair
    leaver, stayer = (a, b) if who == "active" else (b, a)
    buf = stayer.reg(256, RW)
    stayer.recv(recv_wr(7, buf.sge(0, 128)), recv_wr(8, buf.sge(128, 128)))
    if how == "disconnect":
        leaver.disconnect()
        assert leaver.event() == CMEventType.DISCONNECTED
    else:
        leaver.agent.call("close", cid=leaver.cid)
    assert stayer.event() == CMEventType.DISCONNECTED
    assert stayer.state() == ERR
    flushed = stayer.poll("recv", n=2)
    assert [(w["wr_id"], w["status"]) for w in flushed] == [(7, WcStatus.WR_FLUSH_ERR),
                                                            (8, WcStatus.WR_FLUSH_ERR)]
    # posting to an ERR QP completes at once with a flush
    stayer.send(wr(WrOpcode.SEND, 9, [buf.sge(0, 8)]))
    assert one(stayer.poll())["status"] == WcStatus.WR_FLUSH_ERR


# ---------------------------------------------------------------------- memory registration


def test_mr_keys_unique_and_addresses_real(pair):
    a, _ = pair
    mrs = [a.reg(4096, access) for access in (LOCAL, RW, LOCAL | 4, RW)]
    mrs.append(a.reg(8192, RW, kind="mmap"))
    keys = [m.lkey for m in mrs] + [m.rkey for m in mrs]
    assert len(set(m.rkey for m in mrs)) == len(mrs)
    assert len(set(m.lkey for m in mrs)) == len(mrs)
    assert all(m.addr != 0 for m in mrs) and len(set(keys)) >= len(mrs)
    assert [m.access for m in mrs[:3]] == [LOCAL, RW, LOCAL | 4]
    assert mrs[-1].length == 8192


# ---------------------------------------------------------------------- SEND / RECV


def test_send_recv(pair):
    a, b = pair
    src, dst = a.reg(1000, LOCAL, seed=1), b.reg(4096, LOCAL)
    b.recv(recv_wr(5, dst.sge(0, 4096)))
    a.send(wr(WrOpcode.SEND, 6, [src.sge(0, 1000)]))
    send_wc, recv_wc = one(a.poll()), one(b.poll("recv"))
    assert (send_wc["wr_id"], send_wc["status"], send_wc["opcode"]) == (6, OK, WcOpcode.SEND)
    assert (recv_wc["wr_id"], recv_wc["status"], recv_wc["opcode"], recv_wc["byte_len"]) == \
        (5, OK, WcOpcode.RECV, 1000)
    assert b.read(dst, 0, 1000) == a.read(src, 0, 1000)
    assert b.read(dst, 1000, 16) == bytes(16)


def test_zero_length_send(pair):
    a, b = pair
    dst = b.reg(64, LOCAL)
    b.recv(recv_wr(1, dst.sge(0, 64)))
    a.send(wr(WrOpcode.SEND, 2, []))
    assert one(a.poll())["status"] == OK
    assert one(b.poll("recv"))["byte_len"] == 0


def test_send_gathers_and_recv_scatters(world):
    a, b = world.connect(cap_b={"max_recv_sge": 3})
    src = a.reg(300, LOCAL, seed=2)
    dst = b.reg(300, LOCAL)
    b.recv(recv_wr(1, dst.sge(0, 50), dst.sge(100, 50), dst.sge(200, 100)))
    a.send(wr(WrOpcode.SEND, 2, [src.sge(200, 100), src.sge(0, 100)]))
    assert one(a.poll())["status"] == OK
    assert one(b.poll("recv"))["byte_len"] == 200
    data = a.read(src, 200, 100) + a.read(src, 0, 100)
    assert b.read(dst, 0, 50) + b.read(dst, 100, 50) + b.read(dst, 200, 100) == data
    assert b.read(dst, 50, 50) == bytes(50)


def test_send_with_immediate(pair):
    a, b = pair
    src, dst = a.reg(64, LOCAL, seed=3), b.reg(256, RW)
    b.recv(recv_wr(1, dst.sge(0, 128)), recv_wr(2, dst.sge(128, 128)))
    a.send(wr(WrOpcode.SEND_WITH_IMM, 10, [src.sge(0, 16)], imm_data=0xDEADBEEF),
           wr(WrOpcode.SEND_WITH_IMM, 11, [src.sge(16, 16)], imm_data=7))
    assert [(w["wr_id"], w["status"]) for w in a.poll(n=2)] == [(10, OK), (11, OK)]
    got = b.poll("recv", n=2)
    assert [(w["wr_id"], w["status"], w["byte_len"], w["imm_data"]) for w in got] == \
        [(1, OK, 16, 0xDEADBEEF), (2, OK, 16, 7)]
    assert all(w["wc_flags"] & WcFlags.WITH_IMM for w in got)
    assert b.read(dst, 0, 16) + b.read(dst, 128, 16) == a.read(src, 0, 32)


def test_send_with_invalidate_naming_a_registered_mr(pair):
    """Real devices invalidate only MWs and fast-registered MRs (the interface makes neither):
    naming a reg_mr rkey fails the receive and the receiver's QP (rxe: REM_INV_REQ_ERR; the
    sender may still see SUCCESS, the ACK having gone first).  The soft provider reports the
    rkey and keeps the MR (pinned in test_soft.py).  Either way the receive says which."""
    a, b = pair
    src, dst = a.reg(64, LOCAL, seed=3), b.reg(256, RW)
    b.recv(recv_wr(1, dst.sge(0, 128)))
    a.send(wr(WrOpcode.SEND_WITH_INV, 10, [src.sge(0, 16)], invalidate_rkey=dst.rkey))
    assert one(a.poll())["status"] in (OK, WcStatus.REM_INV_REQ_ERR)
    inv = one(b.poll("recv"))
    assert inv["wr_id"] == 1
    if inv["status"] == OK:
        assert inv["wc_flags"] & WcFlags.WITH_INV and inv["invalidated_rkey"] == dst.rkey
        assert b.read(dst, 0, 16) == a.read(src, 0, 16)
    else:
        assert inv["status"] == WcStatus.REM_INV_REQ_ERR
        assert b.state() == ERR


def test_send_longer_than_recv_buffer(pair):
    a, b = pair
    src, dst = a.reg(200, LOCAL, seed=4), b.reg(200, LOCAL)
    b.recv(recv_wr(1, dst.sge(0, 100)), recv_wr(2, dst.sge(100, 100)))
    a.send(wr(WrOpcode.SEND, 3, [src.sge(0, 200)]))
    assert one(a.poll())["status"] in TOO_LONG_AT_SENDER
    got = b.poll("recv", n=2)
    assert [w["wr_id"] for w in got] == [1, 2]
    assert got[0]["status"] in TOO_LONG_AT_RECEIVER
    assert got[1]["status"] == WcStatus.WR_FLUSH_ERR
    assert a.state() == ERR and b.state() == ERR


def test_recv_with_bad_sge_is_a_local_error_at_the_receiver(pair):
    a, b = pair
    src, dst = a.reg(64, LOCAL, seed=5), b.reg(64, LOCAL)
    b.recv({"wr_id": 1, "sges": [{"addr": dst.addr, "length": 64, "lkey": dst.lkey ^ 0x5A5A00}]})
    a.send(wr(WrOpcode.SEND, 2, [src.sge()]))
    assert one(a.poll())["status"] == WcStatus.REM_OP_ERR
    assert one(b.poll("recv"))["status"] in BAD_LKEY
    assert b.state() == ERR


def test_rnr_recv_posted_late_succeeds(pair):
    a, b = pair
    src, dst = a.reg(512, LOCAL, seed=6), b.reg(512, LOCAL)
    a.send(wr(WrOpcode.SEND, 1, [src.sge()]), wr(WrOpcode.SEND, 2, [src.sge(0, 10)]))
    assert a.poll(timeout=0.3) == []          # held back by RNR, not failed
    b.recv(recv_wr(10, dst.sge()), recv_wr(11, dst.sge()))
    assert [(w["wr_id"], w["status"]) for w in a.poll(n=2)] == [(1, OK), (2, OK)]
    assert [(w["wr_id"], w["byte_len"]) for w in b.poll("recv", n=2)] == [(10, 512), (11, 10)]
    assert a.state() == QPState.RTS


def test_rnr_retry_exceeded(world):
    a, b = world.connect(rnr_retry=2)
    src, buf = a.reg(64, LOCAL, seed=7), a.reg(64, LOCAL)
    a.recv(recv_wr(20, buf.sge()))
    a.send(wr(WrOpcode.SEND, 1, [src.sge()]), wr(WrOpcode.SEND, 2, [src.sge()], flags=0))
    got = a.poll(n=2)
    assert [(w["wr_id"], w["status"]) for w in got] == [(1, WcStatus.RNR_RETRY_EXC_ERR),
                                                        (2, WcStatus.WR_FLUSH_ERR)]
    assert a.state() == ERR
    assert one(a.poll("recv"))["status"] == WcStatus.WR_FLUSH_ERR


# ---------------------------------------------------------------------- RDMA WRITE / READ


@pytest.mark.parametrize("size", [1, 4095, 65536 + 3, 16 * MiB])
def test_write_and_read_sizes(pair, size):
    a, b = pair
    src, back = a.reg(size, LOCAL, seed=size), a.reg(size, LOCAL)
    dst = b.reg(size + 8, RW, seed=99)
    before = b.read(dst, 0, 4) + b.read(dst, size + 4, 4)
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [src.sge()], dst, off=4))
    w = one(a.poll(timeout=20))
    assert (w["status"], w["opcode"]) == (OK, WcOpcode.RDMA_WRITE)
    assert b.digest(dst, 4, size) == a.digest(src)
    assert b.read(dst, 0, 4) + b.read(dst, size + 4, 4) == before   # nothing outside
    a.send(wr(WrOpcode.RDMA_READ, 2, [back.sge()], dst, off=4))
    r = one(a.poll(timeout=20))
    assert (r["status"], r["opcode"], r["byte_len"]) == (OK, WcOpcode.RDMA_READ, size)
    assert a.digest(back) == a.digest(src)


def test_multi_sge_write_and_read(world):
    a, b = world.connect(cap_a={"max_send_sge": 4})
    src, back = a.reg(4000, LOCAL, seed=11), a.reg(4000, LOCAL)
    dst = b.reg(4000, RW)
    pieces = [(3000, 1000), (0, 1000), (2000, 1000), (1000, 1000)]
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [src.sge(o, n) for o, n in pieces], dst))
    assert one(a.poll())["status"] == OK
    expect = b"".join(a.read(src, o, n) for o, n in pieces)
    assert b.read(dst, 0, 4000) == expect
    a.send(wr(WrOpcode.RDMA_READ, 2, [back.sge(o, n) for o, n in pieces], dst))
    assert one(a.poll())["status"] == OK
    assert a.digest(back) == a.digest(src)


def test_write_with_immediate_consumes_a_receive(pair):
    a, b = pair
    src, dst, rbuf = a.reg(100, LOCAL, seed=12), b.reg(100, RW), b.reg(16, LOCAL)
    b.recv(recv_wr(3, rbuf.sge()))
    a.send(wr(WrOpcode.RDMA_WRITE_WITH_IMM, 1, [src.sge()], dst, imm_data=77))
    assert one(a.poll())["status"] == OK
    w = one(b.poll("recv"))
    assert (w["wr_id"], w["opcode"], w["imm_data"], w["byte_len"]) == \
        (3, WcOpcode.RECV_RDMA_WITH_IMM, 77, 100)
    assert b.digest(dst) == a.digest(src)


def test_write_with_immediate_waits_out_rnr(pair):
    """No receive posted yet: the responder answers RNR NAK, and the WRITE with immediate
    is retried until one is (the soft provider read the flags from the wrong header byte
    and cut the connection: "RNR NAK for PSN 0, which consumes no receive")."""
    a, b = pair
    src, dst, rbuf = a.reg(100, LOCAL, seed=13), b.reg(100, RW), b.reg(16, LOCAL)
    a.send(wr(WrOpcode.RDMA_WRITE_WITH_IMM, 1, [src.sge()], dst, imm_data=78))
    assert a.poll(timeout=0.3) == []          # held back by RNR, not failed
    b.recv(recv_wr(4, rbuf.sge()))
    assert one(a.poll())["status"] == OK
    w = one(b.poll("recv"))
    assert (w["wr_id"], w["opcode"], w["imm_data"]) == (4, WcOpcode.RECV_RDMA_WITH_IMM, 78)
    assert b.digest(dst) == a.digest(src)
    assert a.state() == QPState.RTS and b.state() == QPState.RTS


def test_write_then_send_data_visible_at_recv(pair):
    a, b = pair
    src, dst = a.reg(MiB, LOCAL, seed=13), b.reg(MiB, RW)
    msg, rbuf = a.reg(64, LOCAL, seed=14), b.reg(64, LOCAL)
    for round_ in range(3):
        a.fill(src, 100 + round_)
        b.recv(recv_wr(round_, rbuf.sge()))
        a.send(wr(WrOpcode.RDMA_WRITE, 0, [src.sge()], dst, flags=0),
               wr(WrOpcode.SEND, 1, [msg.sge()], flags=0))
        assert one(b.poll("recv"))["status"] == OK
        assert b.digest(dst) == a.digest(src)        # checked at once, before anything else
    assert a.poll(timeout=0.2) == []                 # all unsignaled: no completions


def test_signaled_and_unsignaled(world):
    a, b = world.connect()
    src, dst = a.reg(64, LOCAL, seed=15), b.reg(64, RW)
    a.send(*(wr(WrOpcode.RDMA_WRITE, i, [src.sge()], dst, flags=0) for i in range(5)),
           wr(WrOpcode.RDMA_WRITE, 5, [src.sge()], dst))
    assert [w["wr_id"] for w in a.poll(n=6, timeout=0.3)] == [5]
    a2, b2 = world.connect(sig_all=True)
    src2, dst2 = a2.reg(64, LOCAL, seed=15), b2.reg(64, RW)
    a2.send(*(wr(WrOpcode.RDMA_WRITE, i, [src2.sge()], dst2, flags=0) for i in range(3)))
    assert [w["wr_id"] for w in a2.poll(n=3)] == [0, 1, 2]


def test_queue_depth_and_sge_limits(world):
    a, b = world.connect(cap_a={"max_send_wr": 4, "max_recv_wr": 2, "max_send_sge": 2})
    src, dst = a.reg(64, LOCAL, seed=16), b.reg(64, RW)
    writes = [wr(WrOpcode.RDMA_WRITE, i, [src.sge()], dst) for i in range(5)]
    assert a.send(*writes).get("errno") == errno.ENOMEM
    assert a.recv(*[recv_wr(i, src.sge()) for i in range(3)]).get("errno") == errno.ENOMEM
    three = wr(WrOpcode.RDMA_WRITE, 9, [src.sge(0, 8)] * 3, dst)
    assert a.send(three).get("errno") == errno.EINVAL
    assert a.recv(recv_wr(1, src.sge(0, 8), src.sge(8, 8))).get("errno") == errno.EINVAL
    assert a.send(*writes[:4]) == {"ok": True}       # nothing was posted by the failures
    assert [w["wr_id"] for w in a.poll(n=4)] == [0, 1, 2, 3]


# ---------------------------------------------------------------------- errors


def test_local_protection_error(pair):
    a, b = pair
    src, dst = a.reg(64, LOCAL, seed=17), b.reg(64, RW)
    bad = {"addr": src.addr, "length": 64, "lkey": src.lkey ^ 0x100}
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [src.sge()], dst),
           wr(WrOpcode.RDMA_WRITE, 2, [bad], dst),
           wr(WrOpcode.RDMA_WRITE, 3, [src.sge()], dst))
    got = a.poll(n=3)
    assert [w["wr_id"] for w in got] == [1, 2, 3]
    assert got[0]["status"] == OK and got[1]["status"] in BAD_LKEY
    assert got[2]["status"] == WcStatus.WR_FLUSH_ERR
    assert a.state() == ERR


def test_nothing_after_a_local_error_reaches_the_wire(pair):
    """A WR that fails its local checks behind one still in flight: the QP goes to ERR when
    it is reached, and no WR posted after it, in the same post or a later one, goes out (an
    HCA processes the send queue in order and stops at the error).  The WRITE in front is
    large so that it is still unacknowledged when the next post comes; it completes either
    way (SUCCESS when its ACK came first, else flushed)."""
    a, b = pair
    big, far = a.reg(64 * MiB, LOCAL, seed=30), b.reg(64 * MiB, RW)
    msg, rbuf = a.reg(64, LOCAL, seed=31), b.reg(64, LOCAL)
    b.recv(recv_wr(50, rbuf.sge()))
    bad = {"addr": msg.addr, "length": 64, "lkey": msg.lkey ^ 0x100}
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [big.sge()], far),
           wr(WrOpcode.SEND, 2, [bad]))
    a.send(wr(WrOpcode.SEND, 3, [msg.sge()]))
    got = a.poll(n=3, timeout=10)
    assert [w["wr_id"] for w in got] == [1, 2, 3], got
    assert got[0]["status"] in (OK, WcStatus.WR_FLUSH_ERR)
    assert got[1]["status"] in BAD_LKEY | {WcStatus.WR_FLUSH_ERR}
    assert got[2]["status"] == WcStatus.WR_FLUSH_ERR
    assert a.state() == ERR
    assert b.poll("recv", timeout=0.5) == []         # the SEND behind the error never came
    assert b.read(rbuf, 0, 64) == bytes(64)


@pytest.mark.parametrize("case", ["past_end", "before_start", "read_into_readonly"])
def test_local_bounds_and_access(world, case):
    a, b = world.connect()
    src, dst = a.reg(64, LOCAL, seed=18), b.reg(64, RW)
    if case == "past_end":
        sge, op = {"addr": src.addr + 1, "length": 64, "lkey": src.lkey}, WrOpcode.RDMA_WRITE
    elif case == "before_start":
        sge, op = {"addr": src.addr - 1, "length": 8, "lkey": src.lkey}, WrOpcode.RDMA_WRITE
    else:
        ro = a.reg(64, 0)
        sge, op = {"addr": ro.addr, "length": 64, "lkey": ro.lkey}, WrOpcode.RDMA_READ
    a.send(wr(op, 1, [sge], dst, flags=0))           # fails even unsignaled
    assert one(a.poll())["status"] == WcStatus.LOC_PROT_ERR
    assert a.state() == ERR


MALICE = {
    "forged_rkey_write": (WrOpcode.RDMA_WRITE, RW, lambda m: (m.addr, m.rkey ^ 0x1000)),
    "guessed_rkey_write": (WrOpcode.RDMA_WRITE, RW, lambda m: (m.addr, (m.rkey + 1) & 0xFFFFFFFF)),
    "past_end_write": (WrOpcode.RDMA_WRITE, RW, lambda m: (m.addr + m.length - 32, m.rkey)),
    "before_start_write": (WrOpcode.RDMA_WRITE, RW, lambda m: (m.addr - 1, m.rkey)),
    "no_remote_write": (WrOpcode.RDMA_WRITE, LOCAL | 4, lambda m: (m.addr, m.rkey)),
    "forged_rkey_read": (WrOpcode.RDMA_READ, RW, lambda m: (m.addr, m.rkey ^ 0x1000)),
    "past_end_read": (WrOpcode.RDMA_READ, RW, lambda m: (m.addr + m.length - 63, m.rkey)),
    "no_remote_read": (WrOpcode.RDMA_READ, LOCAL | 2, lambda m: (m.addr, m.rkey)),
    "local_only_read": (WrOpcode.RDMA_READ, LOCAL, lambda m: (m.addr, m.rkey)),
}


@pytest.mark.parametrize("case", sorted(MALICE))
def test_malicious_peer_gets_remote_access_error(pair, case):
    """A peer naming memory it may not touch: REM_ACCESS_ERR, both QPs to ERR, flushes, and
    the target's bytes unchanged, byte for byte."""
    op, access, aim = MALICE[case]
    a, b = pair
    victim = b.reg(4096, access, seed=19)
    other = b.reg(4096, RW, seed=20)                 # its neighbour must be untouched too
    before = (b.digest(victim), b.digest(other))
    rbuf = b.reg(64, LOCAL)
    b.recv(recv_wr(40, rbuf.sge()))
    attack = a.reg(64, LOCAL, seed=21)
    loot = a.reg(64, LOCAL, seed=22)
    loot_before = a.digest(loot)
    addr, rkey = aim(victim)
    a.send(wr(op, 1, [(loot if op == WrOpcode.RDMA_READ else attack).sge()],
              remote_addr=addr, rkey=rkey, flags=0),
           wr(WrOpcode.SEND, 2, [attack.sge(0, 8)]))
    got = a.poll(n=2)
    assert [(w["wr_id"], w["status"]) for w in got] == [(1, WcStatus.REM_ACCESS_ERR),
                                                        (2, WcStatus.WR_FLUSH_ERR)]
    assert a.state() == ERR
    assert b.state() == ERR
    assert one(b.poll("recv"))["status"] == WcStatus.WR_FLUSH_ERR
    assert (b.digest(victim), b.digest(other)) == before
    assert a.digest(loot) == loot_before             # a failed READ brings nothing back


def test_deregistered_mr_is_no_longer_reachable(pair):
    a, b = pair
    src, dst = a.reg(64, LOCAL, seed=23), b.reg(64, RW)
    b.dereg(dst)
    a.send(wr(WrOpcode.RDMA_WRITE, 1, [src.sge()], dst))
    assert one(a.poll())["status"] == WcStatus.REM_ACCESS_ERR


def test_many_outstanding_in_order(pair):
    a, b = pair
    src, dst = a.reg(64 * 100, LOCAL, seed=24), b.reg(64 * 100, RW)
    rbuf = b.reg(64 * 32, LOCAL)
    b.recv(*[recv_wr(100 + i, rbuf.sge(64 * i, 64)) for i in range(32)])
    chain = []
    for i in range(64):
        op = WrOpcode.SEND if i % 2 else WrOpcode.RDMA_WRITE
        chain.append(wr(op, i, [src.sge(64 * i, 64)], dst if op == WrOpcode.RDMA_WRITE else None,
                        off=64 * i))
    t0 = time.monotonic()
    a.send(*chain)
    assert [w["wr_id"] for w in a.poll(n=64)] == list(range(64))
    assert [w["wr_id"] for w in b.poll("recv", n=32)] == [100 + i for i in range(32)]
    assert time.monotonic() - t0 < 5

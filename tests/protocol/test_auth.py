"""DH-HMAC-CHAP: the Authentication Send/Receive commands and the messages at the kernel's
offsets (include/linux/nvme.h), round trips, the secret format, the ffdhe2048 constant, the
computations by their definition, and the two state machines against each other."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
import zlib
from decimal import ROUND_FLOOR, Decimal, getcontext

import pytest
from hypothesis import given, strategies as st

from blockfabric.protocol import auth as A
from tests.protocol.helpers import FAST, check_command, check_wire, sqe_bytes
from tests.protocol.strategies import packed_strategy

HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
SUB = "nqn.2026-12.io.blockfabric:ram0"
KEY = bytes(range(32))


# ------------------------------------------------------------------ commands (SQE @40..47)

def test_auth_send_and_receive_commands() -> None:
    raw = sqe_bytes(0x7F, cid=4, nsid=0x05, dwords={41: ("B", 1), 42: ("B", 1),
                                                     43: ("B", 0xE9), 44: ("I", 72)})
    check_command(A.AuthSend(tl=72), raw, cid=4)
    raw = sqe_bytes(0x7F, cid=5, nsid=0x06, dwords={41: ("B", 1), 42: ("B", 1),
                                                     43: ("B", 0xE9), 44: ("I", 4096)})
    check_command(A.AuthReceive(al=4096), raw, cid=5)


# ------------------------------------------------------------------ messages


def test_negotiate_golden() -> None:
    """What the Linux host sends: 3 hashes, 6 DH groups, NULL first at idlist[30]."""
    buf = bytearray(72)
    # auth_type, auth_id, reserved, t_id, sc_c, napd
    struct.pack_into("<BBHHBB", buf, 0, 0x00, 0x00, 0, 0x1234, 0, 1)
    struct.pack_into("<BBBB", buf, 8, 0x01, 0, 3, 6)  # authid, rsvd, halen, dhlen
    buf[12:15] = bytes([1, 2, 3])  # idlist[0..2]
    buf[42:48] = bytes([0, 1, 2, 3, 4, 5])  # idlist[30..35]
    neg = A.Negotiate.offer(0x1234, (1, 2, 3), (0, 1, 2, 3, 4, 5))
    check_wire(neg, buf)
    assert neg.hash_ids == (1, 2, 3) and neg.dh_groups == (0, 1, 2, 3, 4, 5)


def test_challenge_golden() -> None:
    c1 = bytes(range(100, 132))
    head = bytearray(16)
    struct.pack_into("<BBHHBBBBHI", head, 0, 0x01, 0x01, 0, 7, 32, 0, 0x01, 0x00, 0,
                     0xA1B2C3D4)  # type, id, rsvd, t_id, hl, rsvd, hashid, dhgid, dhvlen, seq
    check_wire(A.ChallengeHeader(t_id=7, hl=32, hashid=1, dhgid=0, dhvlen=0,
                                 seqnum=0xA1B2C3D4), head)
    msg = A.Challenge(7, 1, 0xA1B2C3D4, c1)
    assert msg.pack() == bytes(head) + c1
    assert A.Challenge.unpack(bytes(head) + c1 + bytes(100)) == msg


def test_reply_golden() -> None:
    r1, c2, dhv = b"R" * 48, b"C" * 48, b"\x05" * 256
    head = bytearray(16)
    struct.pack_into("<BBHHBBBBHI", head, 0, 0x01, 0x02, 0, 9, 48, 0, 1, 0, 256, 77)
    check_wire(A.ReplyHeader(t_id=9, hl=48, cvalid=1, dhvlen=256, seqnum=77), head)
    msg = A.Reply(9, r1, 77, c2, dhv)
    assert msg.pack() == bytes(head) + r1 + c2 + dhv
    assert A.Reply.unpack(msg.pack()) == msg
    # no C2: the field is still there, zero, and cvalid 0
    plain = A.Reply(9, r1).pack()
    assert plain[8] == 0 and plain[16 + 48:16 + 96] == bytes(48) and len(plain) == 16 + 96


def test_success_and_failure_golden() -> None:
    s1 = bytearray(16)
    struct.pack_into("<BBHHBBB", s1, 0, 0x01, 0x03, 0, 2, 64, 0, 1)
    check_wire(A.Success1Header(t_id=2, hl=64, rvalid=1), s1)
    assert A.Success1.unpack(bytes(s1) + b"r" * 64) == A.Success1(2, 64, b"r" * 64)
    s2 = bytearray(16)
    struct.pack_into("<BBHH", s2, 0, 0x01, 0x04, 0, 2)
    check_wire(A.Success2(t_id=2), s2)
    f1 = bytes([0x00, 0xF1, 0, 0, 2, 0, 0x01, 0x06])
    check_wire(A.Failure(auth_id=A.AuthMsg.FAILURE1, t_id=2,
                         rescode_exp=A.Explanation.INCORRECT_PAYLOAD), f1)
    f2 = bytes([0x00, 0xF0, 0, 0, 2, 0, 0x01, 0x01])
    check_wire(A.Failure(auth_id=A.AuthMsg.FAILURE2, t_id=2), f2)
    assert A.failure_of(f1 + bytes(50)).rescode_exp == 6
    assert A.failure_of(bytes(s2)) is None


@pytest.mark.parametrize("cls", [A.Negotiate, A.ChallengeHeader, A.ReplyHeader,
                                 A.Success1Header, A.Success2, A.Failure],
                         ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_message_header_roundtrip(cls, data: st.DataObject) -> None:
    obj = data.draw(packed_strategy(cls))
    assert cls.unpack_from(obj.pack()) == obj


@FAST
@given(hl=st.sampled_from([32, 48, 64]), t_id=st.integers(0, 0xFFFF),
       seq=st.integers(0, 0xFFFFFFFF), dh=st.booleans(), cvalid=st.booleans(),
       data=st.data())
def test_variable_messages_roundtrip(hl, t_id, seq, dh, cvalid, data) -> None:
    blob = data.draw(st.binary(min_size=hl, max_size=hl))
    dhv = data.draw(st.binary(min_size=1, max_size=300)) if dh else b""
    chal = A.Challenge(t_id, 1, seq, blob, 1 if dh else 0, dhv)
    assert A.Challenge.unpack(chal.pack()) == chal
    reply = A.Reply(t_id, blob, seq if cvalid else 0, blob[::-1] if cvalid else b"", dhv)
    assert A.Reply.unpack(reply.pack()) == reply
    ok = A.Success1(t_id, hl, blob if cvalid else b"")
    assert A.Success1.unpack(ok.pack()) == ok


def test_truncated_messages_are_incorrect_payload() -> None:
    full = A.Challenge(1, 1, 5, bytes(32)).pack()
    with pytest.raises(A.AuthError) as err:
        A.Challenge.unpack(full[:40])
    assert err.value.explanation == A.Explanation.INCORRECT_PAYLOAD
    with pytest.raises(A.AuthError) as err:
        A.Reply.unpack(full)  # a Challenge where a Reply was due
    assert err.value.explanation == A.Explanation.INCORRECT_MESSAGE


# ------------------------------------------------------------------ secrets


def _secret_text(key: bytes, transform: int) -> str:
    """The representation, built from its definition (nvme gen-dhchap-key's output)."""
    blob = key + struct.pack("<I", zlib.crc32(key))
    return f"DHHC-1:{transform:02d}:{base64.b64encode(blob).decode()}:"


@pytest.mark.parametrize("length,transform", [(32, 0), (32, 1), (48, 2), (64, 3)])
def test_secret_parse_and_format(length: int, transform: int) -> None:
    key = bytes(range(length))
    text = _secret_text(key, transform)
    secret = A.Secret.parse(text)
    assert (secret.key, secret.transform) == (key, transform)
    assert str(secret) == text
    assert A.Secret.parse(text[:-1]) == secret      # the kernel does not need the last ':'
    assert key.hex() not in repr(secret) and "key" not in repr(secret)


@pytest.mark.parametrize("text,message", [
    ("DHHC-2:00:AAAA:", "starts with"),
    ("DHHC-1:0x:AAAA:", "two digits"),
    ("DHHC-1:04:" + _secret_text(KEY, 0)[10:], "not 00, 01, 02 or 03"),
    ("DHHC-1:00:not*base64:", "base64"),
    (_secret_text(bytes(31), 0), "32, 48 or 64"),
    (_secret_text(KEY, 0)[:12] + ("B" if _secret_text(KEY, 0)[12] != "B" else "C")
     + _secret_text(KEY, 0)[13:], "CRC"),
])
def test_bad_secrets_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        A.Secret.parse(text)


def test_generated_secrets_parse_back() -> None:
    for length, transform in [(32, 1), (48, 2), (64, 0)]:
        secret = A.generate_secret(length, transform)
        assert A.Secret.parse(str(secret)) == secret and len(secret.key) == length
    assert A.generate_secret().key != A.generate_secret().key
    with pytest.raises(ValueError):
        A.generate_secret(33)


def test_key_transform_definition() -> None:
    assert A.Secret(KEY, 0).transformed(HOST) == KEY
    for hid, name in [(1, "sha256"), (2, "sha384"), (3, "sha512")]:
        expect = hmac.new(KEY, HOST.encode() + b"NVMe-over-Fabrics", name).digest()
        assert A.Secret(KEY, hid).transformed(HOST) == expect
    assert A.Secret(KEY, 1).transformed(HOST) != A.Secret(KEY, 1).transformed(SUB)


def test_responses_by_definition() -> None:
    c = bytes(range(32))
    expect = hmac.new(KEY, c + struct.pack("<I", 0x01020304) + struct.pack("<H", 0x0506)
                      + b"\0" + b"HostHost" + HOST.encode() + b"\0" + SUB.encode(),
                      "sha256").digest()
    assert A.host_response(1, KEY, c, 0x01020304, 0x0506, HOST, SUB) == expect
    expect = hmac.new(KEY, c + struct.pack("<IH", 9, 1) + b"\0" + b"Controller"
                      + SUB.encode() + b"\0" + HOST.encode(), "sha384").digest()
    assert A.controller_response(2, KEY, c, 9, 1, SUB, HOST) == expect
    skey = b"\x07" * 256
    assert A.augmented_challenge(1, skey, c) == hmac.new(
        hashlib.sha256(skey).digest(), c, "sha256").digest()


# ------------------------------------------------------------------ ffdhe2048


def _probably_prime(n: int) -> bool:
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def test_ffdhe2048_is_rfc7919s_safe_prime() -> None:
    getcontext().prec = 700
    e, term = Decimal(0), Decimal(1)
    for k in range(1, 400):
        e += term
        term /= k
    v = int((Decimal(2) ** 1918 * e).to_integral_value(rounding=ROUND_FLOOR))
    assert A.FFDHE2048_P == 2 ** 2048 - 2 ** 1984 + (v + 560316) * 2 ** 64 - 1
    assert _probably_prime(A.FFDHE2048_P) and _probably_prime((A.FFDHE2048_P - 1) // 2)


def test_dh_agrees_and_refuses_degenerate_values() -> None:
    a, pub_a = A.dh_keypair(A.DhGroup.FFDHE2048)
    b, pub_b = A.dh_keypair(A.DhGroup.FFDHE2048)
    assert len(pub_a) == 256
    assert A.dh_shared(1, a, pub_b) == A.dh_shared(1, b, pub_a)
    for bad in (1, A.FFDHE2048_P - 1, 0):
        with pytest.raises(A.AuthError):
            A.dh_shared(1, a, bad.to_bytes(256, "big"))
    with pytest.raises(A.AuthError):
        A.dh_shared(1, a, pub_b[1:])


# ------------------------------------------------------------------ the two sides together


def _policy(**kw) -> A.AuthPolicy:
    return A.AuthPolicy(A.Secret(KEY, 1), **kw)


@pytest.mark.parametrize("dhgroup", [A.DhGroup.NULL, A.DhGroup.FFDHE2048])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("hash_id", [1, 3])
def test_host_and_controller_agree(dhgroup, bidirectional, hash_id) -> None:
    ctrl_secret = A.generate_secret(48, 2)
    target = A.TargetAuth(_policy(ctrl_secret=ctrl_secret, dhgroup=dhgroup, hash_id=hash_id),
                          HOST, SUB)
    assert not target.authenticated
    result = A.host_authenticate(target.send, target.receive, t_id=1, hostnqn=HOST,
                                 subnqn=SUB, secret=A.Secret(KEY, 1),
                                 ctrl_secret=ctrl_secret if bidirectional else None)
    assert target.authenticated and not target.fatal
    assert result == A.AuthResult(hash_id, dhgroup, bidirectional)


def test_reauthentication_keeps_the_queue_working_until_it_fails() -> None:
    target = A.TargetAuth(_policy(), HOST, SUB)
    for t_id in (1, 2):
        A.host_authenticate(target.send, target.receive, t_id=t_id, hostnqn=HOST, subnqn=SUB,
                            secret=A.Secret(KEY, 1))
        assert target.authenticated and not target.fatal
    target.send(A.Negotiate.offer(3, (1,), (0,)).pack())
    assert target.authenticated                  # mid-transaction: still the old proof
    target.receive(4096)
    target.send(A.Reply(3, bytes(32)).pack())
    target.receive(4096)
    assert target.fatal and not target.authenticated


def test_wrong_host_secret_fails_with_failure1_and_is_fatal() -> None:
    target = A.TargetAuth(_policy(), HOST, SUB)
    with pytest.raises(A.AuthError, match="refused authentication"):
        A.host_authenticate(target.send, target.receive, t_id=1, hostnqn=HOST, subnqn=SUB,
                            secret=A.generate_secret())
    assert not target.authenticated and target.fatal


def test_same_key_other_nqn_fails() -> None:
    """The transform binds the key to the NQN: a host cannot reuse another's key as is."""
    target = A.TargetAuth(_policy(), HOST, SUB)
    with pytest.raises(A.AuthError):
        A.host_authenticate(target.send, target.receive, t_id=1, hostnqn=HOST + "x",
                            subnqn=SUB, secret=A.Secret(KEY, 1))
    assert target.fatal


def test_controller_without_the_ctrl_secret_is_caught_by_the_host() -> None:
    target = A.TargetAuth(_policy(ctrl_secret=A.generate_secret()), HOST, SUB)
    sent: list[bytes] = []

    def send(msg: bytes) -> None:
        sent.append(msg)
        target.send(msg)

    with pytest.raises(A.AuthError, match="controller's response does not match"):
        A.host_authenticate(send, target.receive, t_id=1, hostnqn=HOST, subnqn=SUB,
                            secret=A.Secret(KEY, 1), ctrl_secret=A.generate_secret())
    assert A.failure_of(sent[-1]).auth_id == A.AuthMsg.FAILURE2
    assert target.fatal and not target.authenticated


def test_replayed_reply_fails() -> None:
    """A Reply recorded from one transaction does not answer the next one's challenge."""
    recorded: list[bytes] = []
    first = A.TargetAuth(_policy(), HOST, SUB)

    def record(msg: bytes) -> None:
        recorded.append(msg)
        first.send(msg)

    A.host_authenticate(record, first.receive, t_id=1, hostnqn=HOST, subnqn=SUB,
                        secret=A.Secret(KEY, 1))
    second = A.TargetAuth(_policy(), HOST, SUB)
    second.send(recorded[0])                     # Negotiate
    second.receive(4096)                         # a fresh challenge
    second.send(recorded[1])                     # the old Reply
    answer = second.receive(4096)
    assert A.failure_of(answer).rescode_exp == A.Explanation.FAILED
    assert second.fatal and not second.authenticated


def test_out_of_order_and_mismatched_transactions() -> None:
    target = A.TargetAuth(_policy(), HOST, SUB)
    target.send(A.Reply(1, bytes(32)).pack())   # a Reply before any Negotiate
    assert target.fatal and not target.authenticated
    target = A.TargetAuth(_policy(), HOST, SUB)
    target.send(A.Negotiate.offer(5, (1,), (0,)).pack())
    target.receive(4096)
    target.send(A.Reply(6, bytes(32)).pack())   # wrong transaction id
    assert A.failure_of(target.receive(4096)).rescode_exp == A.Explanation.INCORRECT_PAYLOAD
    assert target.fatal


def test_short_allocation_length_leaves_the_transaction_where_it_was() -> None:
    target = A.TargetAuth(_policy(dhgroup=A.DhGroup.FFDHE2048), HOST, SUB)
    target.send(A.Negotiate.offer(4, (1,), (0, 1)).pack())
    with pytest.raises(A.AuthError, match="allocation length 100, the message is 304"):
        target.receive(100)                       # 16 + 32 + 256 needed
    assert target.step == A.AuthMsg.CHALLENGE and not target.fatal
    chal = A.Challenge.unpack(target.receive(4096))
    assert len(chal.c1) == 32 and len(chal.dh_value) == 256


def test_negotiation_without_common_ground() -> None:
    target = A.TargetAuth(_policy(dhgroup=A.DhGroup.FFDHE2048), HOST, SUB)
    target.send(A.Negotiate.offer(1, (1,), (0,)).pack())  # the host offers only NULL
    assert A.failure_of(target.receive(4096)).rescode_exp == A.Explanation.DHGROUP_UNUSABLE
    target = A.TargetAuth(_policy(), HOST, SUB)
    target.send(A.Negotiate.offer(1, (9,), (0,)).pack())
    assert A.failure_of(target.receive(4096)).rescode_exp == A.Explanation.HASH_UNUSABLE
    target = A.TargetAuth(_policy(hash_id=3), HOST, SUB)  # falls back to the host's first
    target.send(A.Negotiate.offer(1, (2, 1), (0,)).pack())
    assert A.Challenge.unpack(target.receive(4096)).hashid == 2


_messages = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda t, h, d: A.Negotiate.offer(t, h, d).pack(), st.integers(0, 0xFFFF),
              st.lists(st.integers(0, 5), max_size=4).map(tuple),
              st.lists(st.integers(0, 5), max_size=6).map(tuple)),
    st.builds(lambda t, r, dh: A.Reply(t, r, dh_value=dh).pack(), st.integers(0, 3),
              st.binary(min_size=32, max_size=32), st.binary(max_size=260)),
    st.builds(lambda t, i: A.Failure(auth_id=i, t_id=t).pack(), st.integers(0, 3),
              st.sampled_from([0xF0, 0xF1, 0x04])),
    st.builds(lambda t: A.Success2(t_id=t).pack(), st.integers(0, 3)))


@FAST
@given(steps=st.lists(st.tuples(st.booleans(), _messages, st.integers(1, 5000)), max_size=8),
       dhgroup=st.sampled_from([A.DhGroup.NULL, A.DhGroup.FFDHE2048]))
def test_hostile_message_streams_never_authenticate_or_crash(steps, dhgroup) -> None:
    """Whatever a host without the key sends, in any order: only AuthError escapes (for a
    short allocation length), and the queue is never authenticated."""
    target = A.TargetAuth(_policy(dhgroup=dhgroup), HOST, SUB)
    for is_send, message, al in steps:
        if is_send:
            target.send(message)
        else:
            try:
                assert len(target.receive(al)) == al
            except A.AuthError:
                pass
        assert not target.authenticated


# ------------------------------------------------------------------ a failed exchange is over


def _wrong_reply(target: A.TargetAuth, t_id: int = 1) -> None:
    target.send(A.Negotiate.offer(t_id, (1,), (0,)).pack())
    target.receive(4096)
    target.send(A.Reply(t_id, bytes(32)).pack())


def test_wrong_reply_fails_at_once() -> None:
    target = A.TargetAuth(_policy(), HOST, SUB)
    _wrong_reply(target)
    assert target.failed and not target.authenticated
    assert "does not match" in target.reason


@pytest.mark.parametrize("then", ["negotiate", "reply", "failure2", "garbage"])
def test_nothing_but_fetching_failure1_follows_a_wrong_reply(then: str) -> None:
    """The attack of issue 13: wrong answer, Negotiate again, wrong answer ... on one
    queue.  After the first, any message makes the end immediate (fatal)."""
    target = A.TargetAuth(_policy(), HOST, SUB)
    _wrong_reply(target)
    assert not target.fatal                     # Failure1 still to be fetched
    message = {"negotiate": A.Negotiate.offer(2, (1,), (0,)).pack(),
               "reply": A.Reply(1, bytes(32)).pack(),
               "failure2": A.Failure(auth_id=A.AuthMsg.FAILURE2, t_id=1).pack(),
               "garbage": b"\xff" * 8}[then]
    target.send(message)
    assert target.fatal and target.failed and not target.authenticated
    assert A.failure_of(target.receive(4096)) is not None

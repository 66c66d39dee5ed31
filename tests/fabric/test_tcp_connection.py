"""The NVMe/TCP connection's receive path over a real socket pair: PDUs cut anywhere by the
stream arrive whole and in order, through a staging buffer that grows for a large PDU (with
earlier PDUs of the same read still in it) and never for one whose header is refused, and
grows (bounded) when receives keep filling it; what the PDUs of one receive send goes out in
one ``sendmsg``; the reactor's busy-poll receives only while an answer is due."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.tcp import (IOV_MAX, STAGING_MAX, STAGING_START, PduConnection,
                                    local_pd, resolve)
from blockfabric.protocol import tcp_pdu


class Recorder(PduConnection):
    def __init__(self, sock) -> None:
        super().__init__(sock, "test")
        self.got: list[tuple[int, bytes]] = []
        self.lost: str | None = None
        self.negotiated(False, True, 8192, 256 << 10, 0, 0)

    def on_pdu(self, ptype, flags, pdu, pdo, dlen) -> None:
        self.got.append((ptype, bytes(pdu[pdo:pdo + dlen]) if dlen else bytes(pdu[8:72])))

    def on_lost(self, reason: str) -> None:
        self.lost = reason
        self.close()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def h2c(payload: bytes, offset: int = 0) -> bytes:
    return bytes(tcp_pdu.data_header(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 1, 0, offset,
                                     len(payload), False, True)) \
        + payload + tcp_pdu.pack_digest(tcp_pdu.digest(payload))


def drain(conn: Recorder, rounds: int = 1000) -> None:
    for _ in range(rounds):
        before = state(conn)
        conn.on_readable()
        if conn.closed or state(conn) == before:
            return


def feed(a, conn: Recorder, stream: bytes, rng, cuts: tuple) -> None:
    """Send ``stream`` in pieces of the sizes ``cuts`` (at random), draining after each."""
    pos = 0
    while pos < len(stream):
        n = rng.choice(cuts)
        a.sendall(stream[pos:pos + n])
        pos += n
        drain(conn)


def state(conn: Recorder) -> tuple:
    """What a receive changes: PDUs handled, bytes staged, bytes placed straight."""
    return len(conn.got), conn._filled, conn._direct[4] if conn._direct else None


def test_pdus_cut_anywhere_arrive_whole_and_in_order():
    rng = random.Random(5)
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        stream, want = b"", []
        for i in range(40):
            if i % 3:
                sqe = bytes([i]) * 64
                stream += bytes(tcp_pdu.capsule_cmd_header(sqe, 0, False, True))
                want.append((tcp_pdu.CAPSULE_CMD, sqe))
            else:       # some small, some larger than the staging buffer's start
                data = rng.randbytes(rng.choice((16, 3000, 70000, 200000)))
                stream += h2c(data)
                want.append((tcp_pdu.H2C_DATA, data))
        feed(a, conn, stream, rng, (1, 7, 23, 500, 4096, 65536))
        assert conn.lost is None
        assert conn.got == want
        assert conn._filled == 0
    finally:
        a.close()
        conn.close()


def test_a_refused_header_never_grows_the_buffer():
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        # 1 GiB announced as in-capsule data: refused from its 8 header bytes
        a.sendall(tcp_pdu.COMMON.pack(tcp_pdu.CAPSULE_CMD, tcp_pdu.F_DDGST, 72, 72, 1 << 30)
                  + bytes(64))
        drain(conn)
        assert conn.closed and "protocol error" in conn.lost
        assert len(conn._staging) == STAGING_START
        term = a.recv(4096)
        assert term[0] == tcp_pdu.C2H_TERM
        assert tcp_pdu.unpack_term(term)[0] == tcp_pdu.Fes.INVALID_HEADER_FIELD
    finally:
        a.close()


def test_resolve_checks_the_region_bounds_and_key():
    pd = local_pd()
    buf = bytearray(8192)
    mr = pd.reg_mr(buf)
    try:
        assert bytes(resolve(pd, mr.addr + 4096, 16, mr.lkey)) == bytes(16)
        assert len(resolve(pd, mr.addr, 8192, mr.rkey)) == 8192
        for addr, length, key in ((mr.addr + 8000, 400, mr.lkey), (mr.addr - 1, 8, mr.lkey),
                                  (mr.addr, 8, mr.lkey ^ 1)):
            try:
                resolve(pd, addr, length, key)
            except ValueError:
                continue
            raise AssertionError(f"resolved {addr:#x}+{length} with key {key:#x}")
    finally:
        mr.close()
        pd.close()


class CountingSocket:
    """A socket whose ``sendmsg`` calls are counted (a socket object takes no attributes)."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.sendmsgs = 0

    def sendmsg(self, bufs):
        self.sendmsgs += 1
        return self._sock.sendmsg(bufs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Echo(Recorder):
    """Answers every capsule with a 24-byte PDU of its first SQE byte."""

    def on_pdu(self, ptype, flags, pdu, pdo, dlen) -> None:
        super().on_pdu(ptype, flags, pdu, pdo, dlen)
        self.send([bytes([pdu[8]]) * 24])


def capsules(count: int) -> bytes:
    return b"".join(bytes(tcp_pdu.capsule_cmd_header(bytes([i % 256]) * 64, 0, False, True))
                    for i in range(count))


def test_answers_to_the_pdus_of_one_receive_go_out_in_one_sendmsg():
    """As the target runs its loop (run_forever on its main thread, no Reactor.thread):
    the answers go out at the end of the receive, in one sendmsg, with no cross-thread
    wake-up of the loop by itself."""
    a, b = tcp_pair()
    reactor = Reactor("test")
    loop = threading.Thread(target=reactor.run_forever, daemon=True)
    loop.start()
    conn = Echo(b)
    counting = conn.sock = CountingSocket(b)
    try:
        conn.attach(reactor)
        wakes = []
        threadsafe = reactor.call_soon_threadsafe

        def counted(callback):
            wakes.append(callback)
            threadsafe(callback)
        reactor.call_soon_threadsafe = counted
        a.sendall(capsules(20))             # 1440 bytes: one receive
        a.settimeout(5)
        got = b""
        while len(got) < 20 * 24:
            got += a.recv(4096)
        assert got == b"".join(bytes([i]) * 24 for i in range(20))
        assert len(conn.got) == 20 and counting.sendmsgs == 1 and not wakes
    finally:
        a.close()
        reactor.call_sync(conn.close)
        reactor.stop()
        loop.join(5)
        reactor.close()


def test_the_staging_buffer_grows_while_receives_fill_it_up_to_its_bound():
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        sizes = []
        for _ in range(12):
            a.sendall(capsules(8000))       # 576 000 bytes each time: more than it holds
            drain(conn, 100000)
            sizes.append(len(conn._staging))
        assert conn.lost is None and len(conn.got) == 12 * 8000
        assert sizes[0] > STAGING_START and max(sizes) == STAGING_MAX
    finally:
        a.close()
        conn.close()


class Expecting(Recorder):
    due = False

    def expecting(self) -> bool:
        return self.due


def test_the_busy_poll_receives_only_while_an_answer_is_due():
    a, b = tcp_pair()
    conn = Expecting(b)
    try:
        assert conn.poll() is None          # nothing due: no point spinning
        conn.due = True
        assert conn.poll() is False         # due, not here yet
        a.sendall(capsules(3))
        deadline = 1000
        while not conn.got and deadline:
            assert conn.poll() in (True, False)
            deadline -= 1
        assert len(conn.got) == 3
        conn.due = False
        a.sendall(capsules(1))
        assert conn.poll() is None and len(conn.got) == 3
    finally:
        a.close()
        conn.close()


@pytest.mark.parametrize("leave", ["close", "hand-over"])
def test_a_connection_is_the_reactors_poller_while_attached(leave):
    """Attached, a connection is its reactor's reader and busy-poll; closed, or released
    for a hand-over (a target's I/O queue going to a poll group, target/pollgroups.py),
    neither stays: a queue left polled would count its Connect's slot as in flight for
    good, and past SPIN_MAX_DEPTH of them the loop would never spin again.  Released, its
    socket stays open, for the worker."""
    a, b = tcp_pair()
    reactor = Reactor("test", spin_us=50)
    reactor.start()
    conn = Expecting(b)
    try:
        conn.attach(reactor)
        assert conn.poll in reactor._pollers and conn.poll in reactor._depths
        conn.due = True
        a.sendall(capsules(2))
        deadline = time.monotonic() + 5
        while len(conn.got) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(conn.got) == 2
        reactor.call_sync(conn.close if leave == "close" else conn.release_reactor)
        assert conn.poll not in reactor._pollers and conn.poll not in reactor._depths
        assert b.fileno() not in reactor._readers
        if leave == "hand-over":
            a.sendall(capsules(1))      # nothing here reads it now: the worker would
            time.sleep(0.1)
            assert len(conn.got) == 2 and b.recv(72) == capsules(1)
    finally:
        a.close()
        b.close()
        reactor.stop()
        reactor.join(5)
        reactor.close()


def test_more_buffers_than_one_sendmsg_takes_go_out_in_one_write():
    """Past IOV_MAX buffers queued, a write sends them slice after slice while the socket
    takes them, not one slice and then a retry later as if the socket were full."""
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        count = 3 * IOV_MAX + 7
        conn.send([bytes([i % 251]) * 8 for i in range(count)])
        conn.flush()                    # (no reactor: nothing would retry)
        assert not conn._out and conn._retry is None
        got = b""
        a.settimeout(5)
        while len(got) < 8 * count:
            got += a.recv(1 << 16)
        assert got == b"".join(bytes([i % 251]) * 8 for i in range(count))
    finally:
        a.close()
        conn.close()


class Placing(Recorder):
    """Names memory for each H2CData's data, as a target does for a transfer it asked for."""

    prechecked = frozenset((tcp_pdu.H2C_DATA,))

    def __init__(self, sock, size: int) -> None:
        super().__init__(sock)
        self.memory = bytearray(size)
        self.bad: list[int] = []

    def precheck(self, ptype, flags, header, dlen):
        if ptype != tcp_pdu.H2C_DATA:
            return None
        offset = tcp_pdu.unpack_data_fields(header)[2]
        return memoryview(self.memory)[offset:offset + dlen]

    def on_pdu(self, ptype, flags, pdu, pdo, dlen) -> None:
        self.got.append((ptype, tcp_pdu.unpack_data_fields(pdu)[2] if ptype == tcp_pdu.H2C_DATA
                         else bytes(pdu[8:72])))

    def on_data_digest_error(self, ptype, flags, pdu, pdo, dlen) -> None:
        self.bad.append(tcp_pdu.unpack_data_fields(pdu)[2])


def test_large_data_goes_straight_into_its_memory_with_small_pdus_around_it():
    """200 000-byte H2CData PDUs cut anywhere, capsules between them, one with a wrong data
    digest: the data lands in the memory precheck named, the staging buffer never grows
    to hold it, the digest is checked over the memory, and the PDUs keep their order."""
    rng = random.Random(7)
    a, b = tcp_pair()
    size = 200000
    conn = Placing(b, 4 * size)
    try:
        payloads = [rng.randbytes(size) for _ in range(4)]
        stream, want = b"", []
        for i, data in enumerate(payloads):
            pdu = bytearray(h2c(data, i * size))
            if i == 2:
                pdu[-1] ^= 0xFF             # its data digest
            stream += bytes(pdu) + capsules(1)
            want += [(tcp_pdu.H2C_DATA, i * size)] if i != 2 else []
            want.append((tcp_pdu.CAPSULE_CMD, bytes(64)))
        feed(a, conn, stream, rng, (1, 3, 100, 4096, 30000, 150000))
        assert conn.lost is None
        assert conn.got == want and conn.bad == [2 * size]
        assert bytes(conn.memory) == b"".join(payloads)
        assert len(conn._staging) < size and conn._filled == 0
    finally:
        a.close()
        conn.close()


@pytest.mark.parametrize("copy_unsent", [True, False])
def test_what_a_full_socket_did_not_take_is_copied_only_where_memory_is_reused(copy_unsent):
    a, b = tcp_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = Recorder(b)
    conn.copy_unsent = copy_unsent
    data = bytearray(os.urandom(1 << 20))
    try:
        conn.send_now([memoryview(data)])
        assert conn.unsent > 0
        assert all(isinstance(v, bytes) for v in conn._out) == copy_unsent
        if not copy_unsent:
            assert all(v.obj is data for v in conn._out)
        got = bytearray()
        a.settimeout(0.02)
        deadline = time.monotonic() + 20
        while len(got) < len(data) and time.monotonic() < deadline:
            conn.flush()                    # what the reactor's retry timer does
            try:
                got += a.recv(1 << 20)
            except TimeoutError:
                pass
        assert got == data and conn.unsent == 0
    finally:
        a.close()
        conn.close()


@pytest.mark.parametrize("copy_unsent", [True, False])
def test_an_owner_is_told_once_its_bytes_are_written_or_copied(copy_unsent):
    """``send(bufs, after)``: ``after`` is released once the stream is written up to the
    end of ``bufs``.  A side that copies what a full socket did not take releases at the
    copy; one that keeps it by reference (the target: its volume's or bounce buffers'
    memory) releases each owner only as its bytes leave, in order."""
    a, b = tcp_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = Recorder(b)
    conn.copy_unsent = copy_unsent
    told: list[str] = []
    conn.released = told.append
    first, big = bytearray(b"f" * 100), bytearray(os.urandom(1 << 20))
    try:
        conn.send([memoryview(first)], "first")
        conn.send([memoryview(big)], "big")
        conn.flush()
        assert conn.unsent > 0
        assert told == (["first", "big"] if copy_unsent else ["first"])
        got = bytearray()
        a.settimeout(0.02)
        deadline = time.monotonic() + 20
        while len(got) < len(first) + len(big) and time.monotonic() < deadline:
            if not copy_unsent and conn.unsent:
                assert told == ["first"], "released before its bytes were written"
            conn.flush()
            try:
                got += a.recv(1 << 20)
            except TimeoutError:
                pass
        assert got == first + big and conn.unsent == 0
        assert told == ["first", "big"]
    finally:
        a.close()
        conn.close()


def test_a_full_socket_is_retried_soon_while_it_drains_and_less_often_while_it_does_not():
    """What the socket did not take is written again after RETRY_FIRST while each write
    moves bytes (a peer reading at full speed), after twice the last wait up to RETRY_MAX
    while none does (a peer that stopped reading), and soon again once it reads."""
    from blockfabric.fabric import tcp

    class Timers:                           # the reactor's timer API, recording the delays
        ident = threading.get_ident()

        def __init__(self) -> None:
            self.delays: list[float] = []

        def call_later(self, delay, callback):
            self.delays.append(delay)
            return None                     # (no timer object: the test calls flush)

    a, b = tcp_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = Recorder(b)
    conn.reactor = timers = Timers()
    try:
        conn.send_now([memoryview(bytearray(32 << 20))])
        assert conn.unsent > 0 and timers.delays == [tcp.RETRY_FIRST]
        while True:                         # until the peer's buffers are full too
            time.sleep(0.01)
            sent = conn._sent_total
            conn._retry = None
            conn.flush()
            if conn._sent_total == sent:
                break
            assert timers.delays[-1] == tcp.RETRY_FIRST     # it moved: soon again
        assert conn.unsent > 0
        del timers.delays[:-1]
        for _ in range(5):                  # the peer reads nothing
            conn._retry = None
            conn.flush()
        assert timers.delays == [min(tcp.RETRY_FIRST * 2 ** k, tcp.RETRY_MAX)
                                 for k in range(1, 7)]
        assert timers.delays[-1] == tcp.RETRY_MAX
        a.settimeout(1)
        a.recv(1 << 20)                     # it reads: the next write moves bytes again
        conn._retry = None
        conn.flush()
        assert conn.unsent > 0 and timers.delays[-1] == tcp.RETRY_FIRST
    finally:
        conn.reactor = None
        a.close()
        conn.close()

"""The NVMe/TCP host's Read/Write fast path (``TcpHostQueue._post_rw`` on the reactor's own
submission) puts on the wire exactly the bytes of the general path (``HostQueue._post_rw``
and ``_post``, taken when the caller holds the queue lock), for each kind of data the data
path moves: a read's C2HData, a write's R2T, a write in the capsule from a keyed buffer and
from a view the caller gives; and memory outside the PD's regions is refused as before."""

from __future__ import annotations

import socket

import pytest

from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_host import TcpHostQueue
from blockfabric.protocol import tcp_pdu

INLINE = 8192


@pytest.fixture
def pair():
    """A host I/O queue on one end of a loopback connection (its reactor: none, so what it
    queues goes out on flush), the other end, and 64 KiB of registered memory."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    pd = local_pd()
    mem = bytearray(range(256)) * 256          # 64 KiB, every byte known
    mr = pd.reg_mr(mem)
    queue = TcpHostQueue(a, pd, tcp_pdu.ICResp(maxh2cdata=1 << 17), qid=1, depth=4,
                         inline_size=INLINE, name="fast")
    b.settimeout(5)
    yield queue, b, mr
    queue.close()
    b.close()
    mr.close()
    pd.close()


def wire(queue: TcpHostQueue, peer: socket.socket, locked: bool, *args) -> bytes:
    """What one command puts on the wire: ``_post_rw`` through the fast path (locked False:
    the reactor's submission) or the general one (True); the slot given back after."""
    slot = queue._take(queue._free.pop(), None)
    cid = queue._post_rw(slot, *args, locked)
    if not locked:
        queue.flush()
    pdu = b""
    while len(pdu) < 8 or len(pdu) < tcp_pdu.COMMON.unpack_from(pdu)[4]:
        pdu += peer.recv(1 << 20)
    queue._free_slot(slot)
    assert cid == slot.cid
    # the cid differs from slot to slot: compare the rest
    return pdu[:10] + pdu[12:]


@pytest.mark.parametrize("what", ["read", "write by R2T", "write in the capsule, keyed",
                                  "write in the capsule, given"])
def test_the_fast_path_sends_what_the_general_path_sends(pair, what):
    queue, peer, mr = pair
    read = what == "read"
    length = 4096 if "capsule" in what or read else 16384
    addr = mr.addr + 8192
    data = memoryview(mr.buf)[8192:8192 + length] if "given" in what else None
    args = (0x02 if read else 0x01, 1, 77, length // 512 - 1, addr, length, mr.rkey, data)
    fast, general = wire(queue, peer, False, *args), wire(queue, peer, True, *args)
    assert fast == general, what
    assert fast[0] == tcp_pdu.CAPSULE_CMD
    if "capsule" in what:
        assert fast[-length:] == bytes(mr.buf[8192:8192 + length])
    else:
        assert len(fast) == 70          # the command alone: its data moves later


def test_memory_outside_the_pd_is_refused_on_the_fast_path_too(pair):
    queue, peer, mr = pair
    slot = queue._take(queue._free.pop(), None)
    with pytest.raises(ValueError, match="outside the region"):
        queue._post_rw(slot, 0x02, 1, 0, 7, mr.addr + 65536 - 2048, 4096, mr.rkey, None,
                       False)
    assert not slot.busy                # given back, nothing sent


def test_in_capsule_data_of_another_length_is_refused_not_sent(pair):
    """(submit_rw refuses it before a slot is taken: the fast path packs what it is given)"""
    queue, peer, mr = pair
    with pytest.raises(ValueError, match="2048 bytes of in-capsule data"):
        queue.submit_rw(None, 0x01, 1, 0, 7, mr.addr, 4096, mr.rkey, memoryview(mr.buf)[:2048])
    assert len(queue._free) == queue.depth      # no slot taken
    queue.flush()
    peer.settimeout(0.2)
    with pytest.raises(socket.timeout):
        peer.recv(1)                    # nothing went out


class _Recorder:
    def __init__(self, done: list, again=None) -> None:
        self.done, self.again = done, again

    def complete(self, raw, error) -> None:
        self.done.append(raw[3])
        if self.again is not None:
            self.again()


@pytest.mark.parametrize("answered", [4, 1])
def test_answers_to_half_the_commands_in_flight_push_what_they_issued(pair, answered):
    """4 reads in flight, answered in one segment: the reads their owners issue again go
    out once the second answer is handled, before the third (the target starts on them
    while this receive goes on); the rest leave at the end of the receive.  A receive
    that answers fewer than half pushes nothing early."""
    import select

    queue, peer, mr = pair
    completed: list[int] = []
    flushes: list[tuple[int, int]] = []

    def read(owner, i: int) -> None:
        slot = queue._take(queue._free.pop(), owner)
        queue._post_rw(slot, 0x02, 1, i, 0, mr.addr + 512 * i, 512, mr.rkey, None, False)

    for i in range(4):
        read(_Recorder(completed, lambda: read(_Recorder([]), 9)), i)
    queue.flush()
    capsules = b""
    while len(capsules) < 4 * 72:
        capsules += peer.recv(1 << 16)
    cids = [int.from_bytes(capsules[72 * i + 10:72 * i + 12], "little") for i in range(4)]
    real_flush = queue.flush
    queue.flush = lambda: (flushes.append((len(completed), len(queue._out))), real_flush())
    flags = tcp_pdu.F_DATA_LAST | tcp_pdu.F_DATA_SUCCESS
    peer.sendall(b"".join(bytes(tcp_pdu.data_header(tcp_pdu.C2H_DATA, flags, cid, 0, 0, 512,
                                                    False, False)) + bytes(512)
                          for cid in cids[:answered]))
    select.select([queue.sock], [], [], 5)
    for _ in range(500):                        # every answer in, for one receive to take
        if len(queue.sock.recv(1 << 16, socket.MSG_PEEK)) >= answered * (24 + 512):
            break
        select.select([], [], [], 0.01)
    while len(completed) < answered:
        assert queue._receive()
    assert completed == cids[:answered]
    # with all 4 answered: one early flush, after 2 answers, with their 2 reads queued
    assert flushes == ([(2, 2)] if answered == 4 else []), flushes
    again = b""
    while len(again) < answered * 72:
        again += peer.recv(1 << 16)
    assert len(again) == answered * 72          # every read issued again went out

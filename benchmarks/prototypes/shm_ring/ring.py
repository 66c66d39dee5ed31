#!/usr/bin/env python3
"""How much of a same-host QD1 round trip is the socket: a 64-byte request answered by a
16-byte response plus a 4 KiB copy into the requester's memory, between two processes
that both spin, over

  socket   a unix stream socket, each side spinning on epoll_wait(0) and receiving with
           recvmsg_into and room for descriptors, as the soft provider's same-host
           connections do (an answer of 4 KiB is copied into shared memory, not sent);
  ring     a mailbox in shared memory (a memfd both map): the sender writes the record,
           then bumps a sequence number; the receiver spins reading it (sched_yield every
           64 reads, as the reactor's spin yields).

Pure stdlib, no product code: a measuring tool for issue 14's QD1 question (what a
shared-memory transport for the soft provider's frames would save per read).

    python3 benchmarks/prototypes/shm_ring/ring.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import select
import socket
import statistics
import struct
import sys
import time

REQ, RESP, DATA = 64, 16, 4096
SEQ = struct.Struct("<Q")
# memfd layout: [0, 64) seq host->target, [64, 128) seq target->host,
# [128, 192) request, [192, 208) response, [4096, 8192) the host's data buffer
SIZE = 8192
FDS_SPACE = socket.CMSG_SPACE(16 * 4)


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def target_socket(sock: socket.socket, shm: mmap.mmap, volume: memoryview) -> None:
    ep = select.epoll()
    ep.register(sock.fileno(), select.EPOLLIN)
    buf = bytearray(65536)
    view = memoryview(buf)
    out = memoryview(shm)
    resp = bytes(RESP)
    i = 0
    while True:
        if not ep.poll(0):
            os.sched_yield()
            continue
        n = sock.recvmsg_into([view], FDS_SPACE)[0]
        if n == 0:
            return
        off = (i * DATA) % (len(volume) - DATA)
        out[4096:8192] = volume[off:off + DATA]        # the RDMA WRITE, through memory
        sock.send(resp)
        i += 1


def host_socket(sock: socket.socket, seconds: float) -> tuple[int, float]:
    ep = select.epoll()
    ep.register(sock.fileno(), select.EPOLLIN)
    buf = bytearray(65536)
    view = memoryview(buf)
    req = bytes(REQ)
    n = 0
    start, c0 = time.perf_counter(), cpu()
    end = start + seconds
    while True:
        sock.send(req)
        while not ep.poll(0):
            os.sched_yield()
        sock.recvmsg_into([view], FDS_SPACE)
        n += 1
        if not n & 255 and time.perf_counter() >= end:
            break
    return n, cpu() - c0


def target_ring(shm: mmap.mmap, volume: memoryview) -> None:
    out = memoryview(shm)
    unpack, pack_into = SEQ.unpack_from, SEQ.pack_into
    seen = 0
    i = 0
    while True:
        spins = 0
        while True:
            seq = unpack(shm, 0)[0]
            if seq != seen:
                break
            spins += 1
            if not spins & 63:
                os.sched_yield()
        if seq == 0xFFFFFFFFFFFFFFFF:
            return
        seen = seq
        _request = bytes(out[128:128 + REQ])
        off = (i * DATA) % (len(volume) - DATA)
        out[4096:8192] = volume[off:off + DATA]
        out[192:192 + RESP] = bytes(RESP)
        pack_into(shm, 64, seq)                          # after the record: x86 keeps order
        i += 1


def host_ring(shm: mmap.mmap, seconds: float) -> tuple[int, float]:
    out = memoryview(shm)
    unpack, pack_into = SEQ.unpack_from, SEQ.pack_into
    req = bytes(REQ)
    n = 0
    start, c0 = time.perf_counter(), cpu()
    end = start + seconds
    while True:
        out[128:128 + REQ] = req
        pack_into(shm, 0, n + 1)
        spins = 0
        while unpack(shm, 64)[0] != n + 1:
            spins += 1
            if not spins & 63:
                os.sched_yield()
        _resp = bytes(out[192:192 + RESP])
        n += 1
        if not n & 255 and time.perf_counter() >= end:
            break
    pack_into(shm, 0, 0xFFFFFFFFFFFFFFFF)
    return n, cpu() - c0


def run(kind: str, seconds: float) -> dict:
    fd = os.memfd_create("ring")
    os.ftruncate(fd, SIZE)
    shm = mmap.mmap(fd, SIZE)
    volume = memoryview(bytearray(os.urandom(1 << 20) * 64))    # 64 MiB, random reads
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # the target
        a.close()
        c0 = cpu()
        if kind == "socket":
            b.setblocking(False)
            target_socket(b, shm, volume)
        else:
            target_ring(shm, volume)
        os.write(w, struct.pack("<d", cpu() - c0))
        os._exit(0)
    b.close()
    if kind == "socket":
        a.setblocking(False)
        n, host_cpu = host_socket(a, seconds)
        a.close()
    else:
        n, host_cpu = host_ring(shm, seconds)
    os.waitpid(pid, 0)
    target_cpu = struct.unpack("<d", os.read(r, 8))[0]
    return {"kind": kind, "rtt_us": seconds * 1e6 / n, "per_s": n / seconds,
            "host_us": host_cpu * 1e6 / n, "target_us": target_cpu * 1e6 / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"socket": [], "ring": []}
    for rnd in range(args.rounds):
        for kind in (("socket", "ring") if rnd % 2 == 0 else ("ring", "socket")):
            res = run(kind, args.seconds)
            rows[kind].append(res)
            print(f"round {rnd + 1} {kind:<7} {res['per_s']:>9.0f} round trips/s  "
                  f"{res['rtt_us']:6.2f} us each  CPU host {res['host_us']:.2f} "
                  f"target {res['target_us']:.2f} us", flush=True)
    print("\nmedians:")
    for kind, rs in rows.items():
        print(f"  {kind:<7} {statistics.median(r['per_s'] for r in rs):>9.0f}/s  "
              f"{statistics.median(r['rtt_us'] for r in rs):6.2f} us per round trip")
    s = statistics.median(r["rtt_us"] for r in rows["socket"])
    g = statistics.median(r["rtt_us"] for r in rows["ring"])
    print(f"  the socket's share of a round trip: {s - g:.2f} us ({s / g:.2f}x the ring's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

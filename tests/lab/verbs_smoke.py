"""Smoke test of the verbs provider on a real RDMA device, through blockfabric.rdma only.

Runs inside the lab guest (rxe0 on $LAB_IP): a server thread and the client in one process,
which also proves that nothing blocks inside pyverbs (it would freeze the other thread).
Covers: device/address ownership, reject with private data, connect/accept with private data,
SEND/RECV, RDMA WRITE and READ into caller memory (bytearray and mmap), a completion-channel
wait, two connections on one listener sharing a PD (closing one leaves the other working),
REM_ACCESS_ERR, disconnect with DISCONNECTED and flushed receives, and no leaked descriptors.
Usage: verbs_smoke.py [IP]; exit status 0 when every check passed.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import sys
import threading
import time

from blockfabric.errors import ConnectionRejected
from blockfabric.rdma import (SGE, Access, CMEventType, QPState, RecvWR, SendWR, WcOpcode,
                              WcStatus, WrOpcode, get_provider)

IP = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LAB_IP", "10.99.0.1")
SIZE = 64 * 1024
MSG = 256
CONNECT_PD = struct.pack("<HHHHH", 0, 1, 32, 31, 0xFFFF).ljust(32, b"\0")  # NVMe-oF style
ACCEPT_PD = struct.pack("<HH", 0, 32).ljust(32, b"\0")
REJECT_PD = struct.pack("<HH", 0, 6)
RW = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
failures: list[str] = []


def check(cond: bool, what: str) -> None:
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def wait_wc(cq, timeout: float = 10.0):
    """One completion, waiting on the CQ's completion channel (not a busy poll)."""
    deadline = time.monotonic() + timeout
    while True:
        wcs = cq.poll(1)
        if wcs:
            return wcs[0]
        cq.req_notify()
        wcs = cq.poll(1)                 # a completion may have landed before the arm
        if wcs:
            return wcs[0]
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no completion")
        select.select([cq.fileno()], [], [], left)
        cq.ack_events()


class End:
    """One side's resources: PD, CQ, message MR, a data MR over caller memory, and a QP."""

    def __init__(self, cmid, pd=None, data=None):
        self.cmid = cmid
        self.own_pd = pd is None
        self.pd = pd or cmid.context.alloc_pd()
        self.cq = cmid.context.create_cq(64)
        self.msg = self.pd.reg_mr(bytearray(2 * MSG), Access.LOCAL_WRITE)
        self.data = self.pd.reg_mr(data if data is not None else bytearray(SIZE), RW)
        self.qp = cmid.create_qp(self.pd, self.cq, self.cq)

    def post_recv(self, wr_id: int = 1) -> None:
        self.qp.post_recv(RecvWR(wr_id, [SGE(self.msg.addr, MSG, self.msg.lkey)]))

    def send(self, payload: bytes, wr_id: int = 2):
        self.msg.buf[MSG:MSG + len(payload)] = payload
        self.qp.post_send(SendWR(wr_id, WrOpcode.SEND,
                                 [SGE(self.msg.addr + MSG, len(payload), self.msg.lkey)]))
        return wait_wc(self.cq)

    def close(self) -> None:
        self.cmid.close()
        for obj in (self.msg, self.data, self.cq) + ((self.pd,) if self.own_pd else ()):
            obj.close()


def client_connect(provider, port: int, pd_bytes: bytes):
    cmid = provider.create_id()
    cmid.resolve(IP, port, timeout=10)
    end = End(cmid)
    end.post_recv()
    try:
        accepted = cmid.connect(pd_bytes, timeout=20)
    except BaseException:
        end.close()
        raise
    return end, accepted


def run() -> None:
    provider = get_provider("verbs")
    provider.listen(IP, 0).close()       # librdmacm opens its own device files once, on first use
    fds_before = len(os.listdir("/proc/self/fd"))
    devs = provider.devices()
    print("devices:", [(d.name, [(p["port"], p["state"], p["netdevs"]) for p in d.ports])
                       for d in devs], flush=True)
    check(bool(devs), "a device is listed")
    check(provider.owns_address(IP), f"owns_address({IP})")
    check(not provider.owns_address("127.0.0.1"), "does not own 127.0.0.1")
    check(not provider.owns_address("192.0.2.1"), "does not own 192.0.2.1")
    check(get_provider("auto", IP).name == "verbs", "auto picks verbs for the rxe address")

    listener = provider.listen(IP, 0)
    port = listener.local_address[1]
    check(listener.local_address[0] == IP and port > 0, f"listening on {listener.local_address}")
    check(listener.get_request(0) is None, "get_request(0) returns None at once")

    # ---- reject, with private data
    result: dict = {}

    def rejected_client():
        try:
            client_connect(provider, port, CONNECT_PD)
        except ConnectionRejected as exc:
            result["rej"] = exc
        except BaseException as exc:      # noqa: BLE001 (reported below)
            result["err"] = exc
    t = threading.Thread(target=rejected_client)
    t.start()
    req = listener.get_request(timeout=20)
    check(req is not None, "connect request arrived")
    print(f"     connect private data as received: {len(req.private_data)} B", flush=True)
    check(req.private_data[:32] == CONNECT_PD,
          f"connect private data intact (first 32 B: {req.private_data[:32].hex()})")
    req.reject(REJECT_PD)
    t.join(30)
    rej = result.get("rej")
    check(rej is not None, f"client saw ConnectionRejected ({result.get('err')!r})")
    if rej is not None:
        print(f"     reject private data as received: {len(rej.private_data)} B", flush=True)
        check(rej.private_data[:4] == REJECT_PD, "reject private data intact (first 4 B)")
    req.close()

    # ---- two accepted connections sharing the server's PD
    server_mem = mmap.mmap(-1, SIZE)
    ends: dict = {}

    def good_client(tag):
        try:
            ends[tag] = client_connect(provider, port, CONNECT_PD)
        except BaseException as exc:      # noqa: BLE001
            ends[tag] = exc
    servers = []
    shared_pd = None
    for tag in ("A", "B"):
        t = threading.Thread(target=good_client, args=(tag,))
        t.start()
        req = listener.get_request(timeout=20)
        if shared_pd is None:
            shared_pd = req.context.alloc_pd()
        srv = End(req, pd=shared_pd, data=server_mem if tag == "A" else None)
        srv.post_recv()
        req.accept(ACCEPT_PD)
        t.join(30)
        servers.append(srv)
        check(isinstance(ends[tag], tuple), f"connection {tag} established ({ends[tag]!r:.80})")
    if failures:
        return
    (cli, accepted), (cli_b, _) = ends["A"], ends["B"]
    print(f"     accept private data as received: {len(accepted)} B", flush=True)
    check(accepted[:32] == ACCEPT_PD, "accept private data intact (first 32 B)")
    srv, srv_b = servers
    check(cli.qp.state == QPState.RTS and srv.qp.state == QPState.RTS, "both QPs in RTS")
    check(cli.cmid.peer_address == (IP, port), f"client peer address {cli.cmid.peer_address}")

    # ---- SEND/RECV: the server advertises its mmap'd buffer
    wc = srv.send(struct.pack("<QII", srv.data.addr, srv.data.rkey, SIZE))
    check(wc.status == WcStatus.SUCCESS and wc.opcode == WcOpcode.SEND, "server SEND")
    wc = wait_wc(cli.cq)
    check(wc.status == WcStatus.SUCCESS and wc.opcode == WcOpcode.RECV and wc.byte_len == 16,
          f"client RECV {wc.byte_len} B")
    raddr, rkey, rlen = struct.unpack("<QII", bytes(cli.msg.buf[:16]))

    # ---- RDMA WRITE then READ back, timed
    pattern = bytes((i * 7 + 3) & 0xFF for i in range(SIZE))
    cli.data.buf[:] = pattern
    t0 = time.perf_counter()
    cli.qp.post_send(SendWR(10, WrOpcode.RDMA_WRITE, [SGE(cli.data.addr, SIZE, cli.data.lkey)],
                            remote_addr=raddr, rkey=rkey))
    wc = wait_wc(cli.cq)
    t_write = time.perf_counter() - t0
    check(wc.status == WcStatus.SUCCESS and wc.opcode == WcOpcode.RDMA_WRITE, "RDMA WRITE")
    check(server_mem[:SIZE] == pattern, "WRITE landed in the server's mmap")
    cli.data.buf[:] = bytes(SIZE)
    t0 = time.perf_counter()
    cli.qp.post_send(SendWR(11, WrOpcode.RDMA_READ, [SGE(cli.data.addr, SIZE, cli.data.lkey)],
                            remote_addr=raddr, rkey=rkey))
    wc = wait_wc(cli.cq)
    t_read = time.perf_counter() - t0
    check(wc.status == WcStatus.SUCCESS and wc.opcode == WcOpcode.RDMA_READ
          and bytes(cli.data.buf) == pattern, "RDMA READ brought the data back")
    print(f"     64 KiB RDMA WRITE {t_write * 1e3:.1f} ms, READ {t_read * 1e3:.1f} ms",
          flush=True)
    wc = cli.send(b"done")
    check(wc.status == WcStatus.SUCCESS, "client SEND")
    wc = wait_wc(srv.cq)
    check(wc.status == WcStatus.SUCCESS and bytes(srv.msg.buf[:4]) == b"done", "server RECV")

    # ---- closing connection A leaves B (same listener, same PD) working
    srv.post_recv(5)
    cli.close()
    srv.close()
    server_mem.close()
    wc = cli_b.send(b"still here")
    got = wait_wc(srv_b.cq)                 # lands in the receive End posted at set-up
    check(wc.status == WcStatus.SUCCESS and got.status == WcStatus.SUCCESS and got.wr_id == 1
          and bytes(srv_b.msg.buf[:10]) == b"still here", "connection B works after A closed")

    # ---- a write the server never allowed: remote access error, QP to ERR
    cli_b.qp.post_send(SendWR(20, WrOpcode.RDMA_WRITE,
                              [SGE(cli_b.data.addr, 64, cli_b.data.lkey)],
                              remote_addr=srv_b.msg.addr, rkey=srv_b.msg.rkey))
    wc = wait_wc(cli_b.cq)
    check(wc.status == WcStatus.REM_ACCESS_ERR and wc.wr_id == 20,
          f"write to a local-only MR -> {wc.status!r}")
    check(cli_b.qp.state == QPState.ERR, f"client QP in ERR ({cli_b.qp.state!r})")
    cli_b.qp.post_send(SendWR(21, WrOpcode.SEND, [SGE(cli_b.msg.addr, 4, cli_b.msg.lkey)]))
    flushed = [wait_wc(cli_b.cq), wait_wc(cli_b.cq)]   # the set-up receive, then the SEND
    check(sorted((w.wr_id, w.opcode, w.status) for w in flushed)
          == [(1, WcOpcode.RECV, WcStatus.WR_FLUSH_ERR), (21, WcOpcode.SEND,
                                                        WcStatus.WR_FLUSH_ERR)],
          f"receive and a SEND posted in ERR are flushed ({flushed})")

    # ---- disconnect: the server sees DISCONNECTED, its receives are flushed
    srv_b.post_recv(30)
    cli_b.cmid.disconnect()
    ev = srv_b.cmid.get_event(timeout=20)
    check(ev is not None and ev.type == CMEventType.DISCONNECTED, f"server event {ev}")
    check(srv_b.qp.state == QPState.ERR, "server QP in ERR after DISCONNECTED")
    wc = wait_wc(srv_b.cq)
    check(wc.status == WcStatus.WR_FLUSH_ERR and wc.opcode == WcOpcode.RECV,
          f"server receive flushed ({wc.status!r}, {wc.opcode!r})")
    cli_b.close()
    srv_b.close()
    shared_pd.close()
    listener.close()
    check(len(os.listdir("/proc/self/fd")) == fds_before, "no descriptors leaked")


if __name__ == "__main__":
    t0 = time.monotonic()
    run()
    print(f"verbs smoke: {len(failures)} failure(s) in {time.monotonic() - t0:.1f} s",
          flush=True)
    sys.exit(1 if failures else 0)

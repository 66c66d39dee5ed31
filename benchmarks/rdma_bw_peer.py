"""rdma_bw's two ends: what both share (the JSON control channel, an RDMA endpoint of one
QP, CQ and registered buffer) and the server, the passive side that answers the client's
control commands (benchmarks/rdma_bw.py runs it with ``--server``).
"""

from __future__ import annotations

import ctypes
import json
import math
import select
import signal
import socket
import struct
import time

from blockfabric.rdma import SGE, Access, QPCap, RecvWR, SendWR, WcStatus, WrOpcode, get_provider

#: what the server tells the client in the CM accept private data (read from the front:
#: rdma_cm pads it): remote address and rkey of the server's buffer
SERVER_MR = struct.Struct("<QI")
TCP_ACK = struct.Struct("<Q")          # the TCP receiver's running count of whole messages
WAIT_TIMEOUT = 30.0                    # s without a completion: the run is broken


def spin_for(wait: str) -> float:
    """Seconds a --wait mode busy-polls before it sleeps: spin, always; event, never;
    adaptive, as long as a reactor spins by default (blockfabric.fabric.reactor)."""
    if wait == "spin":
        return math.inf
    if wait == "adaptive":
        from blockfabric.fabric.reactor import spin_default
        return spin_default() * 1e-6
    return 0.0


def die_with_parent() -> None:
    """The spawned server must not outlive the client (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Control:
    """JSON lines over the control TCP connection (perftest's out-of-band exchange)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = sock.makefile("r")

    def send(self, **msg) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def recv(self) -> dict | None:
        line = self.rfile.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        """Close both the file and the socket: the peer sees EOF only when both are gone."""
        self.rfile.close()
        self.sock.close()


# --------------------------------------------------------------------------- RDMA endpoint


class Endpoint:
    """One end: provider, PD, one CQ for both queues, QP and one registered buffer."""

    def __init__(self, provider, cmid, size: int, depth: int) -> None:
        self.provider, self.cmid = provider, cmid
        self.pd = cmid.context.alloc_pd()
        self.cq = cmid.context.create_cq(4 * depth + 16)
        self.qp = cmid.create_qp(self.pd, self.cq, self.cq,
                                 QPCap(max_send_wr=depth + 4, max_recv_wr=depth + 4))
        self.buf = bytearray(size)
        self.mr = self.pd.reg_mr(self.buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE
                                 | Access.REMOTE_READ)
        #: seconds to busy-poll the CQ before sleeping on its fd: math.inf for --wait
        #: spin, 0 for event, the reactor's default spin for adaptive (see spin_for)
        self.spin_s = math.inf

    def sge(self, size: int) -> list[SGE]:
        return [SGE(self.mr.addr, size, self.mr.lkey)]

    def reap(self, want: int = 1) -> list:
        """At least ``want`` completions (spin on poll, or sleep on the CQ's fd)."""
        out: list = []
        cq = self.cq
        now = time.monotonic()
        deadline = now + WAIT_TIMEOUT
        spin_until = now + self.spin_s
        while len(out) < want:
            got = cq.poll(64)
            if got:
                out.extend(got)
                continue
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no completion in {WAIT_TIMEOUT} s ({len(out)}/{want})")
            if now > spin_until:
                cq.req_notify()
                got = cq.poll(64)
                if got:
                    out.extend(got)
                    continue
                select.select([cq.fileno()], [], [], 0.05)
                cq.ack_events()
                spin_until = time.monotonic() + self.spin_s     # spin again after a wake-up
        for wc in out:
            if wc.status != WcStatus.SUCCESS:
                raise RuntimeError(f"work completion failed: {wc}")
        return out

    def close(self) -> None:
        for obj in (self.cmid, self.mr, self.cq, self.pd):
            obj.close()


def make_provider(name: str, progress: str):
    if name == "soft":
        from blockfabric.rdma.soft import SoftProvider
        return SoftProvider(progress=progress)
    return get_provider(name)


# --------------------------------------------------------------------------- server


def serve(bind: str, ctl_port: int, announce) -> None:
    """The passive side: answers the client's control commands until it hangs up."""
    lsock = socket.create_server((bind, ctl_port), family=_family(bind))
    announce(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    lsock.close()
    ctl = Control(conn)
    state: dict = {}
    try:
        while (msg := ctl.recv()) is not None:
            try:
                reply = SERVER_OPS[msg.pop("op")](state, ctl, **msg)
            except Exception as exc:  # noqa: BLE001  (report to the client, keep serving)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            ctl.send(**(reply or {"ok": True}))
    finally:
        ctl.close()
        if "ep" in state:
            state["ep"].close()
        if "tcp" in state:
            state["tcp"].close()


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _srv_setup(state: dict, ctl: Control, provider: str, progress: str, address: str,
               size: int, depth: int, wait: str) -> dict:
    """Listen for one RDMA connection and one TCP stream; the client connects to both."""
    prov = make_provider(provider, progress)
    lst = prov.listen(address, 0)
    tcp_l = socket.create_server((address, 0), family=_family(address))
    ctl.send(rdma_port=lst.local_address[1], tcp_port=tcp_l.getsockname()[1])
    cmid = None
    deadline = time.monotonic() + WAIT_TIMEOUT
    while cmid is None and time.monotonic() < deadline:
        cmid = lst.get_request(0.05)
    if cmid is None:
        raise TimeoutError("no RDMA connect request")
    ep = Endpoint(prov, cmid, size, depth)
    ep.spin_s = spin_for(wait)
    cmid.accept(SERVER_MR.pack(ep.mr.addr, ep.mr.rkey))
    state["ep"], state["listener"] = ep, lst
    tcp_l.settimeout(WAIT_TIMEOUT)
    sock, _ = tcp_l.accept()
    tcp_l.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    state["tcp"] = sock
    return {"ok": True}


def _srv_idle(state: dict, ctl: Control, seconds: float) -> dict:
    """Drive the provider (poll progress needs its owner to) while the client works."""
    ep = state["ep"]
    deadline = time.monotonic() + seconds
    busy_at = time.monotonic()
    while time.monotonic() < deadline:
        if select.select([ctl.sock], [], [], 0)[0]:
            break
        if ep.cq.poll(16):
            busy_at = time.monotonic()
        elif time.monotonic() - busy_at > ep.spin_s:
            select.select([ctl.sock, ep.cq.fileno()], [], [], 0.01)
            busy_at = time.monotonic()
    return {"ok": True}


def _srv_lat(state: dict, ctl: Control, size: int, iters: int) -> dict:
    """ib_send_lat's responder: a RECV for each ping, a SEND of the same size back."""
    ep = state["ep"]
    ep.qp.post_recv([RecvWR(0, ep.sge(size))])
    ctl.send(ready=True)
    for i in range(iters):
        got_recv = False
        while not got_recv:
            for wc in ep.reap():
                got_recv = got_recv or wc.wr_id == 0
        if i + 1 < iters:           # none left over for the next size's pings
            ep.qp.post_recv([RecvWR(0, ep.sge(size))])
        ep.qp.post_send([SendWR(1, WrOpcode.SEND, ep.sge(size))])
    while not any(wc.wr_id == 1 for wc in ep.reap()):
        pass
    return {"ok": True}


def _srv_tcp_stream(state: dict, ctl: Control, size: int, iters: int) -> dict:
    """Receive ``iters`` messages into one preallocated buffer, acknowledging progress."""
    sock, view = state["tcp"], memoryview(state["ep"].buf)[:size]
    ctl.send(ready=True)
    done = got = 0
    while done < iters:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("TCP stream closed")
        got += n
        if got == size:
            got = 0
            done += 1
            sock.sendall(TCP_ACK.pack(done))
    return {"ok": True}


def _srv_tcp_lat(state: dict, ctl: Control, size: int, iters: int) -> dict:
    sock, view = state["tcp"], memoryview(state["ep"].buf)[:size]
    ctl.send(ready=True)
    for _ in range(iters):
        recv_exact(sock, view)
        sock.sendall(view)
    return {"ok": True}


SERVER_OPS = {"setup": _srv_setup, "idle": _srv_idle, "stop": lambda state, ctl: None,
              "lat": _srv_lat, "tcp_stream": _srv_tcp_stream, "tcp_lat": _srv_tcp_lat}


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("TCP stream closed")
        got += n

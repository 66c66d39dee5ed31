#!/usr/bin/env python3
"""rdma_bw: RDMA WRITE / READ bandwidth and SEND ping-pong latency over any provider.

In the style of perftest's ib_write_bw, ib_read_bw and ib_send_lat: a client and a server
process, message sizes 4 KiB .. 4 MiB, ``-t`` messages in flight, bandwidth (MiB/s, Gb/s),
message rate, and latency percentiles (RTT/2, as ib_send_lat reports).  In the same run, and
between the same two processes, it measures the soft provider's ceiling: a plain TCP stream,
``sendall(memoryview)`` into ``recv_into`` a preallocated buffer, same sizes, same number of
messages in flight (the receiver acknowledges what it has read, as an RDMA responder ACKs).

    benchmarks/rdma_bw.py                           # soft, thread progress, loopback; writes
                                    # benchmarks/results/rdma_bw-<date>-soft-thread.md (+ .json)
    benchmarks/rdma_bw.py --provider verbs --address 10.99.0.1 --sizes 4K,64K
    benchmarks/rdma_bw.py --quick --out -           # a few seconds, results on stdout only
    benchmarks/rdma_bw.py --server --bind ADDR      # by hand: prints its control port
    benchmarks/rdma_bw.py --connect HOST:PORT       # ... and a client for it

The client spawns the server unless ``--connect`` is given.  Each figure is the median of
``--runs`` runs.  Nothing here asserts speed: ``--quick`` exists so a test can keep it working.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import select
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from blockfabric.rdma import (SGE, Access, QPCap, RecvWR, SendFlags,  # noqa: E402
                              SendWR, WcStatus, WrOpcode, get_provider)

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M"
#: what the server tells the client in the CM accept private data (read from the front:
#: rdma_cm pads it): remote address and rkey of the server's buffer
SERVER_MR = struct.Struct("<QI")
TCP_ACK = struct.Struct("<Q")          # the TCP receiver's running count of whole messages
WAIT_TIMEOUT = 30.0                    # s without a completion: the run is broken


def parse_size(text: str) -> int:
    """4K, 4KiB, 1M, 4096 -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def human(size: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _die_with_parent() -> None:
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
        self.spin = True

    def sge(self, size: int) -> list[SGE]:
        return [SGE(self.mr.addr, size, self.mr.lkey)]

    def reap(self, want: int = 1) -> list:
        """At least ``want`` completions (spin on poll, or sleep on the CQ's fd)."""
        out: list = []
        cq = self.cq
        deadline = time.monotonic() + WAIT_TIMEOUT
        while len(out) < want:
            got = cq.poll(64)
            if got:
                out.extend(got)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion in {WAIT_TIMEOUT} s ({len(out)}/{want})")
            if not self.spin:
                cq.req_notify()
                got = cq.poll(64)
                if got:
                    out.extend(got)
                    continue
                select.select([cq.fileno()], [], [], 0.05)
                cq.ack_events()
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
    ep.spin = wait == "spin"
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
    while time.monotonic() < deadline:
        if select.select([ctl.sock], [], [], 0)[0]:
            break
        ep.cq.poll(16)
        if not ep.spin:
            select.select([ctl.sock, ep.cq.fileno()], [], [], 0.01)
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
        _recv_exact(sock, view)
        sock.sendall(view)
    return {"ok": True}


SERVER_OPS = {"setup": _srv_setup, "idle": _srv_idle, "stop": lambda state, ctl: None,
              "lat": _srv_lat, "tcp_stream": _srv_tcp_stream, "tcp_lat": _srv_tcp_lat}


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("TCP stream closed")
        got += n


# --------------------------------------------------------------------------- client


@dataclass
class Config:
    provider: str = "soft"
    progress: str = "thread"
    address: str = "127.0.0.1"
    sizes: list[int] = field(default_factory=lambda: [parse_size(s)
                                                      for s in DEFAULT_SIZES.split(",")])
    depth: int = 16
    bytes_per_test: int = 256 * MiB
    max_iters: int = 20000
    lat_iters: int = 1000
    runs: int = 3
    wait: str = "event"
    tests: tuple = ("write", "read", "tcp", "send_lat", "tcp_lat")


class Client:
    def __init__(self, cfg: Config, ctl: Control) -> None:
        self.cfg, self.ctl = cfg, ctl
        self.prov = make_provider(cfg.provider, cfg.progress)
        size = max(cfg.sizes)
        ctl.send(op="setup", provider=cfg.provider, progress=cfg.progress, address=cfg.address,
                 size=size, depth=cfg.depth, wait=cfg.wait)
        ports = ctl.recv()
        if ports is None or "error" in ports:
            raise RuntimeError(f"server setup: {ports}")
        cmid = self.prov.create_id()
        cmid.resolve(cfg.address, ports["rdma_port"])
        self.ep = Endpoint(self.prov, cmid, size, cfg.depth)
        self.ep.spin = cfg.wait == "spin"
        reply = cmid.connect(b"")
        self.remote_addr, self.rkey = SERVER_MR.unpack_from(reply)
        self.tcp = socket.create_connection((cfg.address, ports["tcp_port"]), timeout=WAIT_TIMEOUT)
        self.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        done = ctl.recv()
        if done is None or "error" in done:
            raise RuntimeError(f"server setup: {done}")

    def iters(self, size: int) -> int:
        return max(2 * self.cfg.depth, min(self.cfg.max_iters, self.cfg.bytes_per_test // size))

    # -- RDMA WRITE / READ bandwidth (ib_write_bw / ib_read_bw)
    def rdma_bw(self, opcode: WrOpcode, size: int, iters: int) -> dict:
        ep, depth = self.ep, self.cfg.depth
        sge = ep.sge(size)

        def wr(i: int) -> SendWR:
            return SendWR(i, opcode, sge, SendFlags.SIGNALED, self.remote_addr, self.rkey)

        need_idle = self.cfg.provider == "soft" and self.cfg.progress == "poll"
        if need_idle:     # the server's engine runs only when its owner polls
            self.ctl.send(op="idle", seconds=WAIT_TIMEOUT)
        try:
            for _ in range(2):                                       # warm-up
                ep.qp.post_send([wr(i) for i in range(depth)])
                ep.reap(depth)
            posted = min(depth, iters)
            t0 = time.perf_counter()
            ep.qp.post_send([wr(i) for i in range(posted)])
            done = 0
            while done < iters:
                n = len(ep.reap())
                done += n
                more = min(n, iters - posted)
                if more:
                    ep.qp.post_send([wr(posted + i) for i in range(more)])
                    posted += more
            elapsed = time.perf_counter() - t0
        finally:
            if need_idle:
                self.ctl.send(op="stop")     # wakes the idle loop: two answers
                self._done()
                self._done()
        return _bw(size, iters, elapsed)

    # -- the ceiling: a plain TCP stream, same sizes and messages in flight
    def tcp_bw(self, size: int, iters: int) -> dict:
        self.ctl.send(op="tcp_stream", size=size, iters=iters)
        self._ready()
        view = memoryview(self.ep.buf)[:size]
        ack = bytearray(TCP_ACK.size * 64)
        acked = sent = 0
        t0 = time.perf_counter()
        while sent < iters:
            if sent - acked >= self.cfg.depth:
                acked = self._tcp_acks(ack)
                continue
            self.tcp.sendall(view)
            sent += 1
        while acked < iters:
            acked = self._tcp_acks(ack)
        elapsed = time.perf_counter() - t0
        self._done()
        return _bw(size, iters, elapsed)

    def _tcp_acks(self, buf: bytearray) -> int:
        """Read the receiver's acknowledgements; return the newest count."""
        n = self.tcp.recv_into(buf)
        if not n:
            raise ConnectionError("TCP stream closed")
        while n % TCP_ACK.size:
            n += self.tcp.recv_into(memoryview(buf)[n:])
        return TCP_ACK.unpack_from(buf, n - TCP_ACK.size)[0]

    # -- SEND ping-pong latency (ib_send_lat)
    def send_lat(self, size: int, iters: int) -> dict:
        ep = self.ep
        self.ctl.send(op="lat", size=size, iters=iters)
        ep.qp.post_recv([RecvWR(0, ep.sge(size))])
        self._ready()
        samples = []
        for i in range(iters):
            t0 = time.perf_counter_ns()
            ep.qp.post_send([SendWR(1, WrOpcode.SEND, ep.sge(size))])
            got_recv = got_send = False
            while not (got_recv and got_send):
                for wc in ep.reap():
                    got_recv = got_recv or wc.wr_id == 0
                    got_send = got_send or wc.wr_id == 1
            samples.append(time.perf_counter_ns() - t0)
            if i + 1 < iters:
                ep.qp.post_recv([RecvWR(0, ep.sge(size))])
        self._done()
        return _lat(samples)

    def tcp_lat(self, size: int, iters: int) -> dict:
        self.ctl.send(op="tcp_lat", size=size, iters=iters)
        self._ready()
        view = memoryview(self.ep.buf)[:size]
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            self.tcp.sendall(view)
            _recv_exact(self.tcp, view)
            samples.append(time.perf_counter_ns() - t0)
        self._done()
        return _lat(samples)

    def _ready(self) -> None:
        reply = self.ctl.recv()
        if reply is None or "ready" not in reply:
            raise RuntimeError(f"server: {reply}")

    def _done(self) -> None:
        reply = self.ctl.recv()
        if reply is None or "error" in reply:
            raise RuntimeError(f"server: {reply}")

    def close(self) -> None:
        self.tcp.close()
        self.ep.close()
        if hasattr(self.prov, "close") and self.cfg.provider == "soft":
            self.prov.close()


def _bw(size: int, iters: int, elapsed: float) -> dict:
    total = size * iters
    return {"iters": iters, "seconds": elapsed, "MiB_s": total / elapsed / MiB,
            "Gb_s": total * 8 / elapsed / 1e9, "msg_s": iters / elapsed}


def _lat(samples_ns: list[int]) -> dict:
    """One-way latency as RTT/2 (ib_send_lat's convention), in microseconds."""
    us = sorted(s / 2000 for s in samples_ns)

    def pct(p: float) -> float:
        return us[min(len(us) - 1, int(p / 100 * len(us)))]

    return {"iters": len(us), "p50_us": pct(50), "p99_us": pct(99), "min_us": us[0],
            "msg_s": len(samples_ns) * 1e9 / max(1, sum(samples_ns))}   # exchanges per second


def run_all(cfg: Config, client: Client, log) -> dict:
    """Every size x run x test, the tests interleaved within a run so that a noisy machine
    weighs on the provider and on its TCP ceiling alike; medians per figure."""
    results: dict = {}
    for size in cfg.sizes:
        iters = client.iters(size)
        lat_iters = max(20, min(cfg.lat_iters, (64 * MiB) // size))
        runs: dict = {name: [] for name in cfg.tests}
        for _ in range(cfg.runs):
            for name in cfg.tests:
                if name == "write":
                    runs[name].append(client.rdma_bw(WrOpcode.RDMA_WRITE, size, iters))
                elif name == "read":
                    runs[name].append(client.rdma_bw(WrOpcode.RDMA_READ, size, iters))
                elif name == "tcp":
                    runs[name].append(client.tcp_bw(size, iters))
                elif name == "send_lat":
                    runs[name].append(client.send_lat(size, lat_iters))
                else:
                    runs[name].append(client.tcp_lat(size, lat_iters))
        row: dict = {}
        for name, got in runs.items():
            row[name] = {"median": {k: statistics.median(r[k] for r in got) for k in got[0]},
                         "runs": got}
            log(f"{human(size):>8} {name:<9} " + " ".join(
                f"{k}={v:.4g}" for k, v in row[name]["median"].items()))
        for name in ("write", "read"):
            if name in row and "tcp" in row:
                row[f"{name}_vs_tcp"] = row[name]["median"]["MiB_s"] / row["tcp"]["median"]["MiB_s"]
                row[f"{name}_vs_tcp_per_run"] = [
                    a["MiB_s"] / b["MiB_s"] for a, b in zip(runs[name], runs["tcp"])]
        results[size] = row
    return results


# --------------------------------------------------------------------------- report


def machine() -> dict:
    return {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "kernel": platform.release(), "python": platform.python_version(),
            "cpu": _cpu_model()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


#: Issue 14's acceptance for the soft provider: (size, goal, what the ratio is against).
ACCEPT_4K_VS_TCP_RR = 1.0     # 4 KiB message rate / a Python TCP request-response loop
ACCEPT_1M_VS_TCP_STREAM = 0.9  # 1 MiB bandwidth / a Python socket stream


def acceptance(results: dict) -> list[str]:
    """The two ratios of issue 14's acceptance, each PASS or FAIL (or why it is missing):
    the 4 KiB RDMA WRITE and READ message rates (``-t`` in flight) against a plain Python TCP
    request/response loop of 4 KiB (``tcp_lat``: exchanges per second, one at a time), and
    1 MiB WRITE and READ bandwidth against a Python socket stream (``tcp``)."""
    out = ["", "## Goal", "", "Issue 14's acceptance (both WRITE and READ must reach the goal):",
           ""]
    small, big = results.get(4 * KiB, {}), results.get(MiB, {})
    rates = {n: small[n]["median"]["msg_s"] for n in ("write", "read") if n in small}
    rr = small.get("tcp_lat", {}).get("median", {}).get("msg_s")
    if rates and rr:
        got = {n: r / rr for n, r in rates.items()}
        out.append(f"- 4 KiB message rate >= {ACCEPT_4K_VS_TCP_RR:g}x a Python TCP "
                   f"request/response loop of 4 KiB ({rr:.0f} exchanges/s): "
                   + ", ".join(f"{n.upper()} {rates[n]:.0f} msg/s = {g:.2f}x"
                               for n, g in got.items())
                   + f" -> **{_pass(min(got.values()) >= ACCEPT_4K_VS_TCP_RR)}**")
    else:
        out.append("- 4 KiB message rate vs a Python TCP request/response loop: not measured "
                   "(needs --sizes with 4K and --tests with write or read, and tcp_lat)")
    got = {n: big[f"{n}_vs_tcp"] for n in ("write", "read") if f"{n}_vs_tcp" in big}
    if got:
        out.append(f"- 1 MiB bandwidth >= {ACCEPT_1M_VS_TCP_STREAM:g}x a Python socket stream "
                   f"({big['tcp']['median']['MiB_s']:.0f} MiB/s): "
                   + ", ".join(f"{n.upper()} {g:.2f}x" for n, g in got.items())
                   + f" -> **{_pass(min(got.values()) >= ACCEPT_1M_VS_TCP_STREAM)}**")
    else:
        out.append("- 1 MiB bandwidth vs a Python socket stream: not measured (needs --sizes "
                   "with 1M and --tests with write or read, and tcp)")
    small_lat = small.get("send_lat", {}).get("median")
    if small_lat:
        out += ["", f"4 KiB SEND latency p50 {small_lat['p50_us']:.1f} us, p99 "
                f"{small_lat['p99_us']:.1f} us (RTT/2)"]
    return out


def _pass(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def render_md(cfg: Config, results: dict, command: str, before: dict, after: dict) -> str:
    out = [f"# rdma_bw: {cfg.provider} provider"
           + (f" ({cfg.progress} progress)" if cfg.provider == "soft" else ""),
           "",
           f"- command: `{command}`",
           f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
           f"- machine: {before['cpu']}, nproc {before['nproc']}, kernel {before['kernel']}, "
           f"Python {before['python']}",
           f"- load average before: {' '.join(f'{x:.2f}' for x in before['loadavg'])}; "
           f"after: {' '.join(f'{x:.2f}' for x in after['loadavg'])}",
           f"- address {cfg.address}, {cfg.depth} messages in flight (-t), median of "
           f"{cfg.runs} run(s), completion wait: {cfg.wait}",
           "- MiB/s = 2^20 bytes/s; Gb/s = 10^9 bit/s; latency = RTT/2 of a SEND ping-pong",
           "  (ib_send_lat's convention); `tcp` = plain TCP stream between the same two",
           "  processes (`sendall(memoryview)` -> `recv_into`), the soft provider's ceiling",
           "", "## Bandwidth", "",
           "| size | iters | WRITE MiB/s | WRITE Gb/s | WRITE msg/s | READ MiB/s | READ Gb/s "
           "| READ msg/s | TCP MiB/s | TCP Gb/s | WRITE/TCP | READ/TCP |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(row: dict, name: str, key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(row[name]["median"][key]) if name in row else "-"

    for size, row in results.items():
        iters = next((row[n]["median"]["iters"] for n in ("write", "read", "tcp") if n in row),
                     "-")
        out.append(" | ".join([
            f"| {human(size)}", f"{iters:.0f}" if iters != "-" else iters,
            cell(row, "write", "MiB_s"), cell(row, "write", "Gb_s", "{:.2f}"),
            cell(row, "write", "msg_s"), cell(row, "read", "MiB_s"),
            cell(row, "read", "Gb_s", "{:.2f}"), cell(row, "read", "msg_s"),
            cell(row, "tcp", "MiB_s"), cell(row, "tcp", "Gb_s", "{:.2f}"),
            f"{row['write_vs_tcp']:.2f}x" if "write_vs_tcp" in row else "-",
            f"{row['read_vs_tcp']:.2f}x" if "read_vs_tcp" in row else "-"]) + " |")
    out += ["", "## Latency (SEND ping-pong, RTT/2)", "",
            "| size | iters | send p50 us | send p99 us | TCP p50 us | TCP p99 us |",
            "|---:|---:|---:|---:|---:|---:|"]
    for size, row in results.items():
        if "send_lat" not in row and "tcp_lat" not in row:
            continue
        iters = next(row[n]["median"]["iters"] for n in ("send_lat", "tcp_lat") if n in row)
        out.append(" | ".join([
            f"| {human(size)}", f"{iters:.0f}",
            cell(row, "send_lat", "p50_us", "{:.1f}"), cell(row, "send_lat", "p99_us", "{:.1f}"),
            cell(row, "tcp_lat", "p50_us", "{:.1f}"), cell(row, "tcp_lat", "p99_us", "{:.1f}")])
            + " |")
    out += acceptance(results)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", choices=("soft", "verbs"), default="soft")
    ap.add_argument("--progress", choices=("thread", "poll"), default="thread",
                    help="soft provider: progress engine in a thread, or driven by CQ.poll")
    ap.add_argument("--address", default="127.0.0.1", help="RDMA/TCP address the server uses")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, e.g. 4K,64K,1M")
    ap.add_argument("-t", "--tx-depth", type=int, default=16, help="messages in flight")
    ap.add_argument("--bytes", default="256M", help="bytes moved per bandwidth measurement")
    ap.add_argument("-n", "--max-iters", type=int, default=20000)
    ap.add_argument("--lat-iters", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3, help="median of this many runs")
    ap.add_argument("--tests", default="write,read,tcp,send_lat,tcp_lat")
    ap.add_argument("--wait", choices=("auto", "spin", "event"), default="auto",
                    help="how to wait for completions (auto: event on soft, spin on verbs)")
    ap.add_argument("--quick", action="store_true", help="tiny run that proves it works")
    ap.add_argument("--out", help="markdown report path ('-': none); default "
                                  "benchmarks/results/rdma_bw-<date>-<provider>.md (+ .json)")
    ap.add_argument("--server", action="store_true", help="be the server (passive side)")
    ap.add_argument("--bind", default="127.0.0.1", help="server: control address")
    ap.add_argument("--ctl-port", type=int, default=0, help="server: control port")
    ap.add_argument("--connect", help="client: HOST:PORT of a server started by hand")
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    cfg = Config(provider=args.provider, progress=args.progress, address=args.address,
                 sizes=[parse_size(s) for s in args.sizes.split(",")], depth=args.tx_depth,
                 bytes_per_test=parse_size(args.bytes), max_iters=args.max_iters,
                 lat_iters=args.lat_iters, runs=args.runs,
                 tests=tuple(t.strip() for t in args.tests.split(",") if t.strip()))
    cfg.wait = args.wait if args.wait != "auto" else ("spin" if args.provider == "verbs"
                                                      else "event")
    if args.quick:
        cfg.sizes = [4 * KiB, MiB] if args.sizes == DEFAULT_SIZES else cfg.sizes
        cfg.bytes_per_test, cfg.max_iters, cfg.lat_iters, cfg.runs = 4 * MiB, 200, 20, 1
        cfg.depth = min(cfg.depth, 8)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server:
        _die_with_parent()
        serve(args.bind, args.ctl_port, lambda port: print(port, flush=True))
        return 0
    cfg = config_from(args)
    command = shlex.join(["benchmarks/rdma_bw.py", *(sys.argv[1:] if argv is None else argv)])
    server = None
    try:
        if args.connect:
            host, port = args.connect.rsplit(":", 1)
        else:
            server = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--server",
                 "--bind", cfg.address], stdout=subprocess.PIPE, text=True)
            host, port = cfg.address, server.stdout.readline().strip()
            if not port:
                raise RuntimeError("the server did not start")
        ctl = Control(socket.create_connection((host.strip("[]"), int(port)),
                                               timeout=WAIT_TIMEOUT))
        before = machine()
        client = Client(cfg, ctl)
        try:
            results = run_all(cfg, client, lambda line: print(line, flush=True))
        finally:
            client.close()
            ctl.close()
        after = machine()
    finally:
        if server is not None:
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    md = render_md(cfg, results, command, before, after)
    print(md)
    if args.out != "-":
        tag = cfg.provider + (f"-{cfg.progress}" if cfg.provider == "soft" else "")
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
            f"rdma_bw-{time.strftime('%Y-%m-%d')}-{tag}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        out.with_suffix(".json").write_text(json.dumps(
            {"command": command, "config": asdict(cfg), "machine_before": before,
             "machine_after": after,
             "results": {str(k): v for k, v in results.items()}}, indent=1) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

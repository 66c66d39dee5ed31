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

This file is the client and the command; the server and what both ends share are in
rdma_bw_peer.py, the Markdown report and the Goal section in rdma_bw_report.py.  The client
spawns the server unless ``--connect`` is given.  Each figure is the median of
``--runs`` runs.  Nothing here asserts speed: ``--quick`` exists so a test can keep it working.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # run as a script from a checkout
    sys.path.insert(0, str(ROOT))
from blockfabric.rdma import RecvWR, SendFlags, SendWR, WrOpcode  # noqa: E402
from rdma_bw_peer import (SERVER_MR, TCP_ACK, WAIT_TIMEOUT, Control, Endpoint, spin_for,  # noqa: E402
                          die_with_parent, recv_exact, make_provider, serve)
from rdma_bw_report import human, machine, render_md  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M"


def parse_size(text: str) -> int:
    """4K, 4KiB, 1M, 4096 -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


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
        self.ep.spin_s = spin_for(cfg.wait)
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
            recv_exact(self.tcp, view)
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
    ap.add_argument("--wait", choices=("auto", "spin", "adaptive", "event"), default="auto",
                    help="how to wait for completions: spin (busy-poll the CQ), event (sleep "
                         "on its fd), adaptive (busy-poll for as long as a reactor spins by "
                         "default, $BLOCKFABRIC_REACTOR_SPIN_US, then sleep); auto: "
                         "spin on verbs, adaptive on the soft provider's poll progress, "
                         "event on its thread progress")
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
    # auto: what the project's reactor does. It spins on verbs and the soft provider's poll
    # progress; not on its thread progress, whose engine thread a spin keeps from the GIL
    # (1 MiB READ 0.70x the socket stream, against 0.91x sleeping on the CQ's fd).
    cfg.wait = args.wait if args.wait != "auto" else (
        "spin" if args.provider == "verbs" else
        "event" if args.progress == "thread" else "adaptive")
    if args.quick:
        cfg.sizes = [4 * KiB, MiB] if args.sizes == DEFAULT_SIZES else cfg.sizes
        cfg.bytes_per_test, cfg.max_iters, cfg.lat_iters, cfg.runs = 4 * MiB, 200, 20, 1
        cfg.depth = min(cfg.depth, 8)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server:
        die_with_parent()
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

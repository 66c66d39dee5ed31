"""A test agent: one provider, driven by plain-data calls, in this process or in a peer.

The contract tests speak only to agents, so the same test runs with both ends in one process,
in two processes, or in two network namespaces.  Memory is named by MR handles and filled
from seeds; contents are compared by digest (a byte-for-byte check without shipping
megabytes through a pipe) or read back as hex for small ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from blockfabric.errors import ConnectionRejected, RdmaError
from blockfabric.rdma import (SGE, Access, QPCap, RecvWR, SendFlags, SendWR, WrOpcode,
                              get_provider)

REPO = Path(__file__).resolve().parents[2]


def make_provider(name: str, progress: str | None, shm: bool | None = None):
    """A fresh provider instance (the soft one with the requested progress mode, and
    same-host connections on or off: ``shm``)."""
    if name == "soft":
        from blockfabric.rdma.soft import SoftProvider
        return SoftProvider(progress=progress, shm=shm)
    return get_provider(name)


class _Conn:
    """One end of one connection with its PD, CQs and completions already reaped."""

    def __init__(self, cmid, pd, scq, rcq, qp) -> None:
        self.cmid, self.pd, self.scq, self.rcq, self.qp = cmid, pd, scq, rcq, qp
        self.reaped = {"send": [], "recv": []}
        self.mrs: list = []

    def cq(self, which: str):
        return self.scq if which == "send" else self.rcq

    def reap(self) -> None:
        for which in ("send", "recv"):
            self.reaped[which].extend(self.cq(which).poll(64))

    def close(self) -> None:
        for obj in (self.cmid, *self.mrs, self.scq, self.rcq, self.pd):
            try:
                obj.close()
            except Exception:  # noqa: BLE001  (best-effort teardown of a test's leftovers)
                pass


def _wc(wc) -> dict:
    return {"wr_id": wc.wr_id, "status": int(wc.status), "opcode": int(wc.opcode),
            "byte_len": wc.byte_len, "wc_flags": int(wc.wc_flags),
            "invalidated_rkey": wc.invalidated_rkey, "imm_data": wc.imm_data}


class AgentCore:
    """The provider side of an agent; ``call(op, **kw)`` runs ``op_<op>``."""

    def __init__(self, provider, progress: str | None = None, shm: bool | None = None,
                 shared: bool = False) -> None:
        """``provider``: a name, or a provider object shared with another agent; ``shared``:
        memory registered as "bytearray" or "mmap" comes from ``pd.shared_slab`` where the
        PD has it (what a same-host soft connection moves through shared memory)."""
        self.provider = (make_provider(provider, progress, shm) if isinstance(provider, str)
                         else provider)
        self.shared = shared
        self.conns: dict[int, _Conn] = {}
        self.mrs: dict[int, tuple] = {}
        self.listeners: dict[int, object] = {}
        self._next = 1
        self._connecting: dict[int, dict] = {}

    def _id(self) -> int:
        self._next += 1
        return self._next

    def call(self, op: str, **kw):
        try:
            return getattr(self, "op_" + op)(**kw)
        except RdmaError as exc:
            return {"rdma_error": str(exc), "errno": exc.errno}

    def pump(self) -> None:
        """Drive progress of every connection (needed with poll progress)."""
        for conn in list(self.conns.values()):
            conn.reap()

    def fds(self) -> list[int]:
        fds = set()
        # a copy: req_notify runs the engine in poll mode, which may settle a connection
        for conn in list(self.conns.values()):
            for cq in (conn.scq, conn.rcq):
                fds.add(cq.fileno())
                cq.req_notify()
        return sorted(fds)

    # ------------------------------------------------------------------ connections
    def _endpoint(self, cmid, cap: dict | None, sig_all: bool) -> _Conn:
        pd = cmid.context.alloc_pd()
        scq, rcq = cmid.context.create_cq(), cmid.context.create_cq()
        qp = cmid.create_qp(pd, scq, rcq, QPCap(**cap) if cap else None, sig_all)
        return _Conn(cmid, pd, scq, rcq, qp)

    def op_listen(self, address: str, port: int = 0) -> dict:
        lst = self.provider.listen(address, port)
        lid = self._id()
        self.listeners[lid] = lst
        return {"lid": lid, "port": lst.local_address[1]}

    def op_accept(self, lid: int, private_data: str = "", reject: bool = False,
                  cap: dict | None = None, sig_all: bool = False, timeout: float = 5.0,
                  rnr_retry: int = 7) -> dict:
        cmid = self.listeners[lid].get_request(timeout)
        if cmid is None:
            return {"timeout": True}
        seen = cmid.private_data.hex()
        if reject:
            cmid.reject(bytes.fromhex(private_data))
            cmid.close()
            return {"private_data": seen}
        conn = self._endpoint(cmid, cap, sig_all)
        cid = self._id()
        self.conns[cid] = conn
        kwargs = {"rnr_retry_count": rnr_retry} if rnr_retry != 7 else {}
        cmid.accept(bytes.fromhex(private_data), **kwargs)
        return {"cid": cid, "private_data": seen}

    def op_connect_start(self, address: str, port: int, private_data: str = "",
                         cap: dict | None = None, sig_all: bool = False, timeout: float = 5.0,
                         rnr_retry: int = 7) -> dict:
        """Connect in a thread: the passive side is driven by the same test meanwhile."""
        token = self._id()
        box: dict = {}
        self._connecting[token] = box

        def run() -> None:
            cmid = self.provider.create_id()
            try:
                cmid.resolve(address, port, timeout)
                conn = self._endpoint(cmid, cap, sig_all)
                reply = cmid.connect(bytes.fromhex(private_data), timeout=timeout,
                                     rnr_retry_count=rnr_retry)
            except ConnectionRejected as exc:
                cmid.close()
                box["result"] = {"rejected": exc.private_data.hex()}
            except RdmaError as exc:
                cmid.close()
                box["result"] = {"rdma_error": str(exc), "errno": exc.errno}
            else:
                cid = self._id()
                self.conns[cid] = conn
                box["result"] = {"cid": cid, "private_data": reply.hex()}

        box["thread"] = threading.Thread(target=run, daemon=True)
        box["thread"].start()
        return {"token": token}

    def op_connect_wait(self, token: int, timeout: float = 10.0) -> dict:
        box = self._connecting.pop(token)
        box["thread"].join(timeout)
        return box.get("result", {"timeout": True})

    def op_disconnect(self, cid: int) -> None:
        self.conns[cid].cmid.disconnect()

    def op_close(self, cid: int) -> None:
        self.conns.pop(cid).close()

    def op_reset(self) -> None:
        for cid in list(self.conns):
            self.op_close(cid)
        for lst in self.listeners.values():
            lst.close()
        self.listeners.clear()
        self.mrs.clear()

    def op_event(self, cid: int, timeout: float = 2.0):
        conn = self.conns[cid]
        deadline = time.monotonic() + timeout
        while True:
            conn.reap()   # poll-mode progress is what notices a dead peer
            event = conn.cmid.get_event(0.01)
            if event is not None:
                return int(event.type)
            if time.monotonic() >= deadline:
                return None

    def op_state(self, cid: int) -> int:
        self.conns[cid].reap()
        return int(self.conns[cid].qp.state)

    def op_qp_info(self, cid: int) -> dict:
        qp = self.conns[cid].qp
        return {"qp_num": qp.qp_num, "max_send_wr": qp.cap.max_send_wr,
                "max_recv_wr": qp.cap.max_recv_wr}

    # ------------------------------------------------------------------ memory
    def op_reg(self, cid: int, size: int, access: int, seed: int | None = None,
               kind: str = "bytearray") -> dict:
        conn = self.conns[cid]
        if self.shared and size and hasattr(conn.pd, "shared_slab"):
            buf = conn.pd.shared_slab(size)
        elif kind == "mmap":
            import mmap
            buf = mmap.mmap(-1, size)
        else:
            buf = bytearray(size)
        if seed is not None:
            buf[:] = random.Random(seed).randbytes(size)
        mr = conn.pd.reg_mr(buf, Access(access))
        conn.mrs.append(mr)
        mid = self._id()
        self.mrs[mid] = (mr, buf)
        return {"mid": mid, "addr": mr.addr, "length": mr.length, "lkey": mr.lkey,
                "rkey": mr.rkey, "access": int(mr.access)}

    def op_dereg(self, mid: int) -> None:
        self.mrs.pop(mid)[0].close()

    def op_fill(self, mid: int, seed: int) -> None:
        mr = self.mrs[mid][0]
        mr.buf[:] = random.Random(seed).randbytes(mr.length)

    def op_digest(self, mid: int, off: int = 0, n: int | None = None) -> str:
        mr = self.mrs[mid][0]
        end = mr.length if n is None else off + n
        return hashlib.sha256(mr.buf[off:end]).hexdigest()

    def op_read(self, mid: int, off: int, n: int) -> str:
        return bytes(self.mrs[mid][0].buf[off:off + n]).hex()

    def op_write(self, mid: int, off: int, data: str) -> None:
        raw = bytes.fromhex(data)
        self.mrs[mid][0].buf[off:off + len(raw)] = raw

    # ------------------------------------------------------------------ work requests
    def _sges(self, sges: list) -> list[SGE]:
        """[mid, offset, length] names registered memory; [addr, length, lkey] is raw."""
        out = []
        for s in sges:
            if isinstance(s, dict):
                out.append(SGE(s["addr"], s["length"], s["lkey"]))
            else:
                mr = self.mrs[s[0]][0]
                out.append(SGE(mr.addr + s[1], s[2], mr.lkey))
        return out

    def op_post_send(self, cid: int, wrs: list[dict]) -> dict:
        chain = [SendWR(wr_id=w.get("wr_id", 0), opcode=WrOpcode(w.get("opcode", 2)),
                        sg_list=self._sges(w.get("sges", [])),
                        send_flags=SendFlags(w.get("flags", int(SendFlags.SIGNALED))),
                        remote_addr=w.get("remote_addr", 0), rkey=w.get("rkey", 0),
                        invalidate_rkey=w.get("invalidate_rkey", 0),
                        imm_data=w.get("imm_data", 0)) for w in wrs]
        self.conns[cid].qp.post_send(chain)
        return {"ok": True}

    def op_post_recv(self, cid: int, wrs: list[dict]) -> dict:
        chain = [RecvWR(w.get("wr_id", 0), self._sges(w.get("sges", []))) for w in wrs]
        self.conns[cid].qp.post_recv(chain)
        return {"ok": True}

    def op_poll(self, cid: int, cq: str = "send", n: int = 1, timeout: float = 5.0) -> list:
        """Wait for ``n`` completions (fewer on timeout) on the send or recv CQ."""
        conn = self.conns[cid]
        got = conn.reaped[cq]
        deadline = time.monotonic() + timeout
        while len(got) < n:
            conn.reap()
            if len(got) >= n:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            the_cq = conn.cq(cq)
            the_cq.req_notify()
            got.extend(the_cq.poll(64))
            if len(got) < n:
                select.select([the_cq.fileno()], [], [], min(left, 0.01))
                the_cq.ack_events()
        out, conn.reaped[cq] = got[:n], got[n:]
        return [_wc(wc) for wc in out]


# ---------------------------------------------------------------------- front-ends


class LocalAgent:
    """An agent in this process."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def call(self, op: str, **kw):
        return self.core.call(op, **kw)

    def close(self) -> None:
        self.core.call("reset")


class RemoteAgent:
    """An agent in a peer process (``python -m tests.rdma.peer``), driven over a pipe."""

    def __init__(self, provider: str, progress: str | None, netns: str | None = None,
                 shm: bool | None = None, shared: bool = False) -> None:
        cmd = [sys.executable, "-m", "tests.rdma.peer", "--provider", provider]
        if progress:
            cmd += ["--progress", progress]
        if shm is not None:
            cmd += ["--shm" if shm else "--no-shm"]
        if shared:
            cmd += ["--shared"]
        if netns:
            cmd += ["--netns", netns]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"peer {cmd} died at start (exit {self.proc.wait()})")

    def call(self, op: str, **kw):
        self.proc.stdin.write(json.dumps({"op": op, "kw": kw}) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited ({self.proc.wait()}) during {op}")
        reply = json.loads(line)
        if "exception" in reply:
            raise RuntimeError(f"peer {op}: {reply['exception']}")
        return reply["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def serve(core: AgentCore, rfile, wfile) -> None:
    """The peer's loop: one JSON request per line; drive progress while idle."""
    wfile.write(json.dumps({"hello": os.getpid()}) + "\n")
    wfile.flush()
    rfd = rfile.fileno()
    while True:
        core.pump()
        ready, _, _ = select.select([rfd, *core.fds()], [], [], 0.05)
        if rfd not in ready:
            continue
        line = rfile.readline()
        if not line:
            return
        req = json.loads(line)
        try:
            reply = {"result": core.call(req["op"], **req["kw"])}
        except Exception as exc:  # noqa: BLE001  (reported to the test, which fails)
            reply = {"exception": f"{type(exc).__name__}: {exc}"}
        wfile.write(json.dumps(reply) + "\n")
        wfile.flush()

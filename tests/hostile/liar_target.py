"""A target that lies: NVMe/TCP spoken by hand (a thread per connection), each of its
answers a data attribute or a hook a test replaces, so that a test can make the host meet
what a broken or hostile target sends (tests/hostile/test_lying_target.py)."""

from __future__ import annotations

import socket
import struct
import threading
import time

from blockfabric.protocol import IdentifyController, IdentifyNamespace, LBAFormat
from blockfabric.protocol import tcp_pdu

NQN = "nqn.2026-12.io.blockfabric:liar"
CQE = struct.Struct("<QHHHH")


def word(sc: int = 0, sct: int = 0, dnr: bool = False) -> int:
    return ((sc | sct << 8) << 1) | (0x8000 if dnr else 0)


class Conn:
    def __init__(self, target: "LiarTarget", sock: socket.socket) -> None:
        self.target = target
        self.sock = sock
        self.qid = None
        self.lock = threading.Lock()
        self.aers: list[int] = []
        self.cc = 0

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def respond(self, cid: int, status: int = 0, result: int = 0) -> None:
        cqe = CQE.pack(result, 0, self.qid or 0, cid, status)
        self.send(bytes(tcp_pdu.capsule_resp(cqe, False)))

    def data(self, cid: int, payload: bytes) -> None:
        hdr = tcp_pdu.data_header(tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST, cid, 0, 0,
                                  len(payload), False, False)
        self.send(bytes(hdr) + payload)

    def run(self) -> None:
        try:
            ic = self._exact(128)
            assert ic[0] == tcp_pdu.ICREQ
            self.send(tcp_pdu.ICResp(maxh2cdata=0x20000).pack())
            while True:
                common = self._exact(8)
                ptype, flags, hlen, pdo, plen = struct.unpack("<BBBBI", common)
                rest = self._exact(plen - 8)
                pdu = common + rest
                if ptype == tcp_pdu.CAPSULE_CMD:
                    sqe = pdu[8:72]
                    data = pdu[pdo:plen] if pdo else b""
                    self.target.handle(self, sqe, data)
                elif ptype == tcp_pdu.H2C_DATA:
                    cccid, _t, off, ln = struct.unpack_from("<HHII", pdu, 8)
                    self.target.h2c(self, cccid, off, pdu[pdo:pdo + ln], flags)
                elif ptype == tcp_pdu.H2C_TERM:
                    return
        except (EOFError, OSError):
            return
        finally:
            try:
                self.sock.close()
            except OSError:
                pass


class LiarTarget:
    """Override the ``on_*`` hooks or the data attributes to lie."""

    def __init__(self) -> None:
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self.conns: list[Conn] = []
        self.sqes: list[tuple[int, bytes]] = []
        self.ctrl = IdentifyController(subnqn=NQN, cntlid=1, ioccsz=(64 + 8192) // 16,
                                       iorcsz=1, maxcmd=32, nn=4, sgls=0x100005, mdts=5)
        self.namespaces: dict[int, IdentifyNamespace] = {
            1: IdentifyNamespace(nsze=2048, ncap=2048, nuse=2048,
                                 lbaf=(LBAFormat(ms=0, ds=9, rp=0),),
                                 nguid=b"\x01" * 16)}
        self.ns_status: dict[int, int] = {}     # nsid -> status word for Identify NS
        self.ana: bytes | None = None
        self.pending_writes: dict = {}
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.lsock.accept()
            except OSError:
                return
            conn = Conn(self, sock)
            self.conns.append(conn)
            threading.Thread(target=conn.run, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.lsock.close()
        for c in self.conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
                c.sock.close()
            except OSError:
                pass

    # -- hooks ---------------------------------------------------------------
    def io(self, conn: Conn, sqe: bytes, data: bytes) -> None:
        opcode, _f, cid, nsid = struct.unpack_from("<BBHI", sqe)
        length = struct.unpack_from("<I", sqe, 32)[0] & 0xFFFFFF
        if opcode == 0x02:
            conn.data(cid, bytes(length))
            conn.respond(cid)
        elif opcode == 0x01:
            if data or not length:
                conn.respond(cid)
            else:           # R2T for all of it
                r2t = tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, 1, 0, length, False, False)
                self.pending_writes[(id(conn), cid)] = [length, 0]
                conn.send(bytes(r2t))
        else:
            conn.respond(cid)

    def h2c(self, conn: Conn, cid: int, off: int, payload: bytes, flags: int) -> None:
        st = self.pending_writes[(id(conn), cid)]
        st[1] += len(payload)
        if st[1] >= st[0]:
            del self.pending_writes[(id(conn), cid)]
            conn.respond(cid)

    def on_admin(self, conn: Conn, opcode: int, cid: int, sqe: bytes, data: bytes) -> bool:
        """Return True if handled (tests override)."""
        return False

    def on_fabrics(self, conn: Conn, fctype: int, cid: int, sqe: bytes, data: bytes) -> bool:
        return False

    def handle(self, conn: Conn, sqe: bytes, data: bytes) -> None:
        opcode, _f, cid, nsid = struct.unpack_from("<BBHI", sqe)
        self.sqes.append((conn.qid, sqe))
        if opcode == 0x7F:
            fctype = sqe[4]
            if self.on_fabrics(conn, fctype, cid, sqe, data):
                return
            if fctype == 0x01:      # Connect
                qid = struct.unpack_from("<H", sqe, 42)[0]
                conn.qid = qid
                conn.respond(cid, 0, 1 if qid == 0 else 0)
            elif fctype == 0x04:    # Property Get
                offset = struct.unpack_from("<I", sqe, 44)[0]
                value = {0: (1 << 24) | 127, 0x8: 0x10400, 0x14: conn.cc,
                         0x1C: (1 if conn.cc & 1 else 0) | (
                             (2 << 2) if conn.cc & (3 << 14) else 0)}.get(offset, 0)
                conn.respond(cid, 0, value)
            elif fctype == 0x00:    # Property Set
                offset = struct.unpack_from("<I", sqe, 44)[0]
                value = struct.unpack_from("<Q", sqe, 48)[0]
                if offset == 0x14:
                    conn.cc = value
                conn.respond(cid)
            else:
                conn.respond(cid, word(0x01, dnr=True))
            return
        if conn.qid:
            self.io(conn, sqe, data)
            return
        if self.on_admin(conn, opcode, cid, sqe, data):
            return
        if opcode == 0x06:          # Identify
            cns = sqe[40]
            length = struct.unpack_from("<I", sqe, 32)[0] & 0xFFFFFF
            if cns == 1:
                page = self.ctrl.pack()
            elif cns == 0:
                if nsid in self.ns_status:
                    conn.respond(cid, self.ns_status[nsid])
                    return
                ns = self.namespaces.get(nsid)
                page = ns.pack() if ns else bytes(4096)
            elif cns == 2:
                ids = sorted(n for n in set(self.namespaces) | set(self.ns_status) if n > nsid)
                page = struct.pack(f"<{len(ids)}I", *ids) + bytes(4096 - 4 * len(ids))
            else:
                page = bytes(4096)
            conn.data(cid, page[:length])
            conn.respond(cid)
        elif opcode == 0x09:        # Set Features
            fid = sqe[40]
            value = struct.unpack_from("<I", sqe, 44)[0]
            conn.respond(cid, 0, value if fid == 0x07 else 0)
        elif opcode == 0x0C:        # AER: held
            conn.aers.append(cid)
        elif opcode == 0x18:        # Keep Alive
            conn.respond(cid)
        elif opcode == 0x02:        # Get Log Page
            lid = sqe[40]
            numd = (struct.unpack_from("<I", sqe, 40)[0] >> 16) | (
                struct.unpack_from("<I", sqe, 44)[0] & 0xFFFF) << 16
            length = (numd + 1) * 4
            if lid == 0x0C and self.ana is not None:
                page = self.ana
            else:
                page = b""
            page = (page + bytes(length))[:length]
            conn.data(cid, page)
            conn.respond(cid)
        else:
            conn.respond(cid, word(0x01, dnr=True))

    def admin_conn(self) -> Conn:
        return next(c for c in self.conns if c.qid == 0)

    def complete_aer(self, result: int, status: int = 0) -> bool:
        conn = self.admin_conn()
        deadline = time.monotonic() + 5
        while not conn.aers and time.monotonic() < deadline:
            time.sleep(0.01)
        if not conn.aers:
            return False
        cid = conn.aers.pop(0)
        conn.respond(cid, status, result)
        return True


def connect_opts(target: LiarTarget, **kw):
    from blockfabric.initiator.host import ConnectOptions
    base = dict(traddr="127.0.0.1", subnqn=NQN, trsvcid=target.port, transport="tcp",
                nr_io_queues=1, queue_size=16, keep_alive_tmo=5.0, reconnect_delay=0.2,
                ctrl_loss_tmo=2.0, connect_timeout=2.0, arena_size=16 << 20)
    base.update(kw)
    return ConnectOptions(**base)

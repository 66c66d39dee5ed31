"""A hostile peer that speaks the soft provider's frame protocol by hand (the format is in
the ``blockfabric.rdma.soft`` docstring; the header is declared once in its ``wire``): no
QP, no MR, no checks of its own, so it can send what a real NIC never would."""

from __future__ import annotations

import socket

from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame


class RawPeer:
    """One TCP connection; ``connect_cm`` does CONN_REQ -> CONN_REP/REJ -> CONN_RTU."""

    def __init__(self, addr: tuple[str, int], source: str | None = None,
                 timeout: float = 5.0) -> None:
        self.sock = socket.socket()
        self.sock.settimeout(timeout)
        if source:
            self.sock.bind((source, 0))
        self.sock.connect(addr)
        self.psn = 0

    def send(self, ftype: int, payload: bytes = b"", **fields: int) -> None:
        fields.setdefault("length", len(payload))
        self.sock.sendall(wire.pack(ftype, **fields) + payload)

    def recv_frame(self) -> tuple[int, dict[str, int], bytes] | None:
        """(type, header fields, payload), or None once the other side closed."""
        head = self._exact(wire.HEADER_SIZE)
        if head is None:
            return None
        ftype, flags, psn, length, key, extra, addr = wire.unpack(head)
        payload = b""
        if ftype in wire.PAYLOAD_FRAMES and length:
            payload = self._exact(length) or b""
        return ftype, dict(flags=flags, psn=psn, length=length, key=key, extra=extra,
                           addr=addr), payload

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def connect_cm(self, private: bytes, qp_num: int = 0x4242) -> tuple[int, bytes]:
        """Send CONN_REQ; on CONN_REP answer CONN_RTU.  Returns (reply type, private data)."""
        self.send(Frame.CONN_REQ, private, extra=qp_num)
        frame = self.recv_frame()
        assert frame is not None, "the target closed the connection during CM"
        ftype, _fields, reply = frame
        if ftype == Frame.CONN_REP:
            self.send(Frame.CONN_RTU)
        return ftype, reply

    def request(self, ftype: int, payload: bytes = b"", **fields: int) -> None:
        """A request frame with the next PSN."""
        self.send(ftype, payload, psn=self.psn, **fields)
        self.psn += 1

    def closed_within(self, timeout: float) -> bool:
        """True once the target has torn the connection down (EOF or reset), reading and
        dropping whatever comes first."""
        self.sock.settimeout(timeout)
        try:
            while self.recv_frame() is not None:
                pass
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        self.sock.close()

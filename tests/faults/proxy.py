"""A small userspace TCP proxy for fault tests: added delay per chunk, cutting every live
connection, refusing new ones.  This kernel has no tc netem, so delay and cuts are done here.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

#: A test with a :class:`TcpProxy` in the host's path: what it forwards are the soft
#: provider's (or NVMe/TCP's) bytes; verbs traffic passes through no socket to cut.
THROUGH_A_PROXY = pytest.mark.needs_transport(
    "rdma", "a TCP proxy in the host's path cuts or delays its connections: verbs traffic "
    "passes through no socket (on verbs, a target SIGKILL, a pause and ctrl_loss_tmo are "
    "the faults these suites inject)")


class TcpProxy:
    """Forward 127.0.0.1:``port`` to ``target``; one thread per direction per connection."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0) -> None:
        self.target = target
        self.delay = delay
        self.refusing = False
        self.cuts = 0
        self.forwarded = 0          # bytes relayed either way (to wait for I/O through it)
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._lsock.accept()
            except OSError:
                return
            if self.refusing:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self.refusing:       # down() ran while this one was being set up:
                    _reset(client)      # it must not outlive the cut
                    _reset(upstream)
                    continue
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(chunk)
                self.forwarded += len(chunk)    # one thread per direction: += may race,
                # which only undercounts; callers wait for "some I/O", not an exact number
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _reset(s)

    def cut(self, refuse: bool = False) -> None:
        """Reset every live connection (both ends see the peer vanish); ``refuse``: and
        every new one from now on (set under the lock, so none slips in between)."""
        with self._lock:
            self.refusing = self.refusing or refuse
            conns, self._conns = self._conns, []
        for s in conns:
            _reset(s)
        self.cuts += 1

    def wait_forwarded(self, nbytes: int, timeout: float = 30.0) -> None:
        """Until ``nbytes`` more have gone through (I/O flows on this path)."""
        goal, deadline = self.forwarded + nbytes, time.monotonic() + timeout
        while self.forwarded < goal:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.forwarded} bytes through the proxy, no more")
            time.sleep(0.02)

    def down(self) -> None:
        """A dead path: cut what lives and refuse what comes."""
        self.cut(refuse=True)

    def up(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self._closed = True
        self._lsock.close()
        self.cut()


def _reset(s: socket.socket) -> None:
    """Close with RST; shutdown first so a thread blocked in recv on it wakes up."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass

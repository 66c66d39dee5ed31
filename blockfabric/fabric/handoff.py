"""The control channel between a target's coordinator and its poll-group workers.

One ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair per worker: each message is one packet (a
pickled tuple, whose first item names it) and may carry file descriptors (SCM_RIGHTS): a
connection's socket when an I/O queue is handed to a worker at its Connect.  Both ends are
this daemon's own processes (the worker is started by the coordinator with the channel as
an inherited descriptor), so the pickles are trusted; nothing a peer on the network sends
crosses this channel except the bytes of a connection already read and checked by the
coordinator (its ICReq and Connect), passed along as bytes.

Receiving runs on the reactor (non-blocking, every whole message of a wake-up); sending is
blocking (messages are small and the other end reads them on its loop) and serialised by a
lock, so a backend thread may send too.  See docs/scaling.md.
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import threading
from typing import Any, Callable

#: The largest message (a pickled configuration, a status snapshot of a worker).
MAX_MESSAGE = 4 << 20
MAX_FDS = 16


class ChannelClosed(OSError):
    """The other end of the channel is gone (its process exited)."""


class Channel:
    """One end of a coordinator <-> worker channel."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE)
        self._lock = threading.Lock()
        #: every message is received into this one buffer (recvmsg(MAX_MESSAGE) would
        #: allocate 4 MiB per message, a heap that grows by 4 MiB at the first one on a
        #: busy target); its pages become resident only as far as messages reach
        self._buf = bytearray(MAX_MESSAGE)
        self._recv_lock = threading.Lock()
        self.closed = False

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """A channel for this process and the socket to give the other one."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(mine), theirs

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: tuple[Any, ...], fds: tuple[int, ...] = ()) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"control message {msg[0]!r} of {len(data)} bytes")
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        with self._lock:
            if self.closed:
                raise ChannelClosed("control channel closed")
            try:
                self.sock.sendmsg([data], anc)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ChannelClosed(str(exc)) from exc

    def recv(self, block: bool) -> tuple[tuple[Any, ...], list[int]] | None:
        """One message and the descriptors it carried; None when none is waiting (not
        ``block``); ChannelClosed at the end."""
        flags = 0 if block else socket.MSG_DONTWAIT
        fds = array.array("i")
        with self._recv_lock:
            try:
                size, anc, msg_flags, _addr = self.sock.recvmsg_into(
                    [self._buf], socket.CMSG_SPACE(MAX_FDS * fds.itemsize), flags)
            except (BlockingIOError, InterruptedError):
                return None
            except (ConnectionResetError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc
            data = bytes(memoryview(self._buf)[:size])
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not data:
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("the other end closed the control channel")
        if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("control message truncated")
        return pickle.loads(data), list(fds)  # noqa: S301 (our own process's message)

    def serve(self, reactor: Any, handle: Callable[[tuple[Any, ...], list[int]], None],
              lost: Callable[[str], None]) -> None:
        """Read messages on ``reactor``: ``handle(msg, fds)`` each, ``lost(reason)`` once at
        the end of the channel."""
        def readable() -> None:
            while not self.closed:
                try:
                    got = self.recv(block=False)
                except ChannelClosed as exc:
                    self.close(reactor)
                    lost(str(exc))
                    return
                if got is None:
                    return
                handle(*got)
        reactor.add_reader(self.fileno(), readable)

    def close(self, reactor: Any = None) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if reactor is not None and not reactor.closed:
            reactor.remove_reader(self.fileno())
        self.sock.close()

"""Connection management of the soft provider: listener, CM ids, and the provider itself.

Connection set-up happens in the caller's thread over the socket that becomes the QP's
(REQ -> REP/REJ -> RTU, reading exactly each frame so nothing of the data stream is
consumed); once established the socket belongs to the device's progress engine.

Why one module of ~550 lines: the connection exchange (REQ, REP/REJ, RTU), the listener
that reads requests without trusting them (bounded pending requests, deadlines) and the
provider object that ties them to the device are one protocol; none is used alone.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque

from blockfabric.errors import ConnectionRejected, RdmaError, RdmaTimeout
from blockfabric.rdma.base import (MAX_PENDING_REQUESTS, REQUEST_TIMEOUT, CMEvent, CMEventType,
                                   CMId, DeviceInfo, Listener, Provider, QPCap)
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.device import SoftContext
from blockfabric.rdma.soft.memory import SoftPD
from blockfabric.rdma.soft.cq import SoftCQ
from blockfabric.rdma.soft.qp import DEFAULT_ACK_TIMEOUT, SoftQP
from blockfabric.rdma.soft.wire import Frame

PROGRESS_ENV = "BLOCKFABRIC_SOFT_PROGRESS"
#: "0" turns same-host connections through shared memory off (see SoftProvider)
SHM_ENV = "BLOCKFABRIC_SOFT_SHM"
#: How long a listener that cannot even shed (no descriptor at all) stops polling.
SHED_PAUSE = 0.1
#: An out-of-descriptors episode ends with the first accept this long after the last shortage.
SHED_QUIET = 1.0
_NO_FDS = (_errno.EMFILE, _errno.ENFILE, _errno.ENOBUFS, _errno.ENOMEM)

log = logging.getLogger(__name__)


def _reserve_fd() -> int | None:
    """A descriptor kept open so that, out of descriptors, one can be freed to accept and
    close a waiting connection (None if even this one cannot be had)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _check_private_data(data: bytes, limit: int, what: str) -> bytes:
    data = bytes(data)
    if len(data) > limit:
        raise RdmaError(f"{what} private data is {len(data)} B, at most {limit} B",
                        errno=_errno.EINVAL)
    return data


def shm_name(address: str, port: int) -> bytes:
    """The abstract unix socket beside a listener on ``address`` ``port``: a name in this
    network namespace's abstract namespace, so only a host that could reach the listener
    on that address here (the same network namespace) finds it."""
    return f"\0blockfabric-soft/{address}/{port}".encode()


def _unix_local(sock: socket.socket) -> tuple[str, int]:
    """The (address, port) of the listener a same-host socket was accepted by."""
    name = sock.getsockname()
    try:
        _, address, port = bytes(name).decode().split("/")
        return address, int(port)
    except (ValueError, UnicodeDecodeError):
        return "local", 0


def _peer_of(sock: socket.socket) -> tuple[str, int]:
    """An accepted socket's peer as an address: (address, port), or for a same-host peer
    ("local", its process id)."""
    if sock.family != socket.AF_UNIX:
        return sock.getpeername()[:2]
    pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET,
                                                           socket.SO_PEERCRED, 12))
    return "local", pid


def _tune(sock: socket.socket, user_timeout: float) -> None:
    """Latency first; a dead peer must surface as an error, not a hang."""
    if sock.family == socket.AF_UNIX:
        return                  # a dead peer process closes it: nothing to tune
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout * 1000))


def _recv_frame(sock: socket.socket, deadline: float) -> tuple[int, int, bytes]:
    """(type, extra, payload) of one CM frame, read exactly, blocking until ``deadline``."""
    def exact(n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("CM frame")
            sock.settimeout(left)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("peer closed during connection set-up (a peer "
                                           "of another soft-RDMA wire version closes "
                                           "without an answer)")
            got += k
        return bytes(buf)

    ftype, _flags, _psn, length, _key, extra, _addr, _ack = wire.decode(exact(wire.HEADER_SIZE))
    return ftype, extra, exact(length) if length else b""


def _cm_frame(ftype: Frame, private_data: bytes, qp_num: int = 0) -> bytes:
    return wire.pack(ftype, length=len(private_data), extra=qp_num) + private_data


class SoftCMId(CMId):
    def __init__(self, provider: "SoftProvider", sock: socket.socket | None = None,
                 private_data: bytes = b"") -> None:
        self.provider = provider
        # None until resolve() on the active side (the base class's contract: set by then)
        self.context = provider.context if sock is not None else None  # type: ignore[assignment]
        self.qp: SoftQP | None = None
        self.private_data = private_data
        self._sock = sock
        self._target: tuple | None = None
        self._source: str | None = None
        self._events: deque[CMEvent] = deque()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if sock is None:
            self.local_address = self.peer_address = ("", 0)
        else:
            self.local_address = (_unix_local(sock) if sock.family == socket.AF_UNIX
                                  else sock.getsockname()[:2])
            self.peer_address = _peer_of(sock)
        self.closed = False

    # active side ---------------------------------------------------------
    def resolve(self, address: str, port: int, timeout: float = 5.0,
                source: str | None = None) -> None:
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise RdmaError(f"cannot resolve {address}: {exc}",
                            errno=_errno.EADDRNOTAVAIL) from exc
        family, _, _, _, sockaddr = infos[0]
        self._target = (family, sockaddr)
        self._source = source
        self.context = self.provider.context

    def create_qp(self, pd: SoftPD[SoftContext], send_cq: SoftCQ,  # type: ignore[override]
                  recv_cq: SoftCQ, cap: QPCap | None = None,  # (this provider's own only)
                  sq_sig_all: bool = False) -> SoftQP:
        if self.context is None:
            raise RdmaError("create_qp before resolve()", errno=_errno.EINVAL)
        if self.qp is not None:
            raise RdmaError("this CM id already has a QP", errno=_errno.EINVAL)
        self.qp = SoftQP(self, pd, send_cq, recv_cq, cap, sq_sig_all)
        return self.qp

    def connect(self, private_data: bytes = b"", timeout: float = 5.0, retry_count: int = 7,
                rnr_retry_count: int = 7, *, ack_timeout: float = DEFAULT_ACK_TIMEOUT) -> bytes:
        """Connect (see :class:`CMId`); ``ack_timeout`` (soft only) is the transport timer
        per retry."""
        data = _check_private_data(private_data, wire.MAX_REQ_PRIVATE_DATA, "connect")
        if self._target is None or self.qp is None:
            raise RdmaError("connect needs resolve() and create_qp() first", errno=_errno.EINVAL)
        family, sockaddr = self._target
        deadline = time.monotonic() + timeout
        local = None if self._source else self.provider.connect_local(sockaddr, timeout)
        tcp = local is None
        sock = socket.socket(family, socket.SOCK_STREAM) if local is None else local
        try:
            if tcp:
                if self._source:
                    sock.bind((self._source, 0))
                sock.settimeout(timeout)
                sock.connect(sockaddr)
            sock.sendall(_cm_frame(Frame.CONN_REQ, data, self.qp.qp_num))
            ftype, _qpn, reply = _recv_frame(sock, deadline)
        except socket.timeout as exc:
            sock.close()
            raise RdmaTimeout(f"no answer from {sockaddr[0]} port {sockaddr[1]} in {timeout} s",
                              errno=_errno.ETIMEDOUT) from exc
        except ConnectionRefusedError as exc:
            sock.close()
            # what rdma_cm reports when no one listens: a REJ (invalid service id)
            raise ConnectionRejected(f"nothing listens on {sockaddr[0]} port {sockaddr[1]}",
                                     b"") from exc
        except (OSError, wire.WireError) as exc:
            sock.close()
            raise RdmaError(f"connect to {sockaddr[0]} port {sockaddr[1]}: {exc}",
                            errno=getattr(exc, "errno", None) or _errno.ECONNABORTED) from exc
        if ftype == Frame.CONN_REJ:
            sock.close()
            raise ConnectionRejected(f"{sockaddr[0]} port {sockaddr[1]} rejected the connection",
                                     reply)
        if ftype != Frame.CONN_REP:
            sock.close()
            raise RdmaError(f"unexpected CM frame {ftype}", errno=_errno.EPROTO)
        self.private_data = reply
        if tcp:
            self.local_address = sock.getsockname()[:2]
            self.peer_address = sock.getpeername()[:2]
        else:
            self.local_address, self.peer_address = ("local", os.getpid()), sockaddr[:2]
        sock.sendall(wire.pack(Frame.CONN_RTU))
        _tune(sock, ack_timeout * (retry_count + 1))
        self.qp.start(sock, rnr_retry_count, retry_count, ack_timeout)
        return reply

    # passive side --------------------------------------------------------
    def accept(self, private_data: bytes = b"", *, retry_count: int = 7,
               rnr_retry_count: int = 7, ack_timeout: float = DEFAULT_ACK_TIMEOUT) -> None:
        """Accept (see :class:`CMId`); the keywords are the passive side's own retry limits,
        as in rdma_accept's conn_param."""
        data = _check_private_data(private_data, wire.MAX_REP_PRIVATE_DATA, "accept")
        if self._sock is None or self.qp is None:
            raise RdmaError("accept needs a connect request and create_qp()", errno=_errno.EINVAL)
        sock, self._sock = self._sock, None
        try:
            sock.settimeout(5.0)
            sock.sendall(_cm_frame(Frame.CONN_REP, data, self.qp.qp_num))
        except OSError as exc:
            sock.close()
            raise RdmaError(f"accept: {exc}", errno=exc.errno) from exc
        _tune(sock, ack_timeout * (retry_count + 1))
        self.qp.start(sock, rnr_retry_count, retry_count, ack_timeout, passive=True)

    def reject(self, private_data: bytes = b"") -> None:
        data = _check_private_data(private_data, wire.MAX_REP_PRIVATE_DATA, "reject")
        if self._sock is None:
            raise RdmaError("reject needs a pending connect request", errno=_errno.EINVAL)
        sock, self._sock = self._sock, None
        try:
            sock.settimeout(5.0)
            sock.sendall(_cm_frame(Frame.CONN_REJ, data))
        except OSError:
            pass
        finally:
            sock.close()

    # both ----------------------------------------------------------------
    def disconnect(self) -> None:
        if self.qp is not None:
            self.qp.disconnect()
        elif self._sock is not None:
            self._sock.close()
            self._sock = None

    def on_disconnected(self, reason: object) -> None:
        """Called by the QP (lock held) when its connection ends for any reason."""
        if self.closed:
            return
        self._events.append(CMEvent(CMEventType.DISCONNECTED, 0, b""))
        os.eventfd_write(self._efd, 1)

    def get_event(self, timeout: float | None = 0) -> CMEvent | None:
        if not self._events and timeout != 0 and not self.closed:
            select.select([self._efd], [], [], timeout)
        try:
            os.eventfd_read(self._efd)
        except (BlockingIOError, OSError):
            pass
        if self._events:
            event = self._events.popleft()
            if self._events:
                os.eventfd_write(self._efd, 1)
            return event
        return None

    def fileno(self) -> int:
        return self._efd

    def close(self) -> None:
        if self.closed:
            return
        if self.qp is not None:
            self.qp.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.closed = True
        os.close(self._efd)


class SoftListener(Listener):
    """A TCP listener; connect requests are read here (in the caller's thread) without
    blocking on a slow client: half-read requests wait in this listener's own epoll.

    Everything a peer can make it hold is bounded: at most ``max_pending`` half-read
    requests (a new one pushes out the oldest), each for at most ``request_timeout``
    seconds.  When the process is out of file descriptors (EMFILE, ENFILE) the listener
    sheds instead of spinning: it frees a reserved descriptor, accepts and closes the
    waiting connection, and if even that fails stops polling the socket for a moment
    (:meth:`deadline` says when the owner should call :meth:`get_request` again).  Each
    such episode is logged once when it starts and once, with the count, when it ends."""

    def __init__(self, provider: "SoftProvider", address: str, port: int, backlog: int,
                 max_pending: int = MAX_PENDING_REQUESTS,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.provider = provider
        self.max_pending = max(1, max_pending)
        self.request_timeout = request_timeout
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise RdmaError(f"cannot resolve {address}: {exc}",
                            errno=_errno.EADDRNOTAVAIL) from exc
        family, _, _, _, sockaddr = infos[0]
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind(sockaddr)
            self._lsock.listen(backlog)
        except OSError as exc:
            self._lsock.close()
            raise RdmaError(f"listen on {address} port {port}: {exc}", errno=exc.errno) from exc
        self._lsock.setblocking(False)
        self.local_address = self._lsock.getsockname()[:2]
        self._ep = select.epoll()
        self._ep.register(self._lsock.fileno(), select.EPOLLIN)
        #: the same-host listener beside it (see SoftProvider), if shared memory is on
        self._usock: socket.socket | None = None
        if provider.shm:
            usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                usock.bind(shm_name(*self.local_address[:2]))
                usock.listen(backlog)
            except OSError as exc:
                usock.close()
                log.info("listener %s:%s: no same-host socket beside it (%s); same-host "
                         "hosts connect over TCP", *self.local_address[:2], exc)
            else:
                usock.setblocking(False)
                self._ep.register(usock.fileno(), select.EPOLLIN)
                self._usock = usock
        #: fd -> [sock, buffer, bytes wanted, deadline]; insertion order is age order
        self._pending: dict[int, list] = {}
        self._ready: deque[SoftCMId] = deque()
        self._reserve: int | None = _reserve_fd()
        self._paused_until: float | None = None     # listening socket out of the epoll
        self._shed = 0                              # connections shed this episode
        self._shed_since: float | None = None       # when the episode began
        self._short_at = 0.0                        # the last accept without a descriptor
        self._versions_refused: set[int] = set()    # wire versions refused (logged once)
        self.closed = False

    def get_request(self, timeout: float | None = 0) -> SoftCMId | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            self._expire()
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            wake = self.deadline()
            if wake is not None:
                until = max(0.0, wake - time.monotonic())
                left = until if left < 0 else min(left, until)
            for fd, _ev in self._ep.poll(left):
                if fd == self._lsock.fileno():
                    self._accept_all(self._lsock)
                elif self._usock is not None and fd == self._usock.fileno():
                    self._accept_all(self._usock)
                elif fd in self._pending:
                    self._read_request(fd)
            if deadline is not None and time.monotonic() >= deadline and not self._ready:
                self._expire()
                return None
        return self._ready.popleft()

    def deadline(self) -> float | None:
        """The oldest half-read request expires, or a pause after file descriptor
        exhaustion ends (see :meth:`Listener.deadline`)."""
        times = [t for t in (self._paused_until,) if t is not None]
        if self._pending:
            times.append(next(iter(self._pending.values()))[3])
        return min(times) if times else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            fd, entry = next(iter(self._pending.items()))
            if entry[3] > now:
                break
            self._drop(fd).close()
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            for lsock in self._listening():
                self._ep.register(lsock.fileno(), select.EPOLLIN)

    def _listening(self) -> list[socket.socket]:
        return [self._lsock] if self._usock is None else [self._lsock, self._usock]

    def _accept_all(self, lsock: socket.socket) -> None:
        while True:
            try:
                sock, _peer = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _NO_FDS:
                    if not self._out_of_fds(exc, lsock):
                        return
                    continue
                if exc.errno in (_errno.ECONNABORTED, _errno.EPROTO, _errno.EPERM):
                    continue                    # that one connection is gone; the next
                raise
            if self._shed_since is not None \
                    and time.monotonic() - self._short_at >= SHED_QUIET:
                log.warning("listener %s:%s: accepting again after shedding %d connection "
                            "requests in %.1f s (out of file descriptors)",
                            *self.local_address[:2], self._shed,
                            time.monotonic() - self._shed_since)
                self._shed, self._shed_since = 0, None
            if self._reserve is None:
                self._reserve = _reserve_fd()
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending))).close()   # the oldest makes room
            sock.setblocking(False)
            self._pending[sock.fileno()] = [sock, bytearray(), wire.HEADER_SIZE,
                                            time.monotonic() + self.request_timeout]
            self._ep.register(sock.fileno(), select.EPOLLIN)

    def _out_of_fds(self, exc: OSError, lsock: socket.socket) -> bool:
        """Shed one waiting connection: the oldest half-read request gives its descriptor
        back, else the reserved one does, so the connection can be accepted and closed.
        False (and the socket paused) when that is not possible."""
        self._short(exc)
        if self._pending:
            self._drop(next(iter(self._pending))).close()
            self._shed += 1
            return True
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
            try:
                lsock.accept()[0].close()
            except (BlockingIOError, InterruptedError):
                self._reserve = _reserve_fd()
                return False    # nothing waits any more
            except OSError:
                pass            # the freed descriptor went elsewhere: pause below
            else:
                self._shed += 1
                self._reserve = _reserve_fd()
                return True
            self._reserve = _reserve_fd()
        for other in self._listening():
            self._ep.unregister(other.fileno())
        self._paused_until = time.monotonic() + SHED_PAUSE
        return False

    def _short(self, exc: OSError) -> None:
        """A descriptor was wanted and there was none: an episode begins (logged once)."""
        self._short_at = time.monotonic()
        if self._shed_since is None:
            self._shed_since = self._short_at
            log.warning("listener %s:%s: out of file descriptors (%s): shedding connection "
                        "requests until there are some again", *self.local_address[:2],
                        _errno.errorcode.get(exc.errno or 0, exc.errno))

    def _drop(self, fd: int) -> socket.socket:
        self._ep.unregister(fd)
        return self._pending.pop(fd)[0]

    def _read_request(self, fd: int) -> None:
        entry = self._pending[fd]
        sock, buf, want, _deadline = entry
        try:
            chunk = sock.recv(want - len(buf))
            if not chunk:
                raise ConnectionResetError("closed before its connect request")
            buf += chunk
            if len(buf) < want:
                return
            ftype, _fl, _psn, length, _key, _qpn, _addr, _ack = wire.decode(buf)
            if ftype != Frame.CONN_REQ or length > wire.MAX_REQ_PRIVATE_DATA:
                raise wire.WireError(f"not a connect request (type {ftype}, {length} B)")
            if want == wire.HEADER_SIZE and length:
                entry[2] = wire.HEADER_SIZE + length
                return
        except BlockingIOError:
            return
        except wire.VersionError as exc:
            self._refuse_version(self._drop(fd), exc)
            return
        except (OSError, wire.WireError):
            self._drop(fd).close()
            return
        self._drop(fd)
        sock.setblocking(True)
        try:
            cmid = SoftCMId(self.provider, sock, bytes(buf[wire.HEADER_SIZE:]))
        except OSError as exc:          # no descriptor for its event fd: shed it
            sock.close()
            if exc.errno not in _NO_FDS:
                raise
            self._short(exc)
            self._shed += 1
            return
        self._ready.append(cmid)

    def _refuse_version(self, sock: socket.socket, exc: wire.VersionError) -> None:
        """A connect request in another version of the wire: refused in a way that version
        understands (a version-1 or -2 CONN_REJ, so an old host reports a rejection, not a
        reset),
        logged once per listener and version."""
        if exc.version not in self._versions_refused:
            self._versions_refused.add(exc.version)
            peer = "?"
            try:
                peer = "%s:%s" % tuple(_peer_of(sock))
            except OSError:
                pass
            log.warning("listener %s:%s: refused %s (%s); further ones are refused "
                        "silently", *self.local_address[:2], peer, exc)
        try:
            sock.recv(4096)     # its private data: unread bytes would turn the close into a reset
        except OSError:
            pass
        try:
            if exc.version == 1:
                sock.send(wire.pack_v1(Frame.CONN_REJ))     # 32 bytes: the buffer takes them
            elif exc.version == 2:                          # (the same header, then)
                sock.send(wire.pack(Frame.CONN_REJ, version=2))
        except OSError:
            pass
        finally:
            sock.close()

    def fileno(self) -> int:
        return self._ep.fileno()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in list(self._pending):
            self._drop(fd).close()
        for cmid in self._ready:
            cmid.close()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        self._ep.close()
        self._lsock.close()
        if self._usock is not None:
            self._usock.close()


class SoftProvider(Provider):
    """The soft RDMA provider.  ``progress``: "poll" (default: the engine runs inside
    ``CQ.poll``, i.e. on the thread that owns the completion queues, the reactor of a target
    or host) or "thread" (its own thread, for owners that do not poll); the environment
    variable BLOCKFABRIC_SOFT_PROGRESS sets the default.

    ``shm`` (default on; BLOCKFABRIC_SOFT_SHM=0 turns it off): same-host connections.  A
    listener also listens on an abstract unix socket named after its address and port
    (:func:`shm_name`), and a connect to an address of this network namespace goes there
    when it exists.  Over it both ends offer their shared regions (memory from
    ``pd.shared_slab`` registered for remote access) with SCM_RIGHTS, and RDMA WRITE and
    READ data to such a region is copied by the requester instead of crossing the socket;
    every request is still a frame, checked and acknowledged as on TCP."""

    name = "soft"

    def __init__(self, progress: str | None = None, shm: bool | None = None) -> None:
        self.progress = progress or os.environ.get(PROGRESS_ENV) or "poll"
        if self.progress not in ("thread", "poll"):
            raise ValueError(f"progress must be 'thread' or 'poll', not {self.progress!r}")
        self.shm = (os.environ.get(SHM_ENV, "1").strip().lower() not in ("0", "no", "false",
                                                                          "off")
                    if shm is None else shm)
        self._ctx: SoftContext | None = None
        self._ctx_lock = threading.Lock()

    @property
    def context(self) -> SoftContext:
        """The one device, soft0 (opened on first use; under a lock, since a multipath host
        resolves its paths in parallel threads, and two devices would split one host's
        queues between two engines)."""
        ctx = self._ctx
        if ctx is None or ctx.closed:
            with self._ctx_lock:
                ctx = self._ctx
                if ctx is None or ctx.closed:
                    ctx = self._ctx = SoftContext(self.progress)
        return ctx

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo("soft0", self.name, "",
                           [{"port": 1, "state": "ACTIVE", "link_layer": "TCP",
                             "progress": self.progress}])]

    def owns_address(self, address: str) -> bool:
        """True for any address of this host (soft needs nothing but a socket)."""
        try:
            infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return False
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(sockaddr)
            except OSError:
                return False
        return True

    def connect_local(self, sockaddr: tuple, timeout: float) -> socket.socket | None:
        """A same-host connection to the listener on ``sockaddr`` (see the class text), or
        None: shared memory off, no such listener here, or the address not of this network
        namespace (a listener on the unspecified address is used only for one that is)."""
        if not self.shm:
            return None
        address, port = str(sockaddr[0]), int(sockaddr[1])
        names = [shm_name(address, port)]
        if self.owns_address(address):
            names += [shm_name("0.0.0.0", port), shm_name("::", port)]
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(name)
            except OSError:
                sock.close()
                continue
            return sock
        return None

    def listen(self, address: str, port: int, backlog: int = 128, *,
               max_pending: int = MAX_PENDING_REQUESTS,
               request_timeout: float = REQUEST_TIMEOUT) -> SoftListener:
        return SoftListener(self, address, port, backlog, max_pending, request_timeout)

    def create_id(self) -> SoftCMId:
        return SoftCMId(self)

    def close(self) -> None:
        """Close the device (its progress thread and every connection)."""
        with self._ctx_lock:
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

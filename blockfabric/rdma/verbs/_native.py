"""What pyverbs does not expose, found without blocking and without a C extension.

pyverbs (44 on Debian 12, 59 upstream) gives no file descriptor for an rdma_cm event channel or
a completion channel, no ``id`` on a CM event and no addresses on a CM id.  A reactor needs the
descriptors, and demultiplexing the listener's channel (its children share it) needs the id an
event belongs to.  Both are recovered here:

* descriptors by comparing ``/proc/self/fd`` before and after creation (spec sheet section 12);
* C pointers held inside pyverbs objects by scanning the object's words once per class and
  *validating* each candidate against a value known by other means (the fd inside an
  ``rdma_event_channel``, the event type inside an ``rdma_cm_event``).  A layout that does not
  validate raises instead of guessing.

The C structures read here are librdmacm's public ABI (``rdma/rdma_cma.h``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, TypeVar

from blockfabric.errors import ProviderUnavailable, RdmaError

T = TypeVar("T")

PYVERBS_HINT = ("pyverbs not importable: apt-get install python3-pyverbs and use a venv made "
                "with --system-site-packages, or use --provider soft")
DEVICE_HINT = ("no RDMA device: load rdma_rxe and `rdma link add rxe0 type rxe netdev eth0` "
               "(and modprobe rdma_ucm ib_uverbs), or use --provider soft")

_pv: SimpleNamespace | None = None
_load_lock = threading.Lock()


def load() -> SimpleNamespace:
    """Import pyverbs on first use; its enum modules moved between releases (44 -> 59)."""
    global _pv
    with _load_lock:
        if _pv is not None:
            return _pv
        try:
            from pyverbs import cmid, cq, device, mr, pd, qp, wr   # the verbs' own names
            from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
        except ImportError as exc:
            raise ProviderUnavailable(f"{PYVERBS_HINT} ({exc})") from exc
        try:
            import pyverbs.libibverbs_enums as e           # pyverbs >= 59
        except ImportError:
            import pyverbs.enums as e                       # pyverbs 44
        try:
            import pyverbs.librdmacm_enums as ce           # pyverbs >= 59
        except ImportError:
            import pyverbs.cm_enums as ce                   # pyverbs 44
        _pv = SimpleNamespace(cmid=cmid, cq=cq, device=device, mr=mr, pd=pd, qp=qp, wr=wr, e=e,
                              ce=ce, PyverbsError=PyverbsError,
                              PyverbsRDMAError=PyverbsRDMAError)
        return _pv


def rdma_error(what: str, exc: BaseException) -> RdmaError:
    """Translate a pyverbs exception, keeping its errno."""
    code = getattr(exc, "error_code", None)
    if code is None:
        code = getattr(exc, "errno", None)
    return RdmaError(f"{what}: {exc}", errno=abs(code) if code else None)


def is_eagain(exc: BaseException) -> bool:
    code = getattr(exc, "error_code", None) or getattr(exc, "errno", None)
    return code is not None and abs(code) in (errno.EAGAIN, errno.EWOULDBLOCK)


# --------------------------------------------------------------------------- descriptors

_fd_lock = threading.Lock()


def _open_fds() -> dict[int, str]:
    """fd -> link target; the directory's own fd, closed by the time it is read, drops out."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return fds


def create_with_fd(create: Callable[[], T], link: str) -> tuple[T, int]:
    """Create an object that opens exactly one descriptor pointing at ``link``; return both.

    The descriptor is made non-blocking, so a read that finds nothing fails with EAGAIN
    instead of freezing every thread (pyverbs holds the GIL while it waits).
    """
    with _fd_lock:
        before = _open_fds()
        obj = create()
        after = _open_fds()
    new = {fd: target for fd, target in after.items() if before.get(fd) != target}
    found = [fd for fd, target in new.items() if target == link]
    if len(found) != 1:
        raise RdmaError(f"cannot find the descriptor of {type(obj).__name__}: {len(found)} new "
                        f"descriptors point at {link} (new: {new})")
    fd = found[0]
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    return obj, fd


# --------------------------------------------------------------------------- C pointers

_PAGE = 4096
_offsets: dict[tuple[type, str], int] = {}


def _word(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def c_pointer(obj: object, what: str, check: Callable[[int], bool]) -> int:
    """The C pointer field of a pyverbs object that satisfies ``check``.

    Cython keeps a cdef class's C fields after the PyObject header; the offset is found once per
    class (last word first, where pyverbs declares it) and cached.  Only aligned values above
    the first page are dereferenced by ``check``.
    """
    key = (type(obj), what)
    size = type(obj).__basicsize__
    candidates = [_offsets[key]] if key in _offsets else list(range(size - 8, 15, -8))
    for off in candidates:
        value = _word(id(obj) + off)
        if value > _PAGE and value % 8 == 0 and check(value):
            _offsets[key] = off
            return value
    raise RdmaError(f"unsupported pyverbs build: no {what} pointer found in {type(obj).__name__}")


def channel_pointer(channel: object, fd: int) -> int:
    """``struct rdma_event_channel *`` of a CMEventChannel (its first member is the fd)."""
    return c_pointer(channel, "rdma_event_channel",
                     lambda p: ctypes.c_int.from_address(p).value == fd)


def cm_id_pointer(cmid: object, channel_ptr: int) -> int:
    """``struct rdma_cm_id *`` of a CMID, recognised by its ``channel`` member (offset 8)."""
    return c_pointer(cmid, "rdma_cm_id", lambda p: _word(p + 8) == channel_ptr)


@dataclass(slots=True)
class RawEvent:
    """The parts of one ``struct rdma_cm_event`` that the provider uses."""

    type: int
    status: int
    id_ptr: int
    listen_ptr: int
    private_data: bytes
    responder_resources: int
    initiator_depth: int


# struct rdma_cm_event { rdma_cm_id *id; rdma_cm_id *listen_id; enum event; int status;
#   union { struct rdma_conn_param conn { const void *private_data; u8 private_data_len;
#   u8 responder_resources; u8 initiator_depth; ... }; ... } param; }
_EV_TYPE, _EV_STATUS, _EV_PDATA, _EV_PDATA_LEN = 16, 20, 24, 32


def read_event(event: Any) -> RawEvent:
    """Decode a pyverbs CMEvent through its C struct (its type validates the pointer)."""
    etype = event.event_type

    def check(p: int) -> bool:
        return ctypes.c_int.from_address(p + _EV_TYPE).value == etype
    p = c_pointer(event, "rdma_cm_event", check)
    data_ptr = _word(p + _EV_PDATA)
    length, resources, depth = ctypes.string_at(p + _EV_PDATA_LEN, 3)
    data = ctypes.string_at(data_ptr, length) if data_ptr and length else b""
    return RawEvent(type=etype, status=ctypes.c_int.from_address(p + _EV_STATUS).value,
                    id_ptr=_word(p), listen_ptr=_word(p + 8), private_data=data,
                    responder_resources=resources, initiator_depth=depth)


# struct rdma_cm_id { verbs*, channel*, context*, qp*, struct rdma_route route {
#   struct rdma_addr addr { sockaddr_storage src; sockaddr_storage dst; ...} ...} ...}
_ID_SRC, _ID_DST = 32, 32 + 128


def _sockaddr(address: int) -> tuple[str, int]:
    family = ctypes.c_uint16.from_address(address).value
    raw = ctypes.string_at(address, 28)
    port = struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    return "", 0


def id_addresses(id_ptr: int) -> tuple[tuple[str, int], tuple[str, int]]:
    """(local, peer) addresses of an rdma_cm_id, as rdma_get_local_addr/peer_addr give them."""
    return _sockaddr(id_ptr + _ID_SRC), _sockaddr(id_ptr + _ID_DST)


_librdmacm = None


def _rdmacm():
    global _librdmacm
    if _librdmacm is None:
        lib = ctypes.CDLL("librdmacm.so.1", use_errno=True)
        lib.rdma_bind_addr.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.rdma_resolve_route.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _librdmacm = lib
    return _librdmacm


def resolve_route(id_ptr: int, timeout_ms: int, address: str) -> None:
    """rdma_resolve_route through librdmacm itself.

    pyverbs' CMID.resolve_route then wraps the id's device (``id->verbs``, librdmacm's own
    device context, shared by every id of the process) in a pyverbs Context, whose finalizer
    calls ibv_close_device on it unless the CMID was closed first: collected in the wrong
    order, every later rdma_cm call on that device (the next connection's route) crashes.
    This provider opens its own device contexts and needs no such wrapper."""
    if _rdmacm().rdma_resolve_route(id_ptr, timeout_ms) != 0:
        code = ctypes.get_errno()
        raise RdmaError(f"rdma_resolve_route({address}) failed: {os.strerror(code)}",
                       errno=code)


def bind_addr(id_ptr: int, address: str | None, port: int) -> None:
    """rdma_bind_addr through librdmacm itself.

    pyverbs' CMID.bind_addr wraps the id's device in a Context right after binding; for a
    wildcard or loopback address no device is bound yet and that dereferences NULL (a
    segfault seen with pyverbs 44).  This provider opens its own device contexts, so it binds
    without pyverbs.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            address or "0.0.0.0", port, type=socket.SOCK_STREAM,
            flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise RdmaError(f"not a numeric IP address: {address!r}", errno=22) from exc
    host = str(sockaddr[0])
    if family == socket.AF_INET:
        raw = struct.pack("=H", family) + struct.pack("!H4s", port, socket.inet_aton(host))
    else:
        flowinfo, scope_id = sockaddr[2:4]  # type: ignore[misc]  # an AF_INET6 sockaddr
        raw = (struct.pack("=H", family) + struct.pack("!HI", port, flowinfo)
               + socket.inet_pton(socket.AF_INET6, host.split("%")[0])
               + struct.pack("=I", scope_id))
    raw = raw.ljust(128, b"\0")
    if _rdmacm().rdma_bind_addr(id_ptr, raw) != 0:
        code = ctypes.get_errno()
        raise RdmaError(f"rdma_bind_addr({address}:{port}) failed: {os.strerror(code)}",
                        errno=code)

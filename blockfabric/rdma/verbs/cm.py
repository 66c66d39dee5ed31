"""rdma_cm for the verbs provider: event channels, CM ids and listeners, never blocking.

pyverbs holds the GIL inside every call, so nothing here calls into it while an event could be
missing: event-channel descriptors are non-blocking and waits happen in ``select()``.  A
listener's children are created on the listener's channel (rdma_cm does that), so a
:class:`_Channel` reads every event, finds the ``rdma_cm_id`` it belongs to, and queues it
there.  Each CM id and listener exposes an epoll descriptor that wakes on its own queue and on
the shared channel (spurious wake-ups allowed, as the interface says).

QPs are external (created by :mod:`.resources` on our own device context) and moved through
INIT/RTR/RTS with ``rdma_init_qp_attr``, as rdma-core's tests/rdmacm_utils.py does: the passive
side before it accepts, the active side on CONNECT_RESPONSE, followed by ``rdma_establish``.

Teardown is explicit and ordered (QP, then CM id, then the event channel once no id is left on
it) and never left to pyverbs' finalizers: every channel and its ids stay referenced from
``_open`` until closed, so the collector never frees them in its own order (a CM id destroyed
after its channel, or a channel freed under a live id, is a SIGSEGV in librdmacm), and
whatever is still open at interpreter exit is closed in that order by ``_close_all``.

Why one module of ~700 lines: it is one adapter (rdma_cm through pyverbs) whose event
channel, CM ids and listeners share the rule that nothing blocks while holding the GIL;
split, that rule would be kept in several places.
"""

from __future__ import annotations

import atexit
import collections
import errno
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Callable

from blockfabric.errors import ConnectionAbandoned, ConnectionRejected, RdmaError, RdmaTimeout
from blockfabric.rdma import base
from blockfabric.rdma.base import CMEvent, CMEventType, QPCap
from blockfabric.rdma.verbs import _native
from blockfabric.rdma.verbs._native import RawEvent, rdma_error
from blockfabric.rdma.verbs.resources import VerbsContext, VerbsQP, external_qp

if TYPE_CHECKING:
    from blockfabric.rdma.verbs import VerbsProvider

log = logging.getLogger(__name__)

# IB CM reject reason "consumer defined": the peer called rdma_reject (with private data)
_REJ_CONSUMER = 28
# the IB CM's own reject reasons (IBTA 12.6.7.2) a connect meets most: the peer's CM refused
# it before any consumer saw it, and the private data of such a reject is not the peer's
_REJ_REASONS = {1: "no QP", 3: "no resources", 4: "timed out", 5: "unsupported request",
                6: "invalid communication id", 8: "no listener on that port",
                10: "stale connection", 13: "port redirected"}
# events that end a connect request before it was accepted: its host gave up
_ABANDONED = frozenset((CMEventType.REJECTED, CMEventType.CONNECT_ERROR,
                        CMEventType.UNREACHABLE, CMEventType.DISCONNECTED,
                        CMEventType.DEVICE_REMOVAL))
# events that only move the connection along and are consumed here, not handed to the user
_INTERNAL = {CMEventType.ESTABLISHED, CMEventType.TIMEWAIT_EXIT}
_KNOWN = frozenset(int(t) for t in CMEventType)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _Waker:
    """An epoll fd that is readable when the owner's queue has events or the channel may."""

    def __init__(self, channel_fd: int):
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep = select.epoll()
        self._ep.register(channel_fd, select.EPOLLIN)
        self._ep.register(self._r, select.EPOLLIN)

    def fileno(self) -> int:
        return self._ep.fileno()

    def set(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._ep.close()
        os.close(self._r)
        os.close(self._w)


#: Every event channel of this process not destroyed yet; each holds its ids (see the top).
_open: "set[_Channel]" = set()
_open_lock = threading.Lock()


def _close_all() -> None:
    """At interpreter exit: close every id and listener still open, in verbs order (each
    id's QP, the id, and last the channel), before finalizers run in any order.  A child
    process (fork) leaves its parent's ids alone: the descriptors are shared."""
    with _open_lock:
        channels = [c for c in _open if c.pid == os.getpid()]
    for channel in channels:
        # a listener's children first: they share its channel
        for endpoint in sorted(channel.endpoints, key=lambda e: isinstance(e, VerbsListener)):
            try:
                endpoint.close()
            except Exception as exc:  # noqa: BLE001  (exiting: the next one still goes)
                log.debug("rdma_cm: closing at exit: %s", exc)


atexit.register(_close_all)


class _Channel:
    """One rdma_cm event channel and the ids whose events arrive on it."""

    def __init__(self) -> None:
        pv = self._pv = _native.load()
        try:
            self.ch, self.fd = _native.create_with_fd(pv.cmid.CMEventChannel,
                                                      "/dev/infiniband/rdma_cm")
        except pv.PyverbsError as exc:
            raise rdma_error("rdma_create_event_channel failed (is rdma_ucm loaded?)",
                             exc) from exc
        self.ptr = _native.channel_pointer(self.ch, self.fd)
        self.lock = threading.RLock()
        self.owners: dict[int, "VerbsCMId"] = {}    # rdma_cm_id pointer -> owner
        self.listener: "VerbsListener | None" = None
        self.default: "VerbsCMId | None" = None     # an active id, before its pointer is known
        #: the ids and listener on this channel not destroyed yet (kept alive: see the top)
        self.endpoints: set[_Endpoint] = set()
        self.pid = os.getpid()
        self.destroyed = False
        with _open_lock:
            _open.add(self)

    def new_id(self):
        try:
            return self._pv.cmid.CMID(creator=self.ch, port_space=self._pv.ce.RDMA_PS_TCP)
        except self._pv.PyverbsError as exc:
            raise rdma_error("rdma_create_id failed", exc) from exc

    def pump(self) -> None:
        """Read every event the kernel has queued, without blocking, and hand each out.

        Whoever pumps (any id or listener on this channel) must not get another
        connection's trouble: an event whose handling fails ends only the connection it
        belongs to (see :meth:`VerbsCMId._fail`), a connect request that cannot be set up
        is dropped, both logged."""
        with self.lock:
            while True:
                try:
                    event = self._pv.cmid.CMEvent(self.ch)
                except self._pv.PyverbsError as exc:
                    if _native.is_eagain(exc):
                        return
                    raise rdma_error("rdma_get_cm_event failed", exc) from exc
                owner = None
                try:
                    raw = _native.read_event(event)
                    if raw.type == CMEventType.CONNECT_REQUEST and self.listener is not None:
                        self.listener._on_request(event, raw)
                    else:
                        owner = self.owners.get(raw.id_ptr, self.default)
                        if owner is not None:
                            owner._on_event(raw)
                except Exception as exc:  # noqa: BLE001  (contained to its connection)
                    if owner is not None:
                        owner._fail(exc)
                    else:
                        log.warning("rdma_cm: event dropped: %s: %s", type(exc).__name__, exc)
                finally:
                    # acked at once: rdma_destroy_id waits for every reported event's ack
                    event.close()

    def release(self, endpoint: "_Endpoint | None") -> None:
        """``endpoint``'s rdma_cm id is destroyed: once none is left, destroy the channel
        (an id outliving its channel is a use after free in librdmacm)."""
        with self.lock:
            self.endpoints.discard(endpoint)
            if self.endpoints or self.destroyed:
                return
            self.destroyed = True
            self.listener = None
            self.default = None
            self.ch.close()
        with _open_lock:
            _open.discard(self)


def _destroy_id(cm, what: str) -> bool:
    """rdma_destroy_id through pyverbs, now; False (logged) when it failed: the id is then
    still there and its channel must stay."""
    try:
        cm.close()
    except Exception as exc:  # noqa: BLE001  (teardown goes on; the caller keeps the channel)
        log.warning("rdma_cm: destroying %s failed: %s; its event channel is kept", what, exc)
        return False
    return True


class _Endpoint:
    """Shared by CM ids and listeners: an event queue filled by the channel, and its waits."""

    _channel: _Channel
    _waker: _Waker

    def _attach(self, channel: _Channel) -> None:
        self._channel = channel
        self._events: collections.deque = collections.deque()
        self._waker = _Waker(channel.fd)
        with channel.lock:
            channel.endpoints.add(self)

    def _queue(self, item) -> None:
        self._events.append(item)
        self._waker.set()

    def _next(self, timeout: float | None, accept: Callable = lambda item: True):
        """The next queued item ``accept`` allows, pumping the channel while waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._channel.pump()
            with self._channel.lock:
                for item in list(self._events):
                    if accept(item):
                        self._events.remove(item)
                        return item
                if not self._events:
                    self._waker.clear()
            left = _remaining(deadline)
            if left == 0:
                return None
            select.select([self._channel.fd, self._waker.fileno()], [], [], left)

    def fileno(self) -> int:
        return self._waker.fileno()

    def close(self) -> None:
        raise NotImplementedError


class VerbsCMId(_Endpoint, base.CMId):
    """One end of one RC connection over rdma_cm."""

    context: VerbsContext           # (None until bound to a device: see _set_device)
    _accepted = False               # (passive) rdma_accept done
    _closed = False                 # close() ran: the pyverbs id is destroyed (see _live)
    _abandoned: str | None = None   # (passive) why the host gave up before the accept

    def __init__(self, provider: "VerbsProvider", channel: _Channel, cmid, *,
                 id_ptr: int | None = None, private_data: bytes = b"",
                 request: RawEvent | None = None):
        self._provider = provider
        self._pv = _native.load()
        self._cm = cmid
        self._attach(channel)
        self.qp: VerbsQP | None = None
        self.context = None  # type: ignore[assignment]  # (until _set_device)
        self.private_data = private_data
        self.local_address = ("", 0)
        self.peer_address = ("", 0)
        self._request = request
        self._closed = False
        self._disconnected = False
        self._failed = False            # ended by _fail
        self._retry = (7, 7)            # retry_cnt, rnr_retry of our own QP
        self._ptr = id_ptr
        if id_ptr is not None:
            self._bind_ptr(id_ptr)

    # ------------------------------------------------------------------ plumbing
    def _live(self):
        """The pyverbs CM id, or RdmaError (EBADF) once closed: pyverbs leaves a destroyed
        id's pointer NULL and librdmacm would dereference it (rdma_reject after a failed
        accept closed the queue was a SIGSEGV of the whole target)."""
        if self._closed:
            raise RdmaError(f"the CM id of {self.peer_address} is closed", errno=errno.EBADF)
        return self._cm

    def _bind_ptr(self, id_ptr: int) -> None:
        self._ptr = id_ptr
        with self._channel.lock:
            self._channel.owners[id_ptr] = self

    def _set_device(self) -> None:
        """Called once the id is bound to a device: share that device's context."""
        self.context = VerbsContext(self._provider._device(self._live().dev_name))
        self.local_address, self.peer_address = _native.id_addresses(
            self._ptr)  # type: ignore[arg-type]  # (bound to a device: it has its pointer)

    def _on_event(self, raw: RawEvent) -> None:
        if raw.type not in _KNOWN:
            # ADDR_CHANGE, multicast events, future ones: this connection is no longer what
            # it was set up as; end it, as nvmet-rdma does on ADDR_CHANGE
            self._fail(RdmaError(f"unexpected rdma_cm event {raw.type} (status {raw.status})"))
            return
        if self._request is not None and not self._accepted and raw.type in _ABANDONED:
            self._abandoned = f"{_event_name(raw.type)}, status {raw.status}"
        if raw.type == CMEventType.DISCONNECTED:
            if self._disconnected:
                return                    # already reported when we disconnected ourselves
            self._disconnect_now()        # answers the peer's DREQ, so its side ends too
        if raw.type in _INTERNAL and self._request is not None:
            return
        self._queue(raw)

    def _fail(self, exc: BaseException) -> None:
        """Handling an event of this id failed: the connection is over (QP to ERR, a
        DISCONNECTED event for its owner), and only this one."""
        if self._failed:
            return
        self._failed = True
        log.warning("rdma_cm: connection %s ended: %s: %s", self.peer_address,
                    type(exc).__name__, exc)
        self._disconnected = True
        try:
            self._live().disconnect()
        except Exception:  # noqa: BLE001  (already gone, most likely)
            pass
        try:
            if self.qp is not None:
                self.qp.to_error()
        except Exception:  # noqa: BLE001
            pass
        self._queue(RawEvent(type=CMEventType.DISCONNECTED, status=0, id_ptr=self._ptr or 0,
                             listen_ptr=0, private_data=b"", responder_resources=0,
                             initiator_depth=0))

    def _disconnect_now(self) -> None:
        self._disconnected = True
        try:
            self._live().disconnect()
        except self._pv.PyverbsError as exc:
            # EINVAL: not connected (any more); the QP still goes to ERR below
            if abs(getattr(exc, "error_code", 0) or 0) != 22:
                raise rdma_error("rdma_disconnect failed", exc) from exc
        if self.qp is not None:
            self.qp.to_error()

    def _expect(self, wanted: CMEventType, deadline: float, what: str) -> RawEvent:
        raw = self._next(_remaining(deadline))
        if raw is None:
            raise RdmaTimeout(f"{what}: no rdma_cm event in time")
        if raw.type != wanted:
            name = _event_name(raw.type)
            raise RdmaError(f"{what}: got {name} (status {raw.status})",
                            errno=abs(raw.status) or None)
        return raw

    def _qp_attr(self, state: int, what: str):
        """(QPAttr, mask) of the transition to ``state``, from rdma_init_qp_attr."""
        e = self._pv.e
        try:
            attr, mask = self._live().init_qp_attr(state)
        except self._pv.PyverbsError as exc:
            raise rdma_error(f"rdma_init_qp_attr({what}) failed", exc) from exc
        if state == e.IBV_QPS_RTS:
            # rdma_cm hands each side the retry counts the *peer* asked for; the interface's
            # connect(retry_count, rnr_retry_count) means this side's sends, as on the soft
            # provider, so they are set here
            attr.retry_cnt, attr.rnr_retry = self._retry
            mask |= e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
        return attr, mask

    def _qp_to(self, state: int, what: str, qp: VerbsQP | None = None) -> None:
        attr, mask = self._qp_attr(state, what)
        (qp or self.qp).modify(attr, mask, what)  # type: ignore[union-attr]  # (after _need_qp)

    def _conn_param(self, private_data: bytes, resources: int, depth: int, retry: int = 7,
                    rnr_retry: int = 7, qp_num: int | None = None):
        # pyverbs sends private data only from a buffer sized by data_len at construction
        param = self._pv.cmid.ConnParam(resources=resources, depth=depth, retry=retry,
                                        rnr_retry=rnr_retry,
                                        qp_num=self.qp.qp_num if qp_num is None  # type: ignore[union-attr]
                                        else qp_num,
                                        data_len=len(private_data))
        if private_data:
            param.set_private_data(bytes(private_data))
        return param

    def _stale(self, what: str, exc: RdmaError | None = None) -> ConnectionAbandoned | None:
        """A connect request (not accepted yet) whose host gave up: an event said so, or
        the CM refused ``what`` with EINVAL (the kernel's id is no longer a pending request),
        after reading any event that explains it.  None otherwise."""
        if self._request is None or self._accepted:
            return None
        self._channel.pump()
        if self._abandoned is None and (exc is None or exc.errno != errno.EINVAL):
            return None
        why = self._abandoned or f"{what}: {exc}"
        return ConnectionAbandoned(f"connect request from {self.peer_address[0]}: the host "
                                   f"gave up before it was accepted ({why})",
                                   errno=exc.errno if exc is not None else None)

    def _checked(self, what: str, step: Callable):
        """``step()`` for a pending request: ConnectionAbandoned instead, or for its failure,
        when the request is stale."""
        stale = self._stale(what)
        if stale is not None:
            raise stale
        try:
            return step()
        except RdmaError as exc:
            stale = self._stale(what, exc)
            if stale is not None:
                raise stale from exc
            raise

    def _need_qp(self, what: str) -> None:
        if self.qp is None:
            raise RdmaError(f"{what}: create_qp() first", errno=22)

    # ------------------------------------------------------------------ interface
    def resolve(self, address: str, port: int, timeout: float = 5.0,
                source: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        ce = self._pv.ce
        ms = max(1, int(timeout * 1000))
        try:
            ai = self._pv.cmid.AddrInfo(src=source, dst=address, dst_service=str(port),
                                        port_space=ce.RDMA_PS_TCP)
            self._live().resolve_addr(ai, ms)
        except self._pv.PyverbsError as exc:
            raise rdma_error(f"rdma_resolve_addr({address}:{port}) failed", exc) from exc
        raw = self._expect(CMEventType.ADDR_RESOLVED, deadline, f"resolve {address}")
        self._bind_ptr(raw.id_ptr)
        _native.resolve_route(raw.id_ptr, ms, address)    # (not pyverbs': see there)
        self._expect(CMEventType.ROUTE_RESOLVED, deadline, f"route to {address}")
        self._set_device()

    def create_qp(self, pd: base.PD, send_cq: base.CQ, recv_cq: base.CQ,
                  cap: QPCap | None = None, sq_sig_all: bool = False) -> VerbsQP:
        if self.context is None:
            raise RdmaError("create_qp: resolve() first (no device yet)", errno=22)
        self.qp = self._checked("create_qp", lambda: external_qp(
            self.qp, pd, send_cq, recv_cq, cap, sq_sig_all,
            lambda qp: self._qp_to(self._pv.e.IBV_QPS_INIT, "INIT", qp)))
        return self.qp          # in INIT: receives may be posted from here

    def connect(self, private_data: bytes = b"", timeout: float = 5.0,
                retry_count: int = 7, rnr_retry_count: int = 7) -> bytes:
        self._need_qp("connect")
        deadline = time.monotonic() + timeout
        self._retry = (retry_count, rnr_retry_count)
        depth = self.context._device.max_rd_atom
        param = self._conn_param(private_data, depth, depth, retry_count, rnr_retry_count)
        try:
            self._live().connect(param)
        except self._pv.PyverbsError as exc:
            raise rdma_error("rdma_connect failed", exc) from exc
        raw = self._next(_remaining(deadline))
        if raw is None:
            raise RdmaTimeout(f"connect to {self.peer_address}: no answer in {timeout} s")
        if raw.type == CMEventType.REJECTED:
            why, data = _rejection(raw)
            raise ConnectionRejected(f"connect to {self.peer_address[0]} port "
                                     f"{self.peer_address[1]}: {why}", data)
        if raw.type == CMEventType.UNREACHABLE:
            raise RdmaTimeout(f"connect to {self.peer_address}: unreachable "
                              f"(status {raw.status})")
        if raw.type != CMEventType.CONNECT_RESPONSE:
            raise RdmaError(f"connect to {self.peer_address}: got {_event_name(raw.type)}"
                            f" (status {raw.status})", errno=abs(raw.status) or None)
        # INIT again, now that the connection exists: before connect() rdma_init_qp_attr
        # only knows the port, and grants no remote access at all; from the CM's state it
        # grants REMOTE_WRITE, and REMOTE_READ when the peer may read (librdmacm's own
        # ucma_modify_qp_rtr does the same).  Without it a peer's RDMA READ of our buffers
        # is NAKed "remote invalid request", which is how nvmet-rdma met our Connect.
        self._qp_to(self._pv.e.IBV_QPS_INIT, "INIT")
        self._qp_to(self._pv.e.IBV_QPS_RTR, "RTR")
        self._qp_to(self._pv.e.IBV_QPS_RTS, "RTS")
        try:
            self._live().establish()
        except self._pv.PyverbsError as exc:
            raise rdma_error("rdma_establish failed", exc) from exc
        self.private_data = raw.private_data
        return raw.private_data

    def _accept_depths(self) -> tuple[int, int]:
        """(resources, depth) of our answer to the request."""
        req = self._request
        ours = self.context._device.max_rd_atom
        # The request event reports the peer's numbers from *our* side (the IB CM swaps
        # them): initiator_depth is how many reads we may have outstanding at the peer (its
        # responder resources), responder_resources how many it will issue to us.  nvmet-rdma
        # sizes its own initiator depth the same way.  The Linux host offers responder
        # resources and asks for none: answering with depth 0 left its QP without
        # REMOTE_READ, and our RDMA READ of its Connect data was NAKed.
        depth = min(ours, req.initiator_depth) if req else ours
        resources = min(ours, req.responder_resources) if req else ours
        return resources, depth

    def accept(self, private_data: bytes = b"") -> None:
        """Raises ConnectionAbandoned when the host gave up on its request meanwhile."""
        self._need_qp("accept")
        resources, depth = self._accept_depths()

        def accept() -> None:
            self._qp_to(self._pv.e.IBV_QPS_RTR, "RTR")
            self._qp_to(self._pv.e.IBV_QPS_RTS, "RTS")
            try:
                self._live().accept(self._conn_param(private_data, resources, depth))
            except self._pv.PyverbsError as exc:
                raise rdma_error("rdma_accept failed", exc) from exc
        self._checked("accept", accept)
        self._accepted = True

    # ------------------------------------------------------------ a QP in another process
    def remote_qp_attrs(self) -> list[dict]:
        """INIT, RTR and RTS for a QP that another process creates on this id's device
        (poll groups, :mod:`.remote`): what :meth:`create_qp` and :meth:`accept` apply
        here, as plain fields, with this side's retry counts as in :meth:`_qp_to`."""
        from blockfabric.rdma.verbs.remote import dump_attr  # noqa: PLC0415
        e = self._pv.e
        return self._checked("rdma_init_qp_attr", lambda: [
            dump_attr(*self._qp_attr(state, what))
            for state, what in ((e.IBV_QPS_INIT, "INIT"), (e.IBV_QPS_RTR, "RTR"),
                                (e.IBV_QPS_RTS, "RTS"))])

    def accept_remote(self, qp_num: int, private_data: bytes = b"") -> None:
        """rdma_accept for the QP ``qp_num`` of another process (moved to RTS there with
        :meth:`remote_qp_attrs`); this id has no QP of its own."""
        if self.qp is not None:
            raise RdmaError("accept_remote: this CM id has a QP of its own", errno=22)
        resources, depth = self._accept_depths()

        def accept() -> None:
            try:
                self._live().accept(self._conn_param(private_data, resources, depth,
                                                 qp_num=qp_num))
            except self._pv.PyverbsError as exc:
                raise rdma_error("rdma_accept failed", exc) from exc
        self._checked("accept", accept)
        self._accepted = True

    def reject(self, private_data: bytes = b"") -> None:
        data = bytes(private_data)
        try:
            self._live().reject(data)
        except self._pv.PyverbsError as exc:
            raise rdma_error("rdma_reject failed", exc) from exc

    def disconnect(self) -> None:
        """Send the DREQ and report DISCONNECTED here at once.

        rdma_cm reports it only when the peer answers, which needs the peer's process to
        read its events; the connection is over from this side's view already.
        """
        if self._disconnected or self._closed:
            return
        with self._channel.lock:
            self._disconnect_now()
            self._queue(RawEvent(type=CMEventType.DISCONNECTED, status=0, id_ptr=self._ptr or 0,
                                 listen_ptr=0, private_data=b"", responder_resources=0,
                                 initiator_depth=0))

    def get_event(self, timeout: float | None = 0) -> CMEvent | None:
        raw = self._next(timeout)
        if raw is None:
            return None
        return CMEvent(type=CMEventType(raw.type), status=raw.status,
                       private_data=raw.private_data)

    def close(self) -> None:
        """Tear down in verbs order, each step whatever became of the one before: the QP,
        then the CM id, the device reference, and the channel once no id is left on it (an
        id that could not be destroyed keeps it: a leak, not a crash).  Idempotent; the
        first failure is raised once all of it is done."""
        if self._closed:
            return
        self._closed = True
        failed: BaseException | None = None
        channel = self._channel
        with channel.lock:              # no pump hands this id an event while it goes
            channel.owners.pop(self._ptr, None)  # type: ignore[arg-type]  # (None: none)
            if channel.default is self:
                channel.default = None
            if self.qp is not None:
                try:
                    self.qp.close()
                except Exception as exc:  # noqa: BLE001  (raised below, after the rest)
                    failed = exc
            destroyed = _destroy_id(self._cm, f"the CM id of {self.peer_address}")
        if self.context is not None:
            try:
                self.context.close()
            except Exception as exc:  # noqa: BLE001
                failed = failed or exc
        self._waker.close()
        if destroyed:
            channel.release(self)
        if failed is not None:
            raise failed


class VerbsListener(_Endpoint, base.Listener):
    """A listening rdma_cm id; connect requests become child :class:`VerbsCMId` objects."""

    def __init__(self, provider: "VerbsProvider", address: str, port: int, backlog: int,
                 max_pending: int = base.MAX_PENDING_REQUESTS):
        pv = self._pv = _native.load()
        self._provider = provider
        self.max_pending = max(1, max_pending)
        self._refused = 0               # requests refused in this episode (logged once)
        self._refused_at = 0.0          # the last of them
        channel = _Channel()
        self._closed = False
        self._cm = None
        try:
            self._attach(channel)
        except BaseException:
            channel.release(None)
            raise
        channel.listener = self
        try:
            self._cm = channel.new_id()
            ptr = _native.cm_id_pointer(self._cm, channel.ptr)
            _native.bind_addr(ptr, address, port)
            self._cm.listen(backlog)
        except (pv.PyverbsError, RdmaError) as exc:
            self.close()
            if isinstance(exc, RdmaError):
                raise
            raise rdma_error(f"cannot listen on {address}:{port}", exc) from exc
        self.local_address = _native.id_addresses(ptr)[0]

    def _on_request(self, event, raw: RawEvent) -> None:
        """A connect request: queued for :meth:`get_request`, unless ``max_pending`` wait
        already or its resources (descriptors, a device context) cannot be had; then it is
        rejected at once, never left half-made, and the episode is logged once."""
        child = self._pv.cmid.CMID(creator=event, listen_id=self._cm)
        why = None
        if len(self._events) >= self.max_pending:
            why = f"{len(self._events)} requests wait already"
        else:
            try:
                cmid = VerbsCMId(self._provider, self._channel, child, id_ptr=raw.id_ptr,
                                 private_data=raw.private_data, request=raw)
            except (OSError, RdmaError) as exc:
                why = str(exc)
            else:
                try:
                    cmid._set_device()
                except (OSError, RdmaError) as exc:
                    why = str(exc)
                    try:
                        cmid.reject()
                    except RdmaError:
                        pass
                    cmid.close()
                    child = None
        if why is None:
            # the episode ends with a request taken a second after the last refusal
            if self._refused and time.monotonic() - self._refused_at >= 1.0:
                log.warning("listener %s: taking connection requests again after refusing "
                            "%d", self.local_address, self._refused)
                self._refused = 0
            self._queue(cmid)
            return
        if not self._refused:
            log.warning("listener %s: refusing connection requests: %s", self.local_address,
                        why)
        self._refused += 1
        self._refused_at = time.monotonic()
        if child is not None:
            try:
                child.reject(b"")
            except self._pv.PyverbsError:
                pass
            child.close()

    def get_request(self, timeout: float | None = 0) -> VerbsCMId | None:
        return self._next(timeout)

    def close(self) -> None:
        """Close the listening id; children already handed out stay usable."""
        if self._closed:
            return
        self._closed = True
        while self._events:                      # requests nobody took: refuse them
            child = self._events.popleft()
            try:
                child.reject()
            except RdmaError:
                pass
            try:
                child.close()
            except Exception as exc:  # noqa: BLE001  (the listener still goes)
                log.debug("listener %s: closing a request: %s", self.local_address, exc)
        with self._channel.lock:
            self._channel.listener = None
            destroyed = self._cm is None or _destroy_id(self._cm, "a listening CM id")
        self._waker.close()
        if destroyed:
            self._channel.release(self)


def _rejection(raw: RawEvent) -> tuple[str, bytes]:
    """Why a connect was rejected, and the peer's reject data (empty when the peer's CM, not
    its consumer, refused: then the data is only the padding of the REJ message).  iWARP
    reports a reject as -ECONNREFUSED, the peer's data (if any) with it."""
    data = raw.private_data
    if raw.status == _REJ_CONSUMER or (raw.status < 0 and any(data)):
        return "rejected by the target", data
    if raw.status < 0:
        return f"refused ({os.strerror(-raw.status)}; no listener on that port?)", b""
    reason = _REJ_REASONS.get(raw.status, "see the IB CM reject reasons")
    return f"refused by the peer's RDMA CM: {reason} (reject reason {raw.status})", b""


def _event_name(value: int) -> str:
    try:
        return CMEventType(value).name
    except ValueError:
        return f"event {value}"

"""The verbs provider's teardown order, refusals and stale requests (issue 19), without an
RDMA device: pyverbs' CM id, event channel and QP are modelled by objects that record what
is done to them, so the provider's own bookkeeping runs as it does on a device.
tests/lab/verbsfix.sh checks the same on rxe (no SIGSEGV, the reasons, ConnectionAbandoned).

A CM id destroyed after its event channel, or a channel destroyed under a live id, is a use
after free in librdmacm: the target crashed with SIGSEGV in reconnect tests when a failed
QP close skipped the id's destroy but not the channel's, or when the collector freed an
unclosed id's pyverbs objects in its own order.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
import types
import weakref

import pytest

from blockfabric.errors import ConnectionAbandoned, RdmaError
from blockfabric.rdma.base import CMEventType
from blockfabric.rdma.verbs import cm
from blockfabric.rdma.verbs._native import RawEvent
from blockfabric.rdma.verbs.cm import VerbsCMId, VerbsListener, _Channel


class Recorded:
    """A pyverbs object whose close() is written to ``log`` (and may fail)."""

    def __init__(self, log: list[str], name: str, fail: BaseException | None = None) -> None:
        self.log, self.name, self.fail = log, name, fail

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail is not None:
            raise self.fail


class RecordedId(Recorded):
    """A pyverbs CMID: reject and disconnect are written to ``log`` too (on a destroyed id,
    pyverbs hands librdmacm a NULL id: a SIGSEGV of the process, never an exception)."""

    def reject(self, data: bytes = b"") -> None:
        self.log.append(f"{self.name}.reject")

    def disconnect(self) -> None:
        self.log.append(f"{self.name}.disconnect")


def _channel(log: list[str]) -> _Channel:
    ch = _Channel.__new__(_Channel)
    ch._pv = types.SimpleNamespace(PyverbsError=RuntimeError)
    ch.ch = Recorded(log, "channel")
    ch.fd = os.eventfd(0, os.EFD_CLOEXEC)
    ch.lock = threading.RLock()
    ch.owners = {}
    ch.listener = None
    ch.default = None
    ch.endpoints = set()
    ch.pid = os.getpid()
    ch.destroyed = False
    with cm._open_lock:
        cm._open.add(ch)
    return ch


def _cmid(channel: _Channel, log: list[str], name: str, *, qp_fail=None, cm_fail=None,
          request: RawEvent | None = None) -> VerbsCMId:
    cmid = VerbsCMId.__new__(VerbsCMId)
    cmid._pv = types.SimpleNamespace(PyverbsError=RuntimeError)
    cmid._cm = RecordedId(log, f"{name}.id", cm_fail)
    cmid.qp = Recorded(log, f"{name}.qp", qp_fail)     # type: ignore[assignment]
    cmid.context = Recorded(log, f"{name}.context")    # type: ignore[assignment]
    cmid._request = request
    cmid._closed = False
    cmid._ptr = id(cmid)
    cmid.peer_address = ("10.99.0.2", 4420)
    cmid._attach(channel)
    channel.owners[cmid._ptr] = cmid
    return cmid


def _listener(channel: _Channel, log: list[str]) -> VerbsListener:
    listener = VerbsListener.__new__(VerbsListener)
    listener._cm = Recorded(log, "listener.id")
    listener._closed = False
    listener.local_address = ("10.99.0.1", 4420)
    listener._attach(channel)
    channel.listener = listener
    return listener


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    with cm._open_lock:
        for ch in [c for c in cm._open if isinstance(c.ch, Recorded)]:
            cm._open.discard(ch)


def test_close_goes_qp_then_id_then_channel_once_no_id_is_left():
    log: list[str] = []
    channel = _channel(log)
    a, b = _cmid(channel, log, "a"), _cmid(channel, log, "b")
    a.close()
    assert log == ["a.qp", "a.id", "a.context"]          # b still uses the channel
    a.close()                                            # idempotent
    b.close()
    assert log == ["a.qp", "a.id", "a.context", "b.qp", "b.id", "b.context", "channel"]
    assert channel not in cm._open


def test_a_failing_qp_close_still_destroys_the_id_before_the_channel():
    log: list[str] = []
    channel = _channel(log)
    cmid = _cmid(channel, log, "a", qp_fail=RdmaError("ibv_destroy_qp failed", errno=16))
    with pytest.raises(RdmaError, match="ibv_destroy_qp"):
        cmid.close()                          # the failure is still reported, afterwards
    assert log == ["a.qp", "a.id", "a.context", "channel"]


def test_an_id_that_cannot_be_destroyed_keeps_its_channel():
    log: list[str] = []
    channel = _channel(log)
    cmid = _cmid(channel, log, "a", cm_fail=RuntimeError("rdma_destroy_id: EBUSY"))
    cmid.close()                               # logged; a leak, not a use after free
    assert log == ["a.qp", "a.id", "a.context"]
    assert "channel" not in log and channel in cm._open


def test_unclosed_ids_are_never_left_to_the_collector():
    log: list[str] = []
    channel = _channel(log)
    cmid = _cmid(channel, log, "a")
    ref = weakref.ref(cmid)
    del cmid, channel
    gc.collect()
    assert ref() is not None and log == []    # referenced from cm._open until closed


def test_at_exit_children_then_the_listener_then_the_channel():
    log: list[str] = []
    channel = _channel(log)
    listener = _listener(channel, log)
    _cmid(channel, log, "child")
    other = _channel(log)
    other.pid = os.getpid() + 1               # a fork's copy of its parent's: left alone
    _cmid(other, log, "parents")
    cm._close_all()
    assert log == ["child.qp", "child.id", "child.context", "listener.id", "channel"]
    assert listener._closed


def test_a_closed_id_is_never_handed_to_librdmacm_again():
    """A failed accept closes the queue (and its id), then the listener rejects the
    request: that reject, and a disconnect, must not reach pyverbs' destroyed id."""
    log: list[str] = []
    cmid = _cmid(_channel(log), log, "a")
    cmid._disconnected = False
    cmid.close()
    with pytest.raises(RdmaError, match="closed") as exc:
        cmid.reject(b"")
    assert exc.value.errno == errno.EBADF
    cmid.disconnect()                          # the connection is over already: nothing
    assert not any(step.endswith((".reject", ".disconnect")) for step in log), log


def test_at_exit_a_request_nobody_took_is_not_rejected_after_its_close():
    log: list[str] = []
    channel = _channel(log)
    listener = _listener(channel, log)
    listener._events.append(_cmid(channel, log, "pending"))   # queued, never taken
    cm._close_all()                            # children first: "pending" is closed
    assert "pending.id.reject" not in log
    assert log[-2:] == ["listener.id", "channel"] and listener._closed


def test_an_id_whose_setup_failed_goes_before_its_channel(monkeypatch):
    """create_id: the pyverbs id exists, then our object cannot be made (no descriptor
    for its waker): the id is destroyed first, and then the channel."""
    import blockfabric.rdma.verbs as verbs
    log: list[str] = []
    channel = _channel(log)
    channel.new_id = lambda: RecordedId(log, "new.id")      # type: ignore[method-assign]
    monkeypatch.setattr(verbs, "_Channel", lambda: channel)

    def no_waker(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(verbs, "VerbsCMId", no_waker)
    with pytest.raises(OSError, match="Too many"):
        verbs.VerbsProvider.create_id(object.__new__(verbs.VerbsProvider))
    assert log == ["new.id", "channel"]


def _request(abandoned_by: CMEventType | None) -> tuple[VerbsCMId, list[RawEvent]]:
    log: list[str] = []
    channel = _channel(log)
    request = RawEvent(type=CMEventType.CONNECT_REQUEST, status=0, id_ptr=1, listen_ptr=2,
                       private_data=bytes(32), responder_resources=0, initiator_depth=0)
    cmid = _cmid(channel, log, "req", request=request)
    pending = []
    if abandoned_by is not None:
        # what the kernel reports on the child id when the host destroys its id (REJ)
        pending.append(RawEvent(type=abandoned_by, status=4, id_ptr=cmid._ptr, listen_ptr=0,
                                private_data=b"", responder_resources=0, initiator_depth=0))
    channel.pump = lambda: [cmid._on_event(pending.pop()) for _ in list(pending)]  # type: ignore[method-assign]
    cmid._disconnect_now = lambda: None       # type: ignore[method-assign]
    return cmid, pending


def test_a_request_whose_host_gave_up_is_abandoned_not_accepted():
    cmid, _ = _request(CMEventType.REJECTED)
    with pytest.raises(ConnectionAbandoned, match="gave up.*REJECTED"):
        cmid._checked("accept", lambda: pytest.fail("accepted a stale request"))


def test_einval_from_the_cm_on_a_pending_request_is_abandonment():
    cmid, _ = _request(None)

    def accept():
        raise RdmaError("rdma_accept failed: Invalid argument", errno=errno.EINVAL)
    with pytest.raises(ConnectionAbandoned, match="rdma_accept failed"):
        cmid._checked("accept", accept)
    cmid._accepted = True                     # an accepted connection's EINVAL is its own
    with pytest.raises(RdmaError) as info:
        cmid._checked("accept", accept)
    assert not isinstance(info.value, ConnectionAbandoned)


def test_other_failures_of_a_live_request_stay_what_they_are():
    cmid, _ = _request(None)

    def accept():
        raise RdmaError("rdma_accept failed: No memory", errno=errno.ENOMEM)
    with pytest.raises(RdmaError) as info:
        cmid._checked("accept", accept)
    assert not isinstance(info.value, ConnectionAbandoned)
    assert cmid._checked("accept", lambda: "ok") == "ok"


def _rejected(status: int, data: bytes) -> RawEvent:
    return RawEvent(type=CMEventType.REJECTED, status=status, id_ptr=1, listen_ptr=0,
                    private_data=data, responder_resources=0, initiator_depth=0)


@pytest.mark.parametrize("status, data, says, kept", [
    # the peer's CM: nothing listens there (IB/RoCE), the REJ's 148 B are only padding
    (8, bytes(148), "no listener on that port (reject reason 8)", b""),
    (28, b"\x00\x00\x06\x00".ljust(148, b"\0"), "rejected by the target", None),  # rdma_reject
    (-111, b"\x00\x00\x06\x00", "rejected by the target", None),        # iWARP, with data
    (-111, b"", "Connection refused; no listener on that port?", b""),  # iWARP, a RST
])
def test_a_rejected_connect_says_who_refused_and_why(status, data, says, kept):
    why, private = cm._rejection(_rejected(status, data))
    assert says in why
    assert private == (data if kept is None else kept)

"""One connection's trouble stays its own on the verbs provider too (issue 13, isolation),
runnable without an RDMA device: pyverbs' event channel and completions are modelled.

Every CM id of a listener shares one rdma_cm event channel, and whichever id or listener
reads it hands each event to its owner; an event whose handling failed used to raise out of
that read, into another connection's wait.  A completion with a status newer than this
interface raised out of ``poll``, losing the whole polled batch."""

from __future__ import annotations

import collections
import logging
import types

from blockfabric.rdma.base import CMEventType, WcStatus
from blockfabric.rdma.verbs import _native, cm
from blockfabric.rdma.verbs._native import RawEvent
from blockfabric.rdma.verbs.cm import VerbsCMId, _Channel
from blockfabric.rdma.verbs.resources import _to_wc


class Again(Exception):
    pass


class FakeEvent:
    def __init__(self, raw: RawEvent) -> None:
        self.raw = raw
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeWaker:
    def set(self) -> None:
        pass


def _channel(events: list[FakeEvent]) -> _Channel:
    pending = collections.deque(events)

    def next_event(_ch):
        if not pending:
            raise Again()
        return pending.popleft()
    ch = _Channel.__new__(_Channel)
    ch._pv = types.SimpleNamespace(cmid=types.SimpleNamespace(CMEvent=next_event),
                                   PyverbsError=Exception)
    ch.ch = None
    ch.lock = __import__("threading").RLock()
    ch.owners = {}
    ch.listener = None
    ch.default = None
    return ch


def _cmid(channel: _Channel, ptr: int, disconnect=lambda: None) -> VerbsCMId:
    cmid = VerbsCMId.__new__(VerbsCMId)
    cmid._pv = types.SimpleNamespace(PyverbsError=RuntimeError)
    cmid._cm = types.SimpleNamespace(disconnect=disconnect)
    cmid._channel = channel
    cmid._events = collections.deque()
    cmid._waker = FakeWaker()
    cmid._disconnected = cmid._failed = False
    cmid._request = None
    cmid._ptr = ptr
    cmid.qp = types.SimpleNamespace(to_error=lambda: None)
    cmid.peer_address = ("10.99.0.%d" % ptr, 4420)
    channel.owners[ptr] = cmid
    return cmid


def _raw(kind: int, ptr: int) -> RawEvent:
    return RawEvent(type=kind, status=0, id_ptr=ptr, listen_ptr=0, private_data=b"",
                    responder_resources=0, initiator_depth=0)


def test_an_event_that_fails_ends_only_its_own_connection(monkeypatch, caplog):
    def broken():
        raise RuntimeError("rdma_disconnect: EIO")

    events = [FakeEvent(_raw(CMEventType.DISCONNECTED, 1)),      # its handling raises
              FakeEvent(_raw(14, 2)),                               # ADDR_CHANGE
              FakeEvent(_raw(CMEventType.DISCONNECTED, 3))]
    channel = _channel(events)
    monkeypatch.setattr(_native, "read_event", lambda event: event.raw)
    monkeypatch.setattr(_native, "is_eagain", lambda exc: isinstance(exc, Again))
    monkeypatch.setattr(cm, "rdma_error", lambda what, exc: exc)
    one, two, three = _cmid(channel, 1, broken), _cmid(channel, 2), _cmid(channel, 3)
    with caplog.at_level(logging.WARNING):
        channel.pump()                       # the pump of any id: nothing escapes it
    assert all(e.closed for e in events)     # every event acknowledged
    for cmid in (one, two, three):
        assert [e.type for e in cmid._events] == [CMEventType.DISCONNECTED], cmid._ptr
    assert len([r for r in caplog.records if "ended" in r.getMessage()]) == 2


def test_a_completion_status_newer_than_the_interface_is_a_general_error():
    wc = types.SimpleNamespace(wr_id=5, status=23, opcode=0, wc_flags=0, byte_len=0,
                               qp_num=0xABCDEF, imm_data=0, vendor_err=0x99)
    out = _to_wc(wc)
    assert (out.wr_id, out.status, out.vendor_err) == (5, WcStatus.GENERAL_ERR, 0x99)

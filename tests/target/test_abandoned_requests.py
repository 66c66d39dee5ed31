"""A connect request whose host gave up before the target accepted it (issue 19): the accept
fails (on verbs as ConnectionAbandoned, see blockfabric.rdma.verbs.cm), and nothing of the
queue may stay behind: it was counted, registered and waiting for a Connect until
limits.connect_timeout, and the failure was logged as a traceback.  A real soft listener,
host and target queue; the stale accept is what verbs reports on rxe (tests/lab/verbsfix.sh
checks it there end to end, with the target stopped while the kernel host gives up)."""

from __future__ import annotations

import logging
import threading
import types

import pytest

from blockfabric.errors import ConnectionAbandoned
from blockfabric.fabric.reactor import Reactor
from blockfabric.protocol.cm import CMConnectRequest
from blockfabric.rdma import QPCap, get_provider
from blockfabric.target.broker import BufferBroker
from blockfabric.target.config import loads
from blockfabric.target.listeners import Listeners
from blockfabric.target.registry import ControllerRegistry
from blockfabric.target.sessions import QueueSession

CONFIG = loads("listeners:\n  - {transport: rdma, provider: soft, address: 127.0.0.1, "
               "port: 4420}\n")


@pytest.fixture
def listeners():
    reactor = Reactor("test")
    broker = BufferBroker(reactor, lambda: CONFIG, lambda *args: None)
    registry = ControllerRegistry(broker, lambda: (1, 0xFFEF))
    lst = Listeners(reactor, lambda: CONFIG, registry, broker,
                    lambda lconf, provider, req: QueueSession(
                        types.SimpleNamespace(), lconf, provider, req))
    yield lst
    broker.stop()
    broker.close()


def _request(provider, port: int):
    """A host's connect request, taken by the target's listener; the host waits for the
    answer in a thread (and is closed by the caller)."""
    host = provider.create_id()
    host.resolve("127.0.0.1", port)
    pd = host.context.alloc_pd()
    cq = host.context.create_cq(16)
    host.create_qp(pd, cq, cq, QPCap(max_send_wr=4, max_recv_wr=4))
    data = CMConnectRequest(recfmt=0, qid=1, hrqsize=32, hsqsize=31, cntlid=1).pack()
    thread = threading.Thread(target=lambda: _ignore(host.connect, data, 5.0), daemon=True)
    thread.start()
    return host, (pd, cq), thread


def _ignore(call, *args):
    try:
        call(*args)
    except Exception:  # noqa: BLE001  (the host's side is not what is tested)
        pass


def test_an_abandoned_request_leaves_no_queue_and_the_next_is_served(listeners, caplog):
    provider = get_provider("soft")
    listener = provider.listen("127.0.0.1", 0)
    lconf = CONFIG.listeners[0]
    host, parts, thread = _request(provider, listener.local_address[1])
    try:
        cmid = listener.get_request(5)
        assert cmid is not None

        def stale_accept(private_data=b""):
            raise ConnectionAbandoned("connect request from 127.0.0.1: the host gave up "
                                      "before it was accepted (REJECTED, status 4)")
        cmid.accept = stale_accept
        requests = iter([cmid, None])
        taken = types.SimpleNamespace(get_request=lambda timeout=0: next(requests),
                                      deadline=lambda: None)
        with caplog.at_level(logging.INFO, logger="blockfabric.target.listeners"):
            listeners._on_requests(lconf, "soft", taken)
        assert listeners.registry.sessions == set()     # not counted, no Connect awaited
        assert listeners.abandoned == 1
        assert cmid.closed
        assert "abandoned (1 so far)" in caplog.text and "Traceback" not in caplog.text
        assert not any(r.exc_info for r in caplog.records)
        # the next host is served
        host2, parts2, thread2 = _request(provider, listener.local_address[1])
        cmid2 = listener.get_request(5)
        requests = iter([cmid2, None])
        listeners._on_requests(lconf, "soft", taken)
        thread2.join(5)
        assert len(listeners.registry.sessions) == 1 and host2.qp is not None
        for session in list(listeners.registry.sessions):
            listeners.registry.close_queue(session)
        host2.close()
        for part in parts2:
            part.close()
    finally:
        host.close()
        thread.join(5)
        for part in parts:
            part.close()
        listener.close()

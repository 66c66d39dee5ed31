"""The verbs provider's teardown, refusals and stale requests on a real device (issue 19).

Runs inside the lab guest (tests/lab/verbsfix.sh), server and client in one process as
tests/lab/verbs_smoke.py does.  Usage: verbs_fixes.py CASE [IP]; exit status 0 when it held.

  teardown   pairs of connections torn down every way a target meets: closed with the QP's
             close failing, dropped without close() (the garbage collector finds them in a
             cycle), and left open at interpreter exit; the process must exit 0, not SIGSEGV
             (it did on main's code too: the crash of the reconnect tests took another path
             or luck; this keeps the orders that are known to be safe exercised)
  refused    connect to a port nothing listens on, and a connect the peer rejects with an
             NVMe-oF reject status: each ConnectionRejected says which it was
  stale      a connect request whose host gave up before the target took it: the accept
             fails as ConnectionAbandoned, the id is gone, the listener serves the next one
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verbs_smoke  # noqa: E402
from verbs_smoke import CONNECT_PD, End, check, client_connect, failures  # noqa: E402

from blockfabric import errors  # noqa: E402
from blockfabric.errors import ConnectionRejected, RdmaTimeout  # noqa: E402
from blockfabric.protocol.cm import CMReject, CMRejectStatus  # noqa: E402
from blockfabric.rdma import get_provider  # noqa: E402

ConnectionAbandoned = getattr(errors, "ConnectionAbandoned", errors.RdmaError)

CASE = sys.argv[1] if len(sys.argv) > 1 else "teardown"
IP = verbs_smoke.IP = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("LAB_IP", "10.99.0.1")


def pair(provider, listener):
    """(client End, server End) of one established connection."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(c=client_connect(
        provider, listener.local_address[1], CONNECT_PD)))
    t.start()
    req = listener.get_request(timeout=20)
    srv = End(req)
    srv.post_recv()
    req.accept(b"")
    t.join(30)
    return box["c"][0], srv


def teardown() -> None:
    provider = get_provider("verbs")
    listener = provider.listen(IP, 0)
    # 1. the QP's close fails: the CM id and its channel must still be destroyed, in order
    cli, srv = pair(provider, listener)
    real = srv.qp.close
    calls = []

    def failing_close():
        calls.append(1)
        real()
        raise OSError("QP close failed (injected)")
    srv.qp.close = failing_close  # type: ignore[method-assign]
    try:
        srv.cmid.close()
    except OSError as exc:
        print(f"     close raised {exc}", flush=True)
    check(calls == [1], "the QP close ran")
    cli.close()
    # 2. dropped without close(): id, channel and QP in a reference cycle
    cli, srv = pair(provider, listener)
    del cli, srv
    gc.collect()
    # 3. a new connection still works after those
    cli, srv = pair(provider, listener)
    check(cli.qp.state == srv.qp.state, "a connection after the dropped ones")
    # 4. left open at exit, listener included (interpreter teardown runs the finalizers)
    print("     leaving a connection and the listener open at exit", flush=True)


def refused() -> None:
    provider = get_provider("verbs")
    # nothing listens: the kernel's CM refuses (a reject that is not the consumer's)
    probe = provider.listen(IP, 0)
    port = probe.local_address[1]
    probe.close()
    try:
        client_connect(provider, port, CONNECT_PD)
        check(False, "connect to a closed port failed")
    except ConnectionRejected as exc:
        print(f"     no listener: {exc} (private data {len(exc.private_data)} B)", flush=True)
        check(not exc.private_data, "no listener: no private data (it is not the target's)")
        check("no listener" in str(exc), "no listener: the error says so")
    except RdmaTimeout as exc:
        check(False, f"no listener: ConnectionRejected, not a timeout ({exc})")
    # the target refuses with an NVMe-oF RDMA reject status
    listener = provider.listen(IP, 0)
    box: dict = {}

    def host():
        try:
            client_connect(provider, listener.local_address[1], CONNECT_PD)
        except BaseException as exc:  # noqa: BLE001 (checked below)
            box["exc"] = exc
    t = threading.Thread(target=host)
    t.start()
    req = listener.get_request(timeout=20)
    req.reject(CMReject(sts=CMRejectStatus.NO_RESOURCES).pack())
    req.close()
    t.join(30)
    exc = box.get("exc")
    print(f"     rejected: {exc!r}", flush=True)
    check(isinstance(exc, ConnectionRejected) and exc.private_data[:4]
          == CMReject(sts=CMRejectStatus.NO_RESOURCES).pack(), "target's reject data kept")
    from blockfabric.initiator.connection import _reject_text
    text = _reject_text(exc.private_data, 1) if isinstance(exc, ConnectionRejected) else ""
    print(f"     the host says: {text}", flush=True)
    check("NO_RESOURCES" in text, "the host names the reject status")
    listener.close()


def stale() -> None:
    provider = get_provider("verbs")
    listener = provider.listen(IP, 0)
    port = listener.local_address[1]
    # the host gives up after 1 s; nobody reads the listener's channel meanwhile
    cmid = provider.create_id()
    cmid.resolve(IP, port, timeout=10)
    end = End(cmid)
    try:
        cmid.connect(CONNECT_PD, timeout=1.0)
        check(False, "the host's connect timed out")
    except RdmaTimeout as exc:
        print(f"     host: {exc}", flush=True)
    end.close()
    req = listener.get_request(timeout=20)
    check(req is not None, "the stale request is there")
    t0 = time.monotonic()
    try:                                    # create_qp (End) or accept finds it stale
        srv = End(req)
        srv.post_recv()
        req.accept(b"")
        check(False, "accepting a request whose host is gone fails")
    except ConnectionAbandoned as exc:
        print(f"     {exc}", flush=True)
    except Exception as exc:  # noqa: BLE001
        check(False, f"ConnectionAbandoned, not {type(exc).__name__}: {exc}")
    req.close()
    print(f"     (found stale in {time.monotonic() - t0:.2f} s)", flush=True)
    cli, srv = pair(provider, listener)
    check(cli.qp.state == srv.qp.state, "the listener serves the next host")
    cli.close()
    srv.close()
    listener.close()


if __name__ == "__main__":
    {"teardown": teardown, "refused": refused, "stale": stale}[CASE]()
    print(f"verbs_fixes {CASE}: {len(failures)} failure(s)", flush=True)
    sys.exit(1 if failures else 0)

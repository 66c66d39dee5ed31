"""Host-side tests of blockfabric.rdma.verbs.remote: a verbs connection whose rdma_cm id stays
in the poll-group coordinator while its QP is a worker's.  No RDMA device here: the QP
attributes' round trip through plain fields (pyverbs objects, no device needed) and the worker
side's CM id messages and events.  The connection itself runs in the lab
(tests/lab/pollgroups.sh, tests/lab/verbs_pg_proto.py)."""

from __future__ import annotations

import pickle
import select

import pytest

from blockfabric.errors import RdmaError
from blockfabric.rdma.base import CMEventType

pv = pytest.importorskip("pyverbs.qp", reason="pyverbs not installed")
from blockfabric.rdma.verbs import _native  # noqa: E402
from blockfabric.rdma.verbs.remote import RemoteCMId, dump_attr, load_attr  # noqa: E402


def _rtr():
    """An RTR attribute set as rdma_init_qp_attr gives it on RoCE (values seen on rxe)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    e = _native.load().e
    attr = pv.QPAttr()
    attr.qp_state, attr.path_mtu, attr.dest_qp_num = e.IBV_QPS_RTR, 3, 17
    attr.rq_psn, attr.max_dest_rd_atomic = 8959352, 16
    gr = GlobalRoute(dgid=GID("0000:0000:0000:0000:0000:ffff:0a63:0001"), flow_label=216333,
                     sgid_index=1, hop_limit=64, traffic_class=0)
    attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=1)
    return attr, 1216897


def test_qp_attributes_survive_the_trip_to_another_process():
    attr, mask = _rtr()
    fields = pickle.loads(pickle.dumps(dump_attr(attr, mask)))   # what the channel carries
    back, back_mask = load_attr(fields)
    assert back_mask == mask
    for k in ("qp_state", "path_mtu", "dest_qp_num", "rq_psn", "max_dest_rd_atomic"):
        assert getattr(back, k) == getattr(attr, k), k
    ah = back.ah_attr
    assert (ah.is_global, ah.port_num, ah.sgid_index, ah.hop_limit, ah.flow_label) == \
        (1, 1, 1, 64, 216333)
    assert str(ah.dgid) == "0000:0000:0000:0000:0000:ffff:0a63:0001"


def test_attributes_without_a_path_carry_none():
    e = _native.load().e
    attr = pv.QPAttr()
    attr.qp_state, attr.qp_access_flags, attr.port_num = e.IBV_QPS_INIT, 14, 1
    fields = dump_attr(attr, 57)
    assert "ah" not in fields
    back, mask = load_attr(fields)
    assert (back.qp_state, back.qp_access_flags, back.port_num, mask) == (
        e.IBV_QPS_INIT, 14, 1, 57)


def _remote(sent: list) -> RemoteCMId:
    init = dump_attr(pv.QPAttr(), 0)
    return RemoteCMId(None, [init, init, init], b"pd", ("10.0.0.2", 5000),  # type: ignore[arg-type]
                      ("10.0.0.1", 4420), sent.append)


def test_the_coordinators_disconnect_reaches_the_worker_queue_once():
    sent: list = []
    cmid = _remote(sent)
    assert cmid.get_event(0) is None
    assert not select.select([cmid.fileno()], [], [], 0)[0]
    cmid.deliver(int(CMEventType.DISCONNECTED))
    assert select.select([cmid.fileno()], [], [], 0)[0]          # the reactor wakes
    assert cmid.get_event(0).type == CMEventType.DISCONNECTED
    cmid.deliver(int(CMEventType.DISCONNECTED))                   # our own, echoed back
    assert cmid.get_event(0) is None
    cmid.disconnect()                                             # already over: no DREQ
    assert sent == []
    cmid.close()
    assert sent == [("close",)]


def test_the_workers_disconnect_and_close_go_to_the_coordinator():
    sent: list = []
    cmid = _remote(sent)
    assert (cmid.peer_address, cmid.local_address, cmid.private_data) == (
        ("10.0.0.2", 5000), ("10.0.0.1", 4420), b"pd")
    cmid.disconnect()
    cmid.disconnect()
    assert cmid.get_event(0).type == CMEventType.DISCONNECTED   # at once, as VerbsCMId
    cmid.reject(b"no")
    cmid.close()
    cmid.close()
    assert sent == [("disconnect",), ("reject", b"no"), ("close",)]


def test_a_remote_id_is_passive_and_needs_its_qp_to_accept():
    cmid = _remote([])
    with pytest.raises(RdmaError, match="create_qp"):
        cmid.accept(b"")
    with pytest.raises(RdmaError, match="passive"):
        cmid.connect(b"")
    with pytest.raises(RdmaError, match="passive"):
        cmid.resolve("10.0.0.2", 4420)
    with pytest.raises(RdmaError, match="INIT, RTR and RTS"):
        RemoteCMId(None, [], b"", ("", 0), ("", 0), print)         # type: ignore[arg-type]
    cmid.close()

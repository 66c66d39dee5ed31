"""Regression tests for how the verbs provider sets up an RC connection with rdma_cm, found
against the Linux kernel's NVMe-oF stack in the lab (tests/lab/interop.sh) and runnable
without an RDMA device: pyverbs and rdma_cm are replaced by a model of what the kernel's
rdma_init_qp_attr and IB CM return, so these check our side of the exchange only.

1. The active side must move its QP to INIT again once the connection exists: before
   connect() rdma_init_qp_attr grants no remote access, so a target's RDMA READ of the host's
   buffers (nvmet-rdma reading our Connect data) was NAKed "remote invalid request".
2. The passive side must take its initiator depth from the request event's initiator_depth
   (the CM reports the peer's responder resources from the receiver's side).  The Linux host
   offers responder resources and asks for none; answering with depth 0 left its QP without
   REMOTE_READ, so our target's READ of its Connect data failed and `nvme connect` timed out.
"""

from __future__ import annotations

import types

import pytest

from blockfabric.rdma.base import CMEventType
from blockfabric.rdma.verbs._native import RawEvent
from blockfabric.rdma.verbs.cm import VerbsCMId

INIT, RTR, RTS = 1, 2, 3
REMOTE_WRITE, REMOTE_READ = 2, 4
MAX_RD_ATOM = 16


class PyverbsError(Exception):
    pass


class FakeCM:
    """rdma_cm as the kernel behaves: QP attributes follow the connection's state."""

    def __init__(self, responder_resources: int = 0) -> None:
        self.connected = False
        self.responder_resources = responder_resources
        self.accepted = None
        self.connect_param = None

    def init_qp_attr(self, state: int):
        attr = types.SimpleNamespace(qp_state=state, qp_access_flags=0)
        if state == INIT and self.connected:      # ib_cm_init_qp_attr (cm_init_qp_init_attr)
            attr.qp_access_flags = REMOTE_WRITE | (REMOTE_READ if self.responder_resources
                                                   else 0)
        # before a connection exists: cma_ib_init_qp_attr, no remote access at all
        return attr, 0x1 | 0x8

    def connect(self, param) -> None:
        self.connect_param = param

    def establish(self) -> None:
        pass

    def accept(self, param) -> None:
        self.accepted = param


class FakeQP:
    qp_num = 7

    def __init__(self) -> None:
        self.states: list[int] = []
        self.access = 0

    def modify(self, attr, mask: int, what: str) -> None:
        self.states.append(attr.qp_state)
        if attr.qp_state == INIT:
            self.access = attr.qp_access_flags


class ConnParam(types.SimpleNamespace):
    def set_private_data(self, data: bytes) -> None:
        self.private_data = data


def _pv():
    return types.SimpleNamespace(
        e=types.SimpleNamespace(IBV_QPS_INIT=INIT, IBV_QPS_RTR=RTR, IBV_QPS_RTS=RTS,
                                IBV_QP_RETRY_CNT=0x200, IBV_QP_RNR_RETRY=0x400),
        cmid=types.SimpleNamespace(ConnParam=ConnParam),
        PyverbsError=PyverbsError)


def _cmid(cm: FakeCM, request: RawEvent | None = None) -> VerbsCMId:
    cmid = VerbsCMId.__new__(VerbsCMId)       # no device: only the CM logic runs
    cmid._pv = _pv()
    cmid._cm = cm
    cmid.qp = FakeQP()
    cmid.context = types.SimpleNamespace(_device=types.SimpleNamespace(max_rd_atom=MAX_RD_ATOM))
    cmid._request = request
    cmid._channel = types.SimpleNamespace(pump=lambda: None)   # (no events waiting)
    cmid._retry = (7, 7)
    cmid.peer_address = ("10.99.0.1", 4420)
    return cmid


def _event(kind: CMEventType, *, responder_resources: int, initiator_depth: int) -> RawEvent:
    return RawEvent(type=kind, status=0, id_ptr=1, listen_ptr=0, private_data=bytes(32),
                    responder_resources=responder_resources, initiator_depth=initiator_depth)


def test_active_side_qp_gets_remote_read_once_connected():
    cm = FakeCM()
    cmid = _cmid(cm)
    cmid._qp_to(INIT, "INIT")                      # what create_qp() does before connect()
    assert cmid.qp.access == 0
    # the target (nvmet-rdma) answers with initiator depth 16: it will read from us
    reply = _event(CMEventType.CONNECT_RESPONSE, responder_resources=16, initiator_depth=0)

    def next_event(_timeout):
        cm.connected, cm.responder_resources = True, reply.responder_resources
        return reply
    cmid._next = next_event
    cmid.connect(bytes(32))
    assert cmid.qp.states[-3:] == [INIT, RTR, RTS]
    assert cmid.qp.access & REMOTE_READ and cmid.qp.access & REMOTE_WRITE
    assert cm.connect_param.resources == MAX_RD_ATOM   # we offer reads to the target


@pytest.mark.parametrize("offered, asked, depth, resources", [
    (128, 0, MAX_RD_ATOM, 0),       # the Linux host: responder resources, no reads of its own
    (4, 0, 4, 0),                   # a peer offering fewer reads than we could issue
    (0, 3, 0, 3),                   # a peer that only reads from us
])
def test_passive_side_takes_its_depth_from_the_peers_responder_resources(
        offered, asked, depth, resources):
    # the event reports from our side: initiator_depth = what the peer lets us issue
    request = _event(CMEventType.CONNECT_REQUEST, responder_resources=asked,
                     initiator_depth=offered)
    cm = FakeCM()
    cmid = _cmid(cm, request)
    cmid.accept(bytes(32))
    assert (cm.accepted.depth, cm.accepted.resources) == (depth, resources)
    assert cmid.qp.states == [RTR, RTS]

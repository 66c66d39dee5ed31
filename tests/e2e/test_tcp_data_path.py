"""The NVMe/TCP data path against the real daemon: a host that disables SQ flow control at
Connect (this host's default on TCP, as libnvme does when discovery says the controller
can) gets each successful read's data in C2HData with SUCCESS and no response capsule;
one that keeps SQ flow control gets a CapsuleResp after the data, as before.  Both read
back what they wrote, with and without digests, in one PDU and across several."""

from __future__ import annotations

import os

import pytest

from blockfabric.fabric.tcp_host import TcpHostQueue
from blockfabric.initiator.host import connect
from blockfabric.protocol import tcp_pdu as tp

from .conftest import HOSTNQN, NQN, free_port, ram_config

pytestmark = pytest.mark.needs_transport(
    "tcp", "the NVMe/TCP data path (C2HData, R2T, H2CData PDUs)")

#: one C2HData PDU, and several (MAXH2CDATA is 128 KiB)
SIZES = (4096, 1 << 20)


@pytest.mark.parametrize("digests", [False, True])
@pytest.mark.parametrize("disable_sqflow", [None, False])
def test_reads_skip_the_response_capsule_without_sq_flow_control(
        start_target, monkeypatch, digests, disable_sqflow):
    port = free_port()
    target = start_target(ram_config(port, transport="tcp"))
    seen: list[tuple[int, int, int]] = []       # (qid, type, flags) on the I/O queues
    on_pdu = TcpHostQueue.on_pdu

    def recording(self, ptype, flags, pdu, pdo, dlen):
        if self.qid:
            seen.append((self.qid, ptype, flags))
        return on_pdu(self, ptype, flags, pdu, pdo, dlen)
    monkeypatch.setattr(TcpHostQueue, "on_pdu", recording)
    with connect("127.0.0.1", NQN, port, transport="tcp", hostnqn=HOSTNQN, nr_io_queues=1,
                 hdr_digest=digests, data_digest=digests,
                 disable_sqflow=disable_sqflow) as ctrl:
        ns = ctrl.namespaces[1]
        offset = 0
        for size in SIZES:
            data = os.urandom(size)
            ns.write(offset, data)
            del seen[:]
            assert ns.read(offset, size) == data
            last = [f for _q, t, f in seen if t == tp.C2H_DATA and f & tp.F_DATA_LAST]
            responses = [t for _q, t, _f in seen if t == tp.CAPSULE_RESP]
            assert len(last) == 1, seen
            if disable_sqflow is None:
                assert last[0] & tp.F_DATA_SUCCESS and not responses, seen
            else:
                assert not last[0] & tp.F_DATA_SUCCESS and len(responses) == 1, seen
            offset += size
    assert "protocol error" not in target.log, target.log

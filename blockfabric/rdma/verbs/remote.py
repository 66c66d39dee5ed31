"""A verbs connection whose QP lives in another process than its rdma_cm id (poll groups).

An rdma_cm id cannot move to another process, but its QP need not be the id's: rdma_cm
accepts a connection for any QP of the same device named by ``qp_num`` (``rdma_accept`` with
``rdma_conn_param.qp_num`` on an id without a QP of its own).  So with ``reactors`` > 1 the
coordinator keeps the id; at the connect request it reads the QP attributes of the INIT, RTR
and RTS transitions with ``rdma_init_qp_attr`` (all three are known then: the path, the
peer's QPN and PSN, our PSN, the access the request grants) and sends them, as plain fields
(:func:`dump_attr`), to the worker.  The worker opens the same device, creates the QP on its
own PD and CQ, moves it with ``ibv_modify_qp`` (:func:`load_attr`) and asks the coordinator
to accept with its ``qp_num``.  Disconnects go both ways over the poll group's channel.

:class:`RemoteCMId` is the worker's side: a :class:`~blockfabric.rdma.base.CMId` whose
CM operations are messages (``send``) and whose events are those the coordinator forwards
(:meth:`deliver`).  tests/lab/verbs_pg_proto.py proved the mechanism on rxe.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable

from blockfabric.errors import RdmaError
from blockfabric.rdma import base
from blockfabric.rdma.base import CMEvent, CMEventType, QPCap
from blockfabric.rdma.verbs import _native
from blockfabric.rdma.verbs.resources import VerbsContext, VerbsQP, external_qp

#: The scalar fields of ``struct ibv_qp_attr`` that rdma_init_qp_attr sets for INIT, RTR
#: and RTS of an RC QP (the mask says which of them count).
SCALARS = ("qp_state", "path_mtu", "qp_access_flags", "pkey_index", "port_num", "dest_qp_num",
           "rq_psn", "sq_psn", "max_dest_rd_atomic", "max_rd_atomic", "min_rnr_timer",
           "timeout", "retry_cnt", "rnr_retry", "qkey")
#: ``ah_attr`` (RTR: the path), and its global route header (RoCE, IB across subnets)
AH = ("dlid", "sl", "src_path_bits", "static_rate", "is_global", "port_num")
GRH = ("flow_label", "sgid_index", "hop_limit", "traffic_class")


def dump_attr(attr: Any, mask: int) -> dict:
    """A pyverbs QPAttr (and its mask) as plain fields, to pickle to another process."""
    ah = attr.ah_attr
    out: dict[str, Any] = {"mask": int(mask), **{k: int(getattr(attr, k)) for k in SCALARS}}
    if ah.is_global:
        out["ah"] = {**{k: int(getattr(ah, k)) for k in AH + GRH}, "dgid": str(ah.dgid)}
    elif ah.dlid:
        out["ah"] = {k: int(getattr(ah, k)) for k in AH}
    return out


def load_attr(fields: dict) -> tuple[Any, int]:
    """The QPAttr and mask that :func:`dump_attr` described."""
    pv = _native.load()
    from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: PLC0415  (with pyverbs)
    attr = pv.qp.QPAttr()
    for k in SCALARS:
        setattr(attr, k, int(fields[k]))
    ah = fields.get("ah")
    if ah is not None:
        kw = {k: int(ah[k]) for k in AH}
        if ah.get("is_global"):
            kw["gr"] = GlobalRoute(dgid=GID(ah["dgid"]), **{k: int(ah[k]) for k in GRH})
        attr.ah_attr = AHAttr(**kw)
    return attr, int(fields["mask"])


def _ended(status: int = 0) -> CMEvent:
    return CMEvent(type=CMEventType.DISCONNECTED, status=status, private_data=b"")


class RemoteCMId(base.CMId):
    """The worker's end of a connection whose rdma_cm id the coordinator keeps.

    ``attrs``: INIT, RTR and RTS as :func:`dump_attr` gave them; ``send(msg)``: a message to
    the coordinator about this connection (``("accept", qp_num, private_data)``,
    ``("disconnect",)``, ``("close",)``).  ``context`` is the worker's context of the same
    device (shared by its queues; not closed here).
    """

    def __init__(self, context: VerbsContext, attrs: list[dict], private_data: bytes,
                 peer: tuple[str, int], local: tuple[str, int],
                 send: Callable[[tuple], None]) -> None:
        if len(attrs) != 3:
            raise RdmaError("remote verbs queue: expected INIT, RTR and RTS attributes",
                            errno=22)
        self.context = context
        self.qp: VerbsQP | None = None
        self.private_data = private_data
        self.peer_address = peer
        self.local_address = local
        self._attrs = attrs
        self._send = send
        self._events: collections.deque[CMEvent] = collections.deque()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._disconnected = False
        self._accepted = False
        self._closed = False

    def _to(self, index: int, what: str, qp: VerbsQP | None = None) -> None:
        qp = qp or self.qp
        assert qp is not None
        attr, mask = load_attr(self._attrs[index])
        qp.modify(attr, mask, what)

    def _queue(self, event: CMEvent) -> None:
        self._events.append(event)
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass

    # -- what the coordinator forwards --------------------------------------------------
    def deliver(self, event_type: int, status: int = 0) -> None:
        """An event of the coordinator's id: a disconnect (or an error that ends the
        connection) moves the QP to ERR, so posted work is flushed, as on one process."""
        if self._closed:
            return
        if event_type in base.CONNECTION_ENDED or event_type == CMEventType.DISCONNECTED:
            if self._disconnected:
                return
            self._disconnected = True
            self._qp_error()
        try:
            etype = CMEventType(event_type)
        except ValueError:
            etype = CMEventType.DISCONNECTED
        self._queue(CMEvent(type=etype, status=status, private_data=b""))

    def _qp_error(self) -> None:
        if self.qp is not None:
            try:
                self.qp.to_error()
            except RdmaError:
                pass

    # -- the interface ----------------------------------------------------------------------
    def resolve(self, address: str, port: int, timeout: float = 5.0,
                source: str | None = None) -> None:
        raise RdmaError("a remote (poll group) CM id is passive only", errno=22)

    def create_qp(self, pd: base.PD, send_cq: base.CQ, recv_cq: base.CQ,
                  cap: QPCap | None = None, sq_sig_all: bool = False) -> VerbsQP:
        self.qp = external_qp(self.qp, pd, send_cq, recv_cq, cap, sq_sig_all,
                              lambda qp: self._to(0, "INIT", qp))
        return self.qp

    def connect(self, private_data: bytes = b"", timeout: float = 5.0,
                retry_count: int = 7, rnr_retry_count: int = 7) -> bytes:
        raise RdmaError("a remote (poll group) CM id is passive only", errno=22)

    def accept(self, private_data: bytes = b"") -> None:
        """RTR and RTS here, then the coordinator's rdma_accept names our QP."""
        if self.qp is None:
            raise RdmaError("accept: create_qp() first", errno=22)
        self._to(1, "RTR")
        self._to(2, "RTS")
        self._accepted = True
        self._send(("accept", self.qp.qp_num, bytes(private_data)))

    def reject(self, private_data: bytes = b"") -> None:
        self._send(("reject", bytes(private_data)))

    def disconnect(self) -> None:
        """As VerbsCMId.disconnect: the QP to ERR, the DREQ sent (by the coordinator), and
        DISCONNECTED reported here at once."""
        if self._disconnected or self._closed:
            return
        self._disconnected = True
        self._qp_error()
        self._send(("disconnect",))
        self._queue(_ended())

    def get_event(self, timeout: float | None = 0) -> CMEvent | None:
        if timeout:
            import select  # noqa: PLC0415
            if not self._events:
                select.select([self._r], [], [], timeout)
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        return self._events.popleft() if self._events else None

    def fileno(self) -> int:
        return self._r

    def close(self) -> None:
        """The QP first, then the coordinator destroys its id."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.qp is not None:
                self.qp.close()
        finally:
            self._send(("close",))
            os.close(self._r)
            os.close(self._w)

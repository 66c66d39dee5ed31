"""RDMA CM private data exchanged while a queue's connection is set up (spec sheet section 1;
kernel struct nvme_rdma_cm_req / _rep / _rej in include/linux/nvme-rdma.h)."""

from __future__ import annotations

import enum
from typing import Callable, TypeVar, dataclass_transform

from blockfabric.protocol._wire import Packed, packed, u16
from blockfabric.protocol.errors import ProtocolError
from blockfabric.protocol.status import StatusCode

CM_RECFMT = 0  # the only record format defined


class CMRejectStatus(enum.IntEnum):
    """``sts`` of a CM reject (NVMe-oF RDMA transport binding, 'RDMA_CM_REJECT')."""

    INVALID_PRIVATE_DATA_LENGTH = 1
    INVALID_RECFMT = 2
    INVALID_QID = 3
    INVALID_HSQSIZE = 4
    INVALID_HRQSIZE = 5
    NO_RESOURCES = 6
    INVALID_IRD = 7
    INVALID_ORD = 8
    INVALID_CNTLID = 9


_P = TypeVar("_P", bound=Packed)


@dataclass_transform(frozen_default=True)
def _private_data(size: int) -> Callable[[type[_P]], type[_P]]:
    """Layout of a CM private data message: too short is 'invalid private data length'."""
    return packed(size, short=StatusCode.CONNECT_INVALID_PARAM,
                  cm_reject=CMRejectStatus.INVALID_PRIVATE_DATA_LENGTH)


class _Recfmt(Packed):
    """Messages whose decode refuses a record format other than 0."""

    __slots__ = ()
    recfmt: int

    def _check(self) -> None:
        if self.recfmt != CM_RECFMT:
            raise ProtocolError(f"{type(self).__name__}: unsupported recfmt {self.recfmt}",
                                StatusCode.CONNECT_INCOMPATIBLE_FORMAT, True,
                                CMRejectStatus.INVALID_RECFMT)


@_private_data(32)
class CMConnectRequest(_Recfmt):
    """Host -> target with the connect request: which queue, and its sizes."""

    recfmt: int = u16(0)  # @0 record format, 0
    qid: int = u16(2)  # @2 0 = admin queue
    hrqsize: int = u16(4)  # @4 host receive queue size (1-based)
    hsqsize: int = u16(6)  # @6 host send queue size (0-based, as the Connect sqsize)
    cntlid: int = u16(8)  # @8 newer hosts: the controller; older ones send 0; @10..31 reserved

    def check_limits(self, *, max_admin_depth: int = 32, max_queue_size: int = 1024) -> None:
        """Apply nvmet's size rules: the receive queue it posts is hsqsize+1 entries, the
        admin one at most ``max_admin_depth``; raises with the CM reject to send."""
        limit = max_admin_depth if self.qid == 0 else max_queue_size
        if self.hsqsize + 1 > limit:
            raise ProtocolError(f"hsqsize {self.hsqsize} exceeds {limit} entries",
                                StatusCode.CONNECT_INVALID_PARAM, True,
                                CMRejectStatus.INVALID_HSQSIZE)
        if not 0 < self.hrqsize <= limit:
            raise ProtocolError(f"hrqsize {self.hrqsize} outside 1..{limit}",
                                StatusCode.CONNECT_INVALID_PARAM, True,
                                CMRejectStatus.INVALID_HRQSIZE)


@_private_data(32)
class CMAccept(_Recfmt):
    """Target -> host with the accept: the receive queue size the target grants."""

    recfmt: int = u16(0)  # @0 record format, 0
    crqsize: int = u16(2)  # @2 controller receive queue size; @4..31 reserved


@_private_data(4)
class CMReject(Packed):
    """Target -> host with a reject.  ``sts`` stays a plain int when a newer peer sends a
    code this table lacks (see :attr:`reason`)."""

    recfmt: int = u16(0)  # @0 record format, 0
    sts: int = u16(2)  # @2 a CMRejectStatus

    @property
    def reason(self) -> CMRejectStatus | None:
        """The status as an enum member, None when unknown."""
        return _REJECT_BY_VALUE.get(self.sts)


_REJECT_BY_VALUE = {int(m): m for m in CMRejectStatus}

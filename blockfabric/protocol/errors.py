"""The one error the protocol layer raises: it carries the answer the receiver should give."""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockfabric.errors import BlockfabricError

if TYPE_CHECKING:  # pragma: no cover - names only, avoids an import cycle
    from blockfabric.protocol.cm import CMRejectStatus


class ProtocolError(BlockfabricError):
    """Malformed or out-of-sequence input.

    ``status`` (SCT<<8|SC: a StatusCode, or the int of one, as a namespace's ANA status) and
    ``dnr`` are what the CQE answering the command says; ``cm_reject`` is set for RDMA CM
    private data, where the answer is a CM reject instead.
    ``result`` is the CQE dword 0 where nvmet reports one (Connect IATTR/IPO), and ``cid`` the
    command identifier when the SQE header was readable, so the caller can still answer it.
    """

    def __init__(self, message: str, status: int, dnr: bool = True,
                 cm_reject: CMRejectStatus | None = None, *, result: int | None = None,
                 cid: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.dnr = dnr
        self.cm_reject = cm_reject
        self.result = result
        self.cid = cid

    def __repr__(self) -> str:
        extra = f", cm_reject={self.cm_reject!r}" if self.cm_reject is not None else ""
        return (f"ProtocolError({str(self)!r}, {self.status!r}, dnr={self.dnr}{extra}, "
                f"result={self.result!r}, cid={self.cid!r})")

"""The host library's errors: what a command, a queue or a whole controller failed with.

A command's own failure is an :class:`NvmeError` (its status: SCT, SC, DNR); a queue lost
under it is a :class:`QueueDead` (:class:`WorkCompletionError` when a work request failed,
carrying that completion's status), defined beside the queue in :mod:`blockfabric.errors`;
a controller that stopped reconnecting fails what it held with :class:`ControllerLost`.
"""

from __future__ import annotations

import logging

from blockfabric.errors import BlockfabricError, QueueDead
from blockfabric.protocol import (StatusCode)

log = logging.getLogger(__name__)


class NvmeError(BlockfabricError):
    """A command completed with an error status: ``status`` is the StatusCode (SCT << 8 |
    SC), also as ``sct`` and ``sc``; ``dnr`` is Do Not Retry; ``result`` the CQE's DW0."""

    def __init__(self, what: str, status: int, dnr: bool = False, result: int = 0) -> None:
        self.status = StatusCode(status) if 0 <= status <= 0x7FF else status
        self.dnr = dnr
        self.result = result
        name = getattr(self.status, "name", hex(status))
        super().__init__(f"{what}: {name} ({int(status):#05x}{', DNR' if dnr else ''})")

    @classmethod
    def from_word(cls, what: str, word: int, result: int = 0) -> NvmeError:
        """From a response capsule's last 16 bits (phase, SC, SCT, CRD, M, DNR)."""
        return cls(what, (word >> 1) & 0x7FF, bool(word & 0x8000), result)

    @property
    def sct(self) -> int:
        """Status Code Type (0 generic, 1 command specific, 2 media, 3 path related)."""
        return (int(self.status) >> 8) & 7

    @property
    def sc(self) -> int:
        """Status Code, within its type."""
        return int(self.status) & 0xFF


class AuthenticationFailed(BlockfabricError, ConnectionRefusedError):
    """In-band (DH-HMAC-CHAP) authentication did not succeed: no or the wrong secret, or
    the controller could not prove it holds the controller secret."""


class ControllerLost(QueueDead):
    """Reconnecting gave up (ctrl_loss_tmo ran out, or the controller was closed): a held
    command is failed for good.  A file user sees EIO, as with the kernel host."""

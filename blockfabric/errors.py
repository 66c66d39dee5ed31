"""The project's small error hierarchy.

Every error raised on purpose by blockfabric derives from :class:`BlockfabricError`.  The
kinds carry what their handler needs: a protocol error the NVMe status to answer with (see
``blockfabric.protocol.errors``), an RDMA error its errno or work-completion status, a config
error the file, the key path and what was expected.  This module imports nothing that does
I/O, so the pure protocol layer may use it.
"""

from __future__ import annotations

import copy


class BlockfabricError(Exception):
    """Base of every error blockfabric raises on purpose."""


class ConfigError(BlockfabricError):
    """A configuration file is wrong.  Renders as ``FILE: KEY: expected ..., got ...``."""

    def __init__(self, path: str, key: str, expected: str, got: object = None) -> None:
        self.path = path
        self.key = key
        self.expected = expected
        self.got = got
        got_text = "" if got is None else f", got {got!r}"
        super().__init__(f"{path}: {key}: expected {expected}{got_text}")


class RdmaError(BlockfabricError):
    """An RDMA operation failed.  ``errno`` is set for verbs/CM calls, ``wc_status`` for a
    failed work completion (a :class:`blockfabric.rdma.WcStatus`)."""

    def __init__(self, message: str, *, errno: int | None = None, wc_status: int | None = None):
        self.errno = errno
        self.wc_status = wc_status
        super().__init__(message)


class ProviderUnavailable(RdmaError):
    """The requested RDMA provider cannot be used here; the message says how to get it."""


class ConnectionRejected(RdmaError):
    """The passive side rejected a connection; ``private_data`` is the peer's reject data."""

    def __init__(self, message: str, private_data: bytes = b"") -> None:
        super().__init__(message)
        self.private_data = private_data


class ConnectionAbandoned(RdmaError):
    """A connection request whose peer gave up (timed out and went away) before it was
    accepted: the request is stale, and accepting it can only fail."""


class RdmaTimeout(RdmaError):
    """Address/route resolution, connection setup or a wait ran out of time."""


class QueueDead(BlockfabricError, ConnectionError):
    """A host queue (or the whole controller) went away before a command completed: the
    command may be re-issued on another queue, after a reconnect (a ``ConnectionError``, so
    code that catches those keeps working)."""

    def during(self, what: str) -> QueueDead:
        """The same error (type and fields) with ``what`` was being done put in front."""
        other = copy.copy(self)
        other.args = (f"{what}: {self}",)
        return other


class WorkCompletionError(QueueDead, RdmaError):
    """A host queue died because one of its work requests completed in error:
    ``wc_status`` is that completion's status (a :class:`blockfabric.rdma.WcStatus` value)."""

    def __init__(self, message: str, wc_status: int | None = None) -> None:
        RdmaError.__init__(self, message, wc_status=wc_status)

"""One memory registration for the paths of a multipath set that mix RDMA and NVMe/TCP.

Each path controller of a mixed set (``--path tcp://ADDR:PORT`` with ``-t rdma``, or the
reverse) has its own transport, yet memory is registered once: :class:`SharedPD` registers
it with the RDMA device's protection domain (the RDMA paths' queues and the target's RDMA
READ/WRITE use those keys) and keeps the same keys in a table of its own, through which an
NVMe/TCP queue finds the bytes of an (address, length, key) as it does in a local one
(:func:`blockfabric.fabric.tcp.resolve` reads ``pd.ctx``).  So a buffer travels by RDMA on
one path and in TCP data PDUs on the other, with no copy added on either.
"""

from __future__ import annotations

from typing import Any

from blockfabric.rdma import Access


class _Keys:
    """The key tables :func:`blockfabric.fabric.tcp.resolve` reads (``pd.ctx``)."""

    def __init__(self) -> None:
        self.lkeys: dict[int, _SharedMR] = {}
        self.rkeys: dict[int, _SharedMR] = {}


class _SharedMR:
    """A region registered with the RDMA protection domain (``inner``), as both transports
    see it: the same address and keys, and ``buf`` for a TCP queue."""

    def __init__(self, pd: SharedPD, inner: Any) -> None:
        self.pd = pd
        self.inner = inner
        self.addr, self.length = inner.addr, inner.length
        self.lkey, self.rkey = inner.lkey, inner.rkey
        self.access = inner.access
        self.buf = inner.buf
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pd.ctx.lkeys.pop(self.lkey, None)
        self.pd.ctx.rkeys.pop(self.rkey, None)
        self.inner.close()


class SharedPD:
    """One registration for RDMA and NVMe/TCP paths (see the module text): what callers
    register with (``ctrl.pd``) and what a TCP path's queues resolve keys in; an RDMA path's
    queues use :attr:`inner`, the device's own protection domain."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ctx = _Keys()
        self.closed = False

    def reg_mr(self, buffer, access: Access = Access.LOCAL_WRITE) -> _SharedMR:
        mr = _SharedMR(self, self.inner.reg_mr(buffer, access))
        self.ctx.lkeys[mr.lkey] = mr
        self.ctx.rkeys[mr.rkey] = mr
        return mr

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inner.close()

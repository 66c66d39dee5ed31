"""Protection domains and memory regions of the soft provider.

Registration pins the caller's buffer (a ctypes view holds a buffer export, so a bytearray
cannot be resized nor an mmap closed while registered) and yields its real virtual address.
Keys are unique per device; lkey and rkey differ, so an lkey is no use as an rkey.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import random
from typing import TYPE_CHECKING

from blockfabric.errors import RdmaError
from blockfabric.rdma.base import MR, PD, Access

if TYPE_CHECKING:
    from blockfabric.rdma.soft.device import SoftContext


class SoftMR(MR):
    """One registered region; ``buf`` is a memoryview of exactly its bytes."""

    def __init__(self, pd: "SoftPD", buffer, access: Access, lkey: int, rkey: int) -> None:
        access = Access(access)
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as exc:
            raise RdmaError(f"cannot register {type(buffer).__name__}: {exc}",
                            errno=_errno.EINVAL) from exc
        if view.readonly:
            raise RdmaError("cannot register read-only memory", errno=_errno.EACCES)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            # ibv_reg_mr: remote write/atomic need local write (EINVAL)
            raise RdmaError("REMOTE_WRITE requires LOCAL_WRITE", errno=_errno.EINVAL)
        self.pd = pd
        self.length = view.nbytes
        self._pin = (ctypes.c_char * self.length).from_buffer(view)
        self.addr = ctypes.addressof(self._pin)
        self.end = self.addr + self.length
        self.buf = view
        self.access = access
        self.lkey = lkey
        self.rkey = rkey
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pd._forget(self)
        del self._pin
        self.buf.release()

    def __repr__(self) -> str:
        return (f"SoftMR(addr={self.addr:#x}, length={self.length}, lkey={self.lkey:#x}, "
                f"rkey={self.rkey:#x}, access={self.access!r})")


class SoftPD(PD):
    """A protection domain; its MRs live in the device's key tables."""

    def __init__(self, ctx: "SoftContext") -> None:
        self.ctx = ctx
        self._mrs: set[SoftMR] = set()
        self.closed = False

    def reg_mr(self, buffer, access: Access = Access.LOCAL_WRITE) -> SoftMR:
        if self.closed:
            raise RdmaError("PD is closed", errno=_errno.EINVAL)
        lkey, rkey = self.ctx.new_keys()
        mr = SoftMR(self, buffer, access, lkey, rkey)
        self._mrs.add(mr)
        self.ctx.lkeys[lkey] = mr
        self.ctx.rkeys[rkey] = mr
        return mr

    def _forget(self, mr: SoftMR) -> None:
        self._mrs.discard(mr)
        self.ctx.lkeys.pop(mr.lkey, None)
        self.ctx.rkeys.pop(mr.rkey, None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for mr in list(self._mrs):
            mr.close()


class KeyAllocator:
    """Keys as HCAs make them: an index in the upper 24 bits, a random 8-bit tag below."""

    def __init__(self) -> None:
        self._rng = random.Random()   # unpredictable on purpose: keys are capabilities
        self._next = 1

    def pair(self) -> tuple[int, int]:
        index = self._next
        self._next += 2
        tag = self._rng.randrange(256)
        return ((index << 8) | tag) & 0xFFFFFFFF, (((index + 1) << 8) | tag) & 0xFFFFFFFF

"""Protection domains and memory regions of the soft provider.

Registration pins the caller's buffer (a ctypes view holds a buffer export, so a bytearray
cannot be resized nor an mmap closed while registered) and yields its real virtual address.
Keys are random 32-bit numbers, unique among the device's live keys; lkey and rkey differ,
so an lkey is no use as an rkey, and a peer cannot guess a key from another it has seen.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import secrets
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from blockfabric.errors import RdmaError
from blockfabric.rdma.base import MR, PD, Access

if TYPE_CHECKING:
    from typing_extensions import Buffer


class KeyTables(Protocol):
    """What a :class:`SoftPD` needs of its device: the key tables and the key allocator
    (a :class:`~blockfabric.rdma.soft.device.SoftContext`, or the TCP transport's
    memory-only stand-in, ``blockfabric.fabric.tcp._LocalKeys``)."""

    lkeys: dict[int, SoftMR]
    rkeys: dict[int, SoftMR]
    _keys: KeyAllocator

    def new_keys(self) -> tuple[int, int]: ...


_Ctx = TypeVar("_Ctx", bound=KeyTables)


class SoftMR(MR):
    """One registered region; ``buf`` is a memoryview of exactly its bytes."""

    def __init__(self, pd: SoftPD[Any], buffer: Buffer, access: Access, lkey: int,
                 rkey: int) -> None:
        access = Access(access)
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as exc:
            raise RdmaError(f"cannot register {type(buffer).__name__}: {exc}",
                            errno=_errno.EINVAL) from exc
        if view.readonly:
            raise RdmaError("cannot register read-only memory", errno=_errno.EACCES)
        remote_write = access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
        if remote_write and not access & Access.LOCAL_WRITE:
            # ibv_reg_mr: remote write/atomic need local write (EINVAL)
            raise RdmaError("REMOTE_WRITE requires LOCAL_WRITE", errno=_errno.EINVAL)
        self.pd = pd
        self.length = view.nbytes
        self._pin = (ctypes.c_char * self.length).from_buffer(view)
        self.addr = ctypes.addressof(self._pin)
        self.end = self.addr + self.length
        self.buf = view
        self.access = access
        self.bits = int(access)     # for the per-I/O checks: no enum arithmetic there
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


class SoftPD(PD, Generic[_Ctx]):
    """A protection domain; its MRs live in the device's key tables (``ctx``: the device,
    a :class:`~blockfabric.rdma.soft.device.SoftContext`, or what stands in for one)."""

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx
        self._mrs: set[SoftMR] = set()
        self.closed = False

    def reg_mr(self, buffer: Buffer, access: Access = Access.LOCAL_WRITE) -> SoftMR:
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
        self.ctx._keys.release(mr.lkey, mr.rkey)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for mr in list(self._mrs):
            mr.close()


class KeyAllocator:
    """Keys are capabilities: each is 32 random bits from the system's CSPRNG (an HCA's
    index-and-tag keys can be guessed from one seen key: the next index, 256 tags), and
    unique among the live keys of the device (0 is never used).  The caller serialises
    :meth:`pair`; :meth:`release` takes a closed region's keys back."""

    def __init__(self) -> None:
        self._live: set[int] = {0}

    def pair(self) -> tuple[int, int]:
        live = self._live
        keys: list[int] = []
        while len(keys) < 2:
            key = secrets.randbits(32)
            if key not in live:
                live.add(key)
                keys.append(key)
        return keys[0], keys[1]

    def release(self, *keys: int) -> None:
        for key in keys:
            if key:
                self._live.discard(key)

"""Protection domains and memory regions of the soft provider.

Registration pins the caller's buffer (a ctypes view holds a buffer export, so a bytearray
cannot be resized nor an mmap closed while registered) and yields its real virtual address.
Keys are random 32-bit numbers, unique among the device's live keys; lkey and rkey differ,
so an lkey is no use as an rkey, and a peer cannot guess a key from another it has seen.

Shared regions (same-host connections, see ``SoftProvider``): :meth:`SoftPD.shared_slab`
gives memory backed by a memfd sealed against shrinking and growing, and a region
registered over the whole of one is offered, with its descriptor, to the peers of this PD's
connections over a unix socket; they map it and move RDMA READ and WRITE data with a copy
instead of through the socket.  The seals keep a peer from ever faulting on it (no page can
go away under its mapping), and the memory is the region's alone, so a peer that copies
after the region closed reaches only pages no one else uses.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import mmap
import os
import secrets
import weakref
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
_REMOTE = int(Access.REMOTE_READ | Access.REMOTE_WRITE)
#: the largest region shared whole (a SHARE frame's length field is 32 bits)
MAX_SHARED_REGION = 1 << 31


#: the seals a shared region's memfd carries, and that a peer's must carry before it is mapped
SHARE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedSlab(mmap.mmap):
    """Memory a peer on this host may map: a sealed memfd of ``length`` bytes, mapped
    shared.  ``memfd`` stays open for as long as the slab (it is what a connection passes);
    :meth:`close` closes both."""

    memfd: int
    _fdclose: weakref.finalize

    def __new__(cls, length: int, name: str = "blockfabric-soft") -> SharedSlab:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, length)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARE_SEALS)
            slab = super().__new__(cls, fd, length)
        except BaseException:
            os.close(fd)
            raise
        slab.memfd = fd
        slab._fdclose = weakref.finalize(slab, os.close, fd)
        return slab

    def close(self) -> None:
        """Unmap and close the descriptor (a view still exported elsewhere keeps both: the
        mapping raises BufferError, as any mmap's, and the descriptor closes with it)."""
        super().close()
        self.memfd = -1
        self._fdclose()


class SoftMR(MR):
    """One registered region; ``buf`` is a memoryview of exactly its bytes; ``slab`` the
    :class:`SharedSlab` it covers whole when registered for remote access (a region a
    same-host peer is offered), else None."""

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
        self.slab = (buffer if type(buffer) is SharedSlab and view.nbytes == len(buffer)
                     and 0 < self.length <= MAX_SHARED_REGION and self.bits & _REMOTE
                     else None)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pd._forget(self)
        if self.slab is not None:
            self.pd.unshare(self)
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
        if mr.slab is not None:
            for qp in self._sharing():
                qp.share(mr)
        return mr

    def shared_slab(self, length: int) -> SharedSlab:
        """Memory to register for remote access that a same-host peer can map (see the
        module text); anywhere else it is plain memory."""
        return SharedSlab(length)

    def shared(self) -> list[SoftMR]:
        """The regions of this PD a same-host peer is offered: shared slabs registered with
        remote access."""
        return [mr for mr in list(self._mrs) if mr.slab is not None]

    def _sharing(self) -> list:
        """The connections of this PD whose peer maps shared regions."""
        return [qp for qp in list(getattr(self.ctx, "_qps", ()))
                if qp.pd is self and qp.shm]

    def unshare(self, mr: SoftMR) -> None:
        """``mr`` closed: its peers drop their mapping (a FORGET frame each)."""
        for qp in self._sharing():
            qp.forget(mr)

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

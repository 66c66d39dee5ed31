"""Linux memory policy system calls (``set_mempolicy``, ``mbind``, ``get_mempolicy``).

Called through libc's ``syscall`` by number (glibc has no wrappers; libnuma is not needed
for three calls).  Where the numbers are not known for the machine, every call raises
ENOSYS and the caller (:mod:`blockfabric.numa`) runs unplaced with a warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
from typing import Any

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = 0, 1, 2
MPOL_F_ADDR = 1 << 1
POLICIES = {"preferred": MPOL_PREFERRED, "bind": MPOL_BIND}

#: (mbind, set_mempolicy, get_mempolicy) per machine; aarch64 and riscv64 use the generic
#: table (asm-generic/unistd.h).  Unknown architectures run unplaced, with a warning.
SYSCALLS = {
    "x86_64": (237, 238, 239),
    "aarch64": (235, 237, 236),
    "arm64": (235, 237, 236),
    "riscv64": (235, 237, 236),
}

_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


_libc: Any = None


def _syscall(which: int, *args: Any) -> int:
    """Call mbind (0), set_mempolicy (1) or get_mempolicy (2); raises OSError."""
    global _libc
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, f"memory policy syscalls not known for {platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    rc = _libc.syscall(ctypes.c_long(numbers[which]), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def _nodemask(node: int) -> tuple[Any, int]:
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    return mask, words * _ULONG_BITS + 1


def set_mempolicy(node: int | None, policy: str = "preferred") -> None:
    """The calling thread's memory policy (and that of the threads it starts afterwards):
    ``node`` under ``policy``, or the default (None)."""
    if node is None:
        _syscall(1, ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0))
        return
    mask, maxnode = _nodemask(node)
    _syscall(1, ctypes.c_int(POLICIES[policy]), mask, ctypes.c_ulong(maxnode))


def region_address(region: Any) -> tuple[int, int]:
    """Start and length of a writable mmap (or a buffer exposing its memory)."""
    c = ctypes.c_char.from_buffer(region)
    try:
        return ctypes.addressof(c), len(region)
    finally:
        del c


def mbind(region: Any, node: int, policy: str = "preferred") -> None:
    """Bind ``region`` (a writable mmap) to ``node``: pages not yet touched are allocated
    there (MPOL_BIND: only there; MPOL_PREFERRED: there while it has room)."""
    addr, length = region_address(region)
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    mask, maxnode = _nodemask(node)
    _syscall(0, ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(POLICIES[policy]),
             mask, ctypes.c_ulong(maxnode), ctypes.c_uint(0))


def region_policy(addr: int) -> tuple[str, int | None]:
    """The policy (name, node) of the mapping at ``addr``, read back with get_mempolicy."""
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * 16)()
    maxnode = 16 * _ULONG_BITS + 1
    _syscall(2, ctypes.byref(mode), mask, ctypes.c_ulong(maxnode), ctypes.c_void_p(addr),
             ctypes.c_ulong(MPOL_F_ADDR))
    names = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind"}
    node = next((w * _ULONG_BITS + b for w in range(len(mask)) for b in range(_ULONG_BITS)
                 if mask[w] >> b & 1), None)
    return names.get(mode.value & 0xFF, str(mode.value)), node

"""The libfuse binding (``-o binding=libfuse``): mfusepy on libfuse 3, multi-threaded.

One of two bindings of :class:`VolumeFS`; the default is our own server of the kernel's
protocol (:mod:`.fuse_kernel`).  Only this module imports mfusepy.

Why this binding and model (measured, see docs/fuse.md): libfuse 3 gives 1 MiB requests and
asynchronous direct I/O; mfusepy implements ``fallocate`` (pyfuse3 does not, so punch hole and
zero range would be impossible); and libfuse's own small pool of worker threads, each blocking
only on its own NVMe command, keeps many commands in flight with no extra hand-off: the
worker submits straight to the host library and is woken by the controller's reactor.

Swapping the binding means rewriting :func:`serve` and :class:`_Ops` only; the filesystem
itself is :class:`VolumeFS`.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable

# mfusepy picks libfuse 2 when both are installed; libfuse 2 caps requests at 128 KiB and
# makes io_submit synchronous, so insist on libfuse 3 unless the caller chose a library.
os.environ.setdefault("FUSE_LIBRARY_PATH", "libfuse3.so.3")

import mfusepy  # noqa: E402  (must follow the library choice above)

from blockfabric.initiator.fusefs import STATUS_NAME, SUBTYPE, VolumeFS  # noqa: E402

MAX_REQUEST = 1 << 20


def library_version() -> str:
    return f"libfuse {mfusepy.fuse_version_major}.{mfusepy.fuse_version_minor}"


class _Ops(mfusepy.Operations):
    """Translate mfusepy's calls to VolumeFS; OSError errnos pass through unchanged."""

    use_ns = True

    def __init__(self, fs: VolumeFS, on_ready: Callable[[], None] | None) -> None:
        self.fs = fs
        self.on_ready = on_ready

    def init_with_config(self, conn: Any, config: Any) -> None:
        if conn is not None:
            # 1 MiB requests both ways (libfuse 3 checks max_read against the mount option).
            conn.max_write = MAX_REQUEST
            conn.max_read = MAX_REQUEST
        if self.on_ready is not None:
            self.on_ready()

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        return self.fs.getattr(path)

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", ".."] + self.fs.names()

    def open(self, path: str, fi: Any) -> int:
        self.fs.check_open(path, fi.flags)
        # .status is regenerated on every read, so never cache it; namespace files follow
        # the mount's direct_io / page cache choice.
        fi.direct_io = 1 if (self.fs.options.direct_io or path == "/" + STATUS_NAME) else 0
        fi.keep_cache = 0
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        return self.fs.read(path, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
        return self.fs.write(path, data, offset)

    def fsync(self, path: str, datasync: int, fh: Any) -> int:
        self.fs.fsync(path)
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: Any) -> int:
        self.fs.fallocate(path, mode, offset, size)
        return 0

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        # Opening with O_TRUNC arrives here: a volume cannot change size.
        if length != self.fs.getattr(path).get("st_size"):
            raise mfusepy.FuseOSError(errno.EINVAL if path.lstrip("/") in self.fs.files
                                      else errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return self.fs.statfs()


def serve(fs: VolumeFS, mountpoint: str, *, fsname: str,
          on_ready: Callable[[], None] | None = None) -> None:
    """Mount ``fs`` at ``mountpoint`` and serve until unmounted or SIGTERM/SIGINT/SIGHUP
    (libfuse's own handlers end the loop, then libfuse unmounts).  ``on_ready`` runs once
    the kernel has sent INIT, i.e. the mount is live."""
    opts = fs.options
    threads = opts.worker_threads()
    kwargs: dict[str, Any] = {"foreground": True, "nothreads": threads <= 1,
                              "fsname": fsname, "subtype": SUBTYPE,
                              "default_permissions": True, "max_read": MAX_REQUEST}
    if threads > 1:
        kwargs["max_threads"] = threads
        kwargs["max_idle_threads"] = threads
    if opts.allow_other:
        kwargs["allow_other"] = True
    if opts.read_only:
        kwargs["ro"] = True
    for word in opts.extra:
        key, _, value = word.partition("=")
        kwargs[key] = value or True
    mfusepy.FUSE(_Ops(fs, on_ready), mountpoint, raw_fi=True, **kwargs)

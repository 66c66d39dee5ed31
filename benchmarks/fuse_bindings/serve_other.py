"""Serve one namespace through a FUSE binding other than the shipped one, for the measurement.

    python serve_other.py {pyfuse3|fusepy} TRADDR TRSVCID SUBNQN MOUNTPOINT

The shipped binding (mfusepy) is measured through ``blockfabric mount -f`` itself.  These
adapters reuse the same :class:`VolumeFS`, so only the binding and its threading differ.
Read and write only: enough for fio.  Prints "ready" on stdout once mounted.
"""

from __future__ import annotations

import errno
import os
import sys

from blockfabric.initiator.fusefs import MountOptions, VolumeFS
from blockfabric.initiator.host import connect


def serve_pyfuse3(fs: VolumeFS, mountpoint: str) -> None:
    """pyfuse3 (libfuse 3, trio): one OS thread; each request is a trio task that awaits its
    NVMe command, woken by the reactor thread through the trio token."""
    import pyfuse3
    import trio

    names = {name.encode(): pyfuse3.ROOT_INODE + 1 + i for i, name in enumerate(fs.names())}
    paths = {ino: "/" + name.decode() for name, ino in names.items()}
    paths[pyfuse3.ROOT_INODE] = "/"

    async def wait(fut):
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        fut.add_done_callback(lambda _f: token.run_sync_soon(done.set))
        await done.wait()
        return fut.result()

    class Ops(pyfuse3.Operations):
        async def lookup(self, parent, name, ctx=None):
            if parent != pyfuse3.ROOT_INODE or name not in names:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return await self.getattr(names[name])

        async def getattr(self, inode, ctx=None):
            st = fs.getattr(paths[inode])
            attr = pyfuse3.EntryAttributes()
            attr.st_ino = inode
            attr.st_mode = st["st_mode"]
            attr.st_size = st.get("st_size", 0)
            attr.st_nlink = st["st_nlink"]
            attr.st_uid, attr.st_gid = st["st_uid"], st["st_gid"]
            attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = st["st_mtime"]
            return attr

        async def opendir(self, inode, ctx):
            return inode

        async def readdir(self, fh, start_id, token):
            for i, (name, ino) in enumerate(names.items()):
                if i >= start_id and not pyfuse3.readdir_reply(
                        token, name, await self.getattr(ino), i + 1):
                    return

        async def open(self, inode, flags, ctx):
            fs.check_open(paths[inode], flags)
            return pyfuse3.FileInfo(fh=inode, direct_io=True)

        async def read(self, fh, off, size):
            ns = fs.files.get(paths[fh].lstrip("/"))
            if ns is None or off % ns.block_size or size % ns.block_size \
                    or off + size > ns.size:
                return fs.read(paths[fh], size, off)      # edges: the blocking path
            return await wait(ns.submit_read(off, size))

        async def write(self, fh, off, buf):
            ns = fs.files.get(paths[fh].lstrip("/"))
            if ns is None or off % ns.block_size or len(buf) % ns.block_size \
                    or off + len(buf) > ns.size:
                return fs.write(paths[fh], bytes(buf), off)
            await wait(ns.submit_write(off, buf))
            return len(buf)

    options = set(pyfuse3.default_options) | {f"fsname={fs.ctrl.opts.subnqn}"}
    pyfuse3.init(Ops(), mountpoint, options)
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


def serve_fusepy(fs: VolumeFS, mountpoint: str) -> None:
    """fusepy (libfuse 2 only, multi-threaded): the named default in the issue."""
    os.environ.setdefault("FUSE_LIBRARY_PATH", "libfuse.so.2")
    import fuse

    class Ops(fuse.Operations):
        def getattr(self, path, fh=None):
            st = dict(fs.getattr(path))
            for key in ("st_atime", "st_mtime", "st_ctime"):
                st[key] = st[key] / 1e9
            return st

        def readdir(self, path, fh):
            return [".", ".."] + fs.names()

        def open(self, path, fi):
            fs.check_open(path, fi.flags)
            fi.direct_io = 1
            return 0

        def read(self, path, size, offset, fh):
            return fs.read(path, size, offset)

        def write(self, path, data, offset, fh):
            return fs.write(path, data, offset)

        def init(self, path):
            print("ready", flush=True)

    fuse.FUSE(Ops(), mountpoint, foreground=True, raw_fi=True, fsname=fs.ctrl.opts.subnqn,
              default_permissions=True)


def main() -> int:
    kind, traddr, trsvcid, subnqn, mountpoint = sys.argv[1:6]
    ctrl = connect(traddr, subnqn, int(trsvcid), provider="soft")
    try:
        fs = VolumeFS(ctrl, MountOptions())
        {"pyfuse3": serve_pyfuse3, "fusepy": serve_fusepy}[kind](fs, mountpoint)
    finally:
        ctrl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

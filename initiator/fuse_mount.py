"""Mounting a FUSE session: mount(2) as root, fusermount3 for an ordinary user; unmounting.

The mount gives a /dev/fuse descriptor (fusermount3 passes it back over a socket,
``_FUSE_COMMFD``); whoever serves the session reads requests from it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import socket
import stat
import struct
import subprocess

from blockfabric.initiator.fuse_abi import FUSE_DEV_IOC_CLONE, MAX_REQUEST
from blockfabric.initiator.fusefs import SUBTYPE

MS_RDONLY, MS_NOSUID, MS_NODEV, MNT_DETACH = 1, 2, 4, 2


class FuseMountError(RuntimeError):
    """The kernel or fusermount3 refused the mount; the message says why."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_fd(mountpoint: str, fsname: str, *, read_only: bool, allow_other: bool,
             extra: list[str]) -> int:
    """A /dev/fuse descriptor mounted at ``mountpoint``: mount(2) when allowed (root),
    else fusermount3."""
    words = ["default_permissions", f"max_read={MAX_REQUEST}"] + \
        (["allow_other"] if allow_other else []) + list(extra)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    data = (f"fd={fd},rootmode={stat.S_IFDIR:o},user_id={os.getuid()},"
            f"group_id={os.getgid()}," + ",".join(words))
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    libc = _libc()
    if libc.mount(fsname.encode(), mountpoint.encode(), f"fuse.{SUBTYPE}".encode(), flags,
                  data.encode()) == 0:
        return fd
    err = ctypes.get_errno()
    os.close(fd)
    if err != errno.EPERM:
        raise FuseMountError(f"mount {mountpoint} (options {','.join(words)}): "
                             f"{os.strerror(err)}")
    return _fusermount(mountpoint, fsname, read_only, words)


def _fusermount(mountpoint: str, fsname: str, read_only: bool, words: list[str]) -> int:
    tool = shutil.which("fusermount3")
    if tool is None:
        raise FuseMountError("not root and fusermount3 is not installed (package fuse3)")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        opts = ",".join(["ro" if read_only else "rw", "nosuid", "nodev",
                         f"fsname={fsname}", f"subtype={SUBTYPE}"] + words)
        done = subprocess.run([tool, "-o", opts, "--", mountpoint], capture_output=True,
                              text=True, pass_fds=(theirs.fileno(),),
                              env=dict(os.environ, _FUSE_COMMFD=str(theirs.fileno())),
                              stdin=subprocess.DEVNULL, check=False)
        if done.returncode:
            raise FuseMountError(f"fusermount3: {done.stderr.strip() or done.returncode}")
        _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise FuseMountError("fusermount3 mounted but passed no descriptor back")
    os.set_inheritable(fds[0], False)
    return fds[0]


def clone_fd(master: int) -> int:
    """A new /dev/fuse descriptor on the session of ``master`` (FUSE_DEV_IOC_CLONE): the
    kernel hands each request of the session to whichever of its descriptors reads it
    first, and takes the reply on the descriptor that read the request."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", master))
    except OSError as exc:
        os.close(fd)
        raise FuseMountError(f"cloning the FUSE session (FUSE_DEV_IOC_CLONE): "
                             f"{os.strerror(exc.errno or errno.EIO)}") from exc
    return fd


def unmount_path(mountpoint: str) -> None:
    """Detach the mount (the kernel then ends the session: reads get ENODEV)."""
    if _libc().umount2(mountpoint.encode(), MNT_DETACH) == 0:
        return
    tool = shutil.which("fusermount3")
    if tool is not None:
        subprocess.run([tool, "-u", "-z", mountpoint], capture_output=True,
                       stdin=subprocess.DEVNULL, check=False)

"""The kernel's FUSE protocol as data: linux/fuse.h's opcodes, flags and structures.

Only what the kernel binding (:mod:`.fuse_kernel`) speaks, with the sizes the kernel checks
(fuse_in_header 40 bytes, fuse_attr 88, fuse_entry_out 128, ...).  Protocol 7.31.
"""

from __future__ import annotations

import struct

MAX_REQUEST = 1 << 20           # max_read / max_write: 1 MiB requests both ways
#: ioctl(fd, FUSE_DEV_IOC_CLONE, &master_fd): attach the new /dev/fuse descriptor ``fd`` to
#: the session of ``master_fd``; _IOR(229, 0, uint32_t) in linux/fuse.h
FUSE_DEV_IOC_CLONE = 0x8004E500

KERNEL_MAJOR, OUR_MINOR = 7, 31
ROOT_ID, STATUS_ID, NS_BASE_ID = 1, 2, 16
(LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME,
 LINK, OPEN, READ, WRITE, STATFS, RELEASE) = (1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15,
                                              16, 17, 18)
(FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT, OPENDIR, READDIR,
 RELEASEDIR, FSYNCDIR, ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET, FALLOCATE,
 RENAME2, TMPFILE) = (20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 34, 35, 36, 38, 42, 43,
                      45, 51)
FUSE_ASYNC_READ, FUSE_BIG_WRITES, FUSE_ASYNC_DIO, FUSE_MAX_PAGES = 1, 1 << 5, 1 << 15, 1 << 22
FOPEN_DIRECT_IO, FOPEN_PARALLEL_DIRECT_WRITES = 1, 1 << 6
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8

IN_HDR = struct.Struct("<IIQQIIIHH")             # fuse_in_header, 40
OUT_HDR = struct.Struct("<IiQ")                  # fuse_out_header, 16
IN_SIZE = IN_HDR.size
_ATTR = "QQQQQQIIIIIIIIII"                       # fuse_attr, 88
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)     # fuse_entry_out, 128
ATTR_OUT = struct.Struct("<QII" + _ATTR)         # fuse_attr_out, 104
INIT_IN = struct.Struct("<IIII")                 # major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")      # fuse_init_out, 64
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QII")
RW_IN = struct.Struct("<QQIIQII")                # fuse_read_in / fuse_write_in, 40
WRITE_OUT = struct.Struct("<II")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # fuse_setattr_in, 88
FALLOCATE_IN = struct.Struct("<QQQII")
KSTATFS = struct.Struct("<QQQQQIIII24x")         # fuse_kstatfs, 80
DIRENT = struct.Struct("<QQII")
WRITE_DATA = IN_SIZE + RW_IN.size                # a WRITE's payload starts here (80)
OUT_SIZE = OUT_HDR.size
IO_ARGS = struct.Struct("<8xQI")                 # fuse_read_in / fuse_write_in: offset, size
WRITE_REPLY = struct.Struct("<IiQII")            # fuse_out_header + fuse_write_out, 24

"""The nearest Python-served peer: a RAM disk as an nbdkit Python plugin (API version 2).

Run: ``nbdkit python benchmarks/compare/memplugin.py size=268435456``.  It is as small as a
user's first plugin would be, and as fast as plain Python makes it: a bytearray and slice
copies through memoryviews, with requests served in parallel (the GIL serialises the copies).
"""

import nbdkit  # provided by nbdkit's python plugin at load time

API_VERSION = 2

_size = 256 << 20
_disk = bytearray()
_view = memoryview(b"")


def config(key, value):
    global _size
    if key != "size":
        raise RuntimeError(f"unknown parameter {key!r} (only size=BYTES)")
    _size = int(value)


def config_complete():
    global _disk, _view
    _disk = bytearray(_size)
    _view = memoryview(_disk)


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def open(readonly):
    return 1


def get_size(h):
    return _size


def can_multi_conn(h):
    return True


def pread(h, buf, offset, flags):
    buf[:] = _view[offset:offset + len(buf)]


def pwrite(h, buf, offset, flags):
    _view[offset:offset + len(buf)] = buf


def flush(h, flags):
    pass

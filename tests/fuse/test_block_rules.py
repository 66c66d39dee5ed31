"""VolumeFS's block rules, which both FUSE bindings apply (the kernel binding on its fast
path, the libfuse binding through VolumeFS.read/write): checked on their own here, and end
to end through real mounts in test_mount_io.py."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

from blockfabric.initiator.fusefs import MountOptions, VolumeFS


def ns(nblocks: int = 8, block_size: int = 4096, read_only: bool = False):
    return SimpleNamespace(nblocks=nblocks, block_size=block_size, read_only=read_only)


def fs(read_only: bool = False) -> VolumeFS:
    volume = VolumeFS.__new__(VolumeFS)          # the rules need no controller
    volume.options = MountOptions(read_only=read_only)
    return volume


@pytest.mark.parametrize("offset, size, span", [
    (0, 4096, (0, 4096, 4096)),                 # one whole block
    (100, 10, (0, 4096, 110)),                  # inside one block
    (4000, 200, (0, 8192, 4200)),               # straddling two
    (30000, 8192, (28672, 32768, 32768)),       # clamped at the end (8 blocks)
    (32768, 1, None),                           # at the end: EOF
    (40000, 1, None),                           # past it
])
def test_read_span_rounds_to_blocks_and_clamps_at_the_end(offset, size, span):
    assert VolumeFS.read_span(ns(), offset, size) == span


def test_write_span_clamps_refuses_past_the_end_and_read_only():
    volume = fs()
    assert volume.write_span(ns(), 0, 4096) == 4096
    assert volume.write_span(ns(), 30000, 8192) == 32768 - 30000
    with pytest.raises(OSError) as err:
        volume.write_span(ns(), 32768, 1)
    assert err.value.errno == errno.ENOSPC
    for volume, namespace in ((fs(), ns(read_only=True)), (fs(read_only=True), ns())):
        with pytest.raises(OSError) as err:
            volume.write_span(namespace, 0, 4096)
        assert err.value.errno == errno.EROFS
        assert not volume.writable(namespace)

"""A reservation conflict through the mount is EACCES (docs/reservations.md): another
host (the library, its own host ID) holds Write Exclusive on the module target's n1."""

from __future__ import annotations

import errno
import os
import uuid

import pytest

from blockfabric.initiator import resv
from blockfabric.initiator.host import ConnectOptions, Controller

from .conftest import NQN

HOLDER = uuid.UUID("0000a1a1-0000-4000-8000-000000000001")


@pytest.fixture
def holder(target):
    ctrl = Controller(ConnectOptions(
        traddr="127.0.0.1", trsvcid=target.port, subnqn=NQN, provider="soft",
        hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{HOLDER}", hostid=HOLDER.bytes)).connect()
    ns = ctrl.namespaces[1]
    resv.register(ns, nrkey=0xA1)
    resv.acquire(ns, crkey=0xA1, rtype=1)
    yield ns
    resv.release(ns, crkey=0xA1, rrela=1)           # clear: the module's target as it was
    ctrl.close()


def test_conflict_is_eacces_through_the_mount(make_mount, holder):
    m = make_mount()
    fd = os.open(m.file("n1"), os.O_RDWR)
    try:
        assert len(os.pread(fd, 4096, 0)) == 4096           # Write Exclusive: reads go
        with pytest.raises(OSError) as exc:
            os.pwrite(fd, b"x" * 4096, 0)
            os.fsync(fd)
        assert exc.value.errno == errno.EACCES
        resv.release(holder, crkey=0xA1, rtype=1)
        os.pwrite(fd, b"y" * 4096, 0)
        os.fsync(fd)
    finally:
        os.close(fd)

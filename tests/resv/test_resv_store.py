"""A target that cannot read a namespace's reservation state answers errors, never a guess:
a damaged sidecar makes I/O "namespace not ready" and reservation commands an internal
error, until the state can be read again (here: the operator removed the damaged file)."""

from __future__ import annotations

import time

import pytest

from blockfabric.initiator import resv
from blockfabric.initiator.host import NvmeError
from blockfabric.protocol import StatusCode

from faults.conftest import Restartable, file_config, host
from e2e.conftest import free_port

pytestmark = pytest.mark.timeout(60)


def status(call) -> int:
    try:
        call()
    except NvmeError as exc:
        return int(exc.status)
    return 0


def test_unreadable_state_refuses_io_until_it_is_readable(tmp_path):
    vol = tmp_path / "vol.img"
    sidecar = tmp_path / "vol.img.resv"
    sidecar.write_text('{"gen": 3, "rtype": 1, "holder"')            # torn
    port = free_port()
    target = Restartable(file_config(port, vol), tmp_path)
    try:
        ctrl = host(port)
        ns = ctrl.namespaces[1]
        assert status(lambda: ns.read(0, 4096)) == StatusCode.NS_NOT_READY
        assert status(lambda: ns.write(0, bytes(4096))) == StatusCode.NS_NOT_READY
        assert status(lambda: resv.report(ns)) == StatusCode.INTERNAL_ERROR
        assert status(lambda: resv.register(ns, nrkey=1)) == StatusCode.INTERNAL_ERROR
        assert "reservation state unreadable" in target.log
        sidecar.unlink()
        deadline = time.monotonic() + 10
        while status(lambda: ns.read(0, 4096)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status(lambda: ns.write(0, bytes(4096))) == 0
        resv.register(ns, nrkey=1)
        assert resv.report(ns).regctl == 1 and '"regs"' in sidecar.read_text()
        ctrl.close()
    finally:
        target.stop()
    assert "Traceback" not in target.log, target.log

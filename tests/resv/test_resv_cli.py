"""``blockfabric resv`` with nvme-cli's flags and JSON, against a ramdisk target on
loopback, while another host (the library, its own host ID) holds Write Exclusive.  (The
installed ``blockfabric`` command itself is run by tests/fuse and tests/hostcli.)"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Iterator

import pytest

from blockfabric.initiator import resv
from blockfabric.initiator.cli import main
from blockfabric.initiator.host import ConnectOptions, Controller
from blockfabric.protocol import KeyedSGL, StatusCode
from blockfabric.protocol.admin import GetLogPage

from e2e.conftest import (NQN, TargetProc, free_port, listener, ram_config, transport,  # noqa: F401
                          via)

pytestmark = pytest.mark.timeout(60)
HOLDER = uuid.UUID("0000a1a1-0000-4000-8000-000000000001")
CLI_HOST = "0000c1c1-0000-4000-8000-000000000002"


@pytest.fixture(scope="module")
def module_ram_target(tmp_path_factory):
    """A ramdisk target for the module, on both transports (``.port``, ``.tcp_port``)."""
    port, tcp_port = free_port(), free_port()
    config = ram_config(port)
    config["listeners"].append(listener(tcp_port, transport="tcp"))
    proc = TargetProc(config, tmp_path_factory.mktemp("target")).start()
    proc.port, proc.tcp_port = port, tcp_port
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log, proc.log


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """cli(target, *args, check=True): ``blockfabric resv ARGS`` run in this process (its
    real parser, connection and output; no interpreter start per call)."""
    def run(target, *args: str, check: bool = True) -> Ran:
        rc = main(["resv", *args, "--traddr", "127.0.0.1", "-s", str(target.port),
                   "--nqn", NQN, "--provider", "soft", "-I", CLI_HOST])
        out = capsys.readouterr()
        if check:
            assert rc == 0, out.err
        return Ran(rc, out.out, out.err)
    return run


def holder_controller(target) -> Controller:
    """The HOLDER host's controller on ``target`` (soft provider)."""
    return Controller(ConnectOptions(
        traddr="127.0.0.1", trsvcid=target.port, subnqn=NQN, provider="soft",
        hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{HOLDER}", hostid=HOLDER.bytes)).connect()


@contextlib.contextmanager
def holding(target) -> Iterator[Controller]:
    """HOLDER's controller, registered with key 0xA1 and holding a Write Exclusive
    reservation on namespace 1; cleared again (as the module's tests expect) after."""
    ctrl = holder_controller(target)
    holder = ctrl.namespaces[1]
    try:
        resv.register(holder, nrkey=0xA1)
        resv.acquire(holder, crkey=0xA1, rtype=1)
        yield ctrl
    finally:
        resv.register(holder, nrkey=0xEE, rrega=2, iekey=True)
        resv.release(holder, crkey=0xEE, rrela=1)               # clear: as it was
        ctrl.close()


def test_cli_report_json_conflict_preempt(module_ram_target, cli):
    target = module_ram_target
    ctrl = holder_controller(target)
    holder = ctrl.namespaces[1]
    try:
        resv.register(holder, nrkey=0xA1)
        resv.acquire(holder, crkey=0xA1, rtype=1)
        report = json.loads(cli(target, "report", "-n", "1", "-o", "json").stdout)
        assert (report["rtype"], report["regctl"], report["gen"] >= 1) == (1, 1, True)
        assert report["regctlext"][0] == {"cntlid": 0xFFFF, "rcsts": 1,
                                          "hostid": HOLDER.hex, "rkey": 0xA1}
        out = json.loads(cli(target, "register", "-n", "1", "-k", "0xc1", "-o", "json").stdout)
        assert out["status"] == "success"
        refused = cli(target, "acquire", "-n", "1", "-c", "0xc1", "-t", "1", check=False)
        assert refused.returncode == 1 and "RESERVATION_CONFLICT" in refused.stderr
        # preempt the holder with its key: the CLI host holds, as Exclusive Access
        cli(target, "acquire", "-n", "1", "-c", "0xc1", "-p", "0xa1", "-t", "2", "-a", "1")
        text = cli(target, "report", "-n", "1").stdout
        assert "rtype     : 2 (exclusive-access)" in text and "regctl    : 1" in text
        assert f"hostid     : {uuid.UUID(CLI_HOST).hex}" in text and "rkey       : c1" in text
        assert resv.notification_log(ctrl).log_type == 1        # the holder was preempted
    finally:
        resv.register(holder, nrkey=0xEE, rrega=2, iekey=True)
        resv.release(holder, crkey=0xEE, rrela=1)               # clear: as it was
        ctrl.close()


def test_a_refused_log_read_does_not_take_the_notification(module_ram_target, cli):
    """Get Log Page 0x80 with an offset past its 64 bytes is Invalid Field, and the entry
    it would have taken is still there for the next read (it was popped before the offset
    was checked, and lost)."""
    target = module_ram_target
    with holding(target) as ctrl:
        cli(target, "register", "-n", "1", "-k", "0xc1", "-o", "json")
        cli(target, "acquire", "-n", "1", "-c", "0xc1", "-p", "0xa1", "-t", "2", "-a", "1")
        mr = ctrl.arena.mr
        sqe = GetLogPage(lid=0x80, numd=15, lpo=128).to_sqe(
            sgl=KeyedSGL(mr.addr, 64, mr.rkey)).pack()
        cqe = ctrl.raw(ctrl.admin, sqe)
        assert cqe.status == StatusCode.INVALID_FIELD, cqe
        assert resv.notification_log(ctrl).log_type == 1        # still there


def test_identify_features_and_mask(module_ram_target, transport):
    """RESCAP (no PTPL on a ramdisk), ONCS bit 5, CTRATT bit 0; Get Features 0x81 needs
    EXHID; 0x83 refuses PTPL here; a masked notice is not logged; over both transports."""
    from blockfabric.initiator.host import NvmeError
    from blockfabric.protocol import StatusCode
    from blockfabric.protocol import resv as resv_protocol
    from blockfabric.protocol.capsule import SQE

    target = module_ram_target
    opts = dict(traddr="127.0.0.1", subnqn=NQN, **via(transport),
                trsvcid=target.tcp_port if transport == "tcp" else target.port)
    a = Controller(ConnectOptions(**opts, hostid=HOLDER.bytes,
                                  hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{HOLDER}")
                   ).connect()
    b = Controller(ConnectOptions(**opts, hostid=uuid.UUID(CLI_HOST).bytes,
                                  hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{CLI_HOST}")
                   ).connect()
    try:
        assert a.identify.oncs & resv_protocol.ONCS_RESERVATIONS and a.identify.ctratt & 1
        assert a.namespaces[1].identify.rescap == 0xFE            # all types, IEKEY, no PTPL
        get = SQE(opcode=0x0A, cdw10=resv_protocol.FID_HOST_ID, cdw11=1)
        assert a.wait(a.admin, get, "Get Features 0x81", data_in=16)[1] == HOLDER.bytes
        with pytest.raises(NvmeError) as exc:
            a.wait(a.admin, SQE(opcode=0x0A, cdw10=resv_protocol.FID_HOST_ID), "no EXHID",
                   data_in=16)
        assert exc.value.status == StatusCode.INVALID_FIELD
        assert resv.get_persistence(a, 1) is False
        with pytest.raises(NvmeError) as exc:
            a.wait(a.admin, SQE(opcode=0x09, nsid=1, cdw10=resv_protocol.FID_RESV_PERSIST, cdw11=1),
                   "Set Features 0x83")
        assert exc.value.status == StatusCode.INVALID_FIELD
        na, nb = a.namespaces[1], b.namespaces[1]
        resv.register(na, nrkey=1)
        resv.register(nb, nrkey=2)
        resv.set_notification_mask(a, resv_protocol.MASK_REG_PREEMPTED, nsid=1)
        resv.acquire(nb, crkey=2, prkey=1, rtype=1, racqa=1)        # a preempted, masked
        assert resv.notification_log(a).log_type == 0
        resv.set_notification_mask(a, 0)
        resv.register(na, nrkey=1)
        resv.acquire(nb, crkey=2, prkey=1, rtype=1, racqa=1)        # now logged
        entry = resv.notification_log(a)
        assert (entry.log_type, entry.nsid, entry.available) == (1, 1, 0)
    finally:
        resv.release(nb, crkey=2, rrela=1)
        a.close()
        b.close()

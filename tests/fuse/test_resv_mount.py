"""A reservation conflict through the mount is EACCES (docs/reservations.md), and the
``blockfabric resv`` commands with nvme-cli's flags and JSON, against the module's target:
another host (the library, its own host ID) holds Write Exclusive on n1."""

from __future__ import annotations

import errno
import json
import os
import uuid

import pytest

from blockfabric.initiator import resv
from blockfabric.initiator.host import ConnectOptions, Controller

from .conftest import NQN, run_cli

HOLDER = uuid.UUID("0000a1a1-0000-4000-8000-000000000001")
CLI_HOST = "0000c1c1-0000-4000-8000-000000000002"


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


def cli(target, *args: str, check: bool = True):
    return run_cli("resv", *args, "--traddr", "127.0.0.1", "-s", str(target.port),
                   "--nqn", NQN, "--provider", "soft", "-I", CLI_HOST, check=check)


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


def test_cli_report_json_and_conflict(target, holder):
    report = json.loads(cli(target, "report", "-n", "1", "-o", "json").stdout)
    assert (report["rtype"], report["regctl"], report["gen"] >= 1) == (1, 1, True)
    assert report["regctlext"][0] == {"cntlid": 0xFFFF, "rcsts": 1, "hostid": HOLDER.hex,
                                      "rkey": 0xA1}
    out = json.loads(cli(target, "register", "-n", "1", "-k", "0xc1", "-o", "json").stdout)
    assert out["status"] == "success"
    refused = cli(target, "acquire", "-n", "1", "-c", "0xc1", "-t", "1", check=False)
    assert refused.returncode == 1 and "RESERVATION_CONFLICT" in refused.stderr
    # preempt the holder with its key: the CLI host holds, as Exclusive Access
    cli(target, "acquire", "-n", "1", "-c", "0xc1", "-p", "0xa1", "-t", "2", "-a", "1")
    report = json.loads(cli(target, "report", "-n", "1", "-o", "json").stdout)
    assert (report["rtype"], report["regctl"]) == (2, 1)
    assert report["regctlext"][0]["hostid"] == uuid.UUID(CLI_HOST).hex
    cli(target, "release", "-n", "1", "-c", "0xc1", "-t", "2", "-a", "1")    # clear
    text = cli(target, "report", "-n", "1").stdout
    assert "regctl    : 0" in text and "rtype     : 0" in text
    resv.register(holder, nrkey=0xA1)        # the fixture's clear needs a registration

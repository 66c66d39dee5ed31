"""A mount on the target's own machine: the soft provider's same-host connections carry the
data through shared memory (blockfabric.rdma.soft), seen from outside: the bytes read back
through the mount, and ``blockfabric-target status`` lists the host's queues as same-host
with the regions they map; with BLOCKFABRIC_SOFT_SHM=0 the same mount goes over TCP."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from e2e.conftest import TargetProc, free_port
from helpers.targetstatus import settled

from .conftest import MiB, NQN, Mount

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("same-host-target")
    port = free_port()
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
              "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                  {"nsid": 1, "backend": "ramdisk", "size": "64MiB"}]}],
              "control_socket": str(base / "control.sock")}
    proc = TargetProc(config, base).start()
    proc.port, proc.socket = port, config["control_socket"]
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log, proc.log


def _io_queues(st: dict) -> list[dict]:
    ctrls = [c for c in st["controllers"] if not c["discovery"] and c["subnqn"] == NQN]
    return [q for c in ctrls for q in c["queues"] if q["qid"]]


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "tcp"])
def test_a_mount_on_the_targets_machine_moves_data_through_shared_memory(target, tmp_path,
                                                                         shm):
    m = Mount(target, tmp_path)
    if not shm:
        m.env["BLOCKFABRIC_SOFT_SHM"] = "0"
    m.start()
    try:
        data = random.Random(3).randbytes(8 * MiB)
        src = tmp_path / "src"
        src.write_bytes(data)
        dev = m.file("n1")
        for argv in (["dd", f"if={src}", f"of={dev}", "bs=1M", "oflag=direct", "conv=notrunc"],
                     ["dd", f"if={dev}", f"of={tmp_path / 'back'}", "bs=1M", "count=8",
                      "iflag=direct"]):
            subprocess.run(argv, check=True, capture_output=True, timeout=60)
        assert (tmp_path / "back").read_bytes() == data
        st = settled(target.socket, lambda s: _io_queues(s))
        queues = _io_queues(st)
        assert queues
        peers = {c["peer"] for c in st["controllers"] if c["subnqn"] == NQN}
        if shm:
            # the host's I/O arena and its FUSE request buffers, mapped by every I/O queue
            assert all(q.get("same_host") for q in queues), queues
            assert min(q["shared_regions"] for q in queues) >= 2, queues
            assert peers == {f"local:{m.pid}"}
            text = subprocess.run([os.path.join(os.path.dirname(sys.executable),
                                                "blockfabric-target"), "status", "--socket",
                                   target.socket], capture_output=True, text=True,
                                  check=True).stdout
            assert "same host: shared memory" in text
            assert "same host: data through shared memory" in m.status()
        else:
            assert "same host" not in m.status()
            assert not any(q.get("same_host") for q in queues), queues
            assert all(p.startswith("127.0.0.1:") for p in peers), peers
    finally:
        m.cleanup()


def test_writes_fetched_through_shared_memory_verify_at_depth(target, tmp_path):
    """Writes larger than a capsule carries (16 KiB and 1 MiB, 16 in flight, two jobs at
    once) are fetched by the target with RDMA READs that copy out of the host's FUSE
    buffers at their post; they complete behind answers the host has yet to acknowledge,
    which the target asks for (ACK_REQ).  Every block reads back as written."""
    m = Mount(target, tmp_path, name="fetched")
    m.start()
    try:
        jobs = [["--name=mid", "--bs=16k", "--size=8M", "--offset=0"],
                ["--name=big", "--bs=1m", "--size=16M", "--offset=16M"]]
        procs = [subprocess.Popen(
            ["fio", *job, f"--filename={m.file('n1')}", "--direct=1", "--ioengine=libaio",
             "--iodepth=16", "--rw=randwrite", "--verify=crc32c", "--verify_fatal=1",
             "--do_verify=1", "--randrepeat=1", "--verify_state_save=0",
             "--output-format=terse"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for job in jobs]
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, out + err
        assert "same host: data through shared memory" in m.status()
    finally:
        m.cleanup()

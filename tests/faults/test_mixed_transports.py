"""Multipath across transports (issue #18): one subsystem reached through a soft-RDMA
listener and an NVMe/TCP listener at once, one FUSE mount using both (``-t`` for the first
path, ``--path tcp://`` or ``rdma://`` for the other).  fio writes and verifies (crc32c)
through ``n1`` while I/O goes round-robin over both; then a proxy cuts the path of one
transport for good, and the I/O must finish over the other with no error."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from blockfabric.initiator.host import ConnectOptions, Controller, HostMemory
from e2e.conftest import addr_of, cli_via, listener, via
from fuse.conftest import NQN as FUSE_NQN

from .conftest import Restartable, file_config, free_port
from .proxy import THROUGH_A_PROXY, TcpProxy
from .test_fuse_faults import FaultMount, fio_verify, recovery

pytestmark = pytest.mark.timeout(90)


def paths_of(status: str) -> dict[str, str]:
    """.status's paths section: path (with its transport://) -> the rest of its line."""
    lines = status.split("paths (ANA state per namespace; * where I/O goes)\n", 1)[1]
    out = {}
    for line in lines.splitlines():
        if not line.startswith("  "):
            break
        path, _, rest = line.strip().partition(" ")
        out[path] = rest
    return out


def two_transports(tmp_path) -> tuple[Restartable, dict[str, int]]:
    """A target with one file-backed namespace behind an RDMA listener (soft, or verbs in a
    verbs run) and an NVMe/TCP listener."""
    ports = {"rdma": free_port(), "tcp": free_port()}
    config = file_config(ports["rdma"], tmp_path / "vol.img")
    config["subsystems"][0]["nqn"] = FUSE_NQN
    config["listeners"].append(listener(ports["tcp"], transport="tcp"))
    return Restartable(config, tmp_path), ports


def test_registered_memory_moves_over_both_transports(tmp_path):
    """The library as the bench and the kernel-binding mount use it: memory registered once
    with ``ctrl.pd``, I/O by (addr, rkey) round-robin over an RDMA and a TCP path, both
    carrying it; the data reads back whole, and deregistering drops the keys the TCP path
    resolves."""
    target, ports = two_transports(tmp_path)
    opts = ConnectOptions(traddr=addr_of(), subnqn=FUSE_NQN, trsvcid=ports["rdma"],
                          **via(), nr_io_queues=1,
                          paths=[(addr_of("tcp"), ports["tcp"], "tcp")])
    try:
        with Controller(opts).connect() as ctrl:
            assert [pc.opts.transport for pc in ctrl.path_ctrls] == ["rdma", "tcp"]
            ns = ctrl.namespaces[1]
            mem = HostMemory(ctrl.pd, 2 << 20)
            pattern = os.urandom(1 << 20)

            def run(opcode: int, at: int, offset: int) -> None:
                done, errors = threading.Event(), []

                def cb(error) -> None:
                    errors.append(error)
                    done.set()
                ctrl.submit_registered(ns, opcode, offset, 1 << 20, mem.addr + at, mem.rkey, cb)
                assert done.wait(20) and errors == [None], errors
            mem.view[:1 << 20] = pattern
            for i in range(4):                  # 4 writes: 2 per path (one queue each)
                run(0x01, 0, i << 20)
            for i in reversed(range(4)):    # reversed: mostly on the other path
                mem.view[1 << 20:] = bytes(1 << 20)
                run(0x02, 1 << 20, i << 20)
                assert mem.view[1 << 20:] == pattern, i
            per_path = [sum(st["completed"] for qid, st in pc.queue_stats().items() if qid)
                        for pc in ctrl.path_ctrls]
            assert all(n >= 4 for n in per_path), per_path   # MDTS pieces on each path
            keys = ctrl.pd.ctx.rkeys
            assert mem.rkey in keys
            mem.close()
            assert mem.rkey not in keys
    finally:
        target.stop()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is missing (Debian package fio)")
@pytest.mark.parametrize("cut", ["rdma", "tcp"])
@THROUGH_A_PROXY
def test_fio_verify_survives_losing_either_transport(cut, tmp_path):
    """The path over ``cut`` goes through a proxy (the mount's -a/-s and -t); the other
    transport's listener is reached directly with --path.  Both serve; the proxy then
    drops every connection and refuses new ones."""
    target, ports = two_transports(tmp_path)
    proxy = TcpProxy(("127.0.0.1", ports[cut]))
    target.port = target.tcp_port = proxy.port
    other = "tcp" if cut == "rdma" else "rdma"
    first = f"{cut}://127.0.0.1:{proxy.port}"
    second = f"{other}://127.0.0.1:{ports[other]}"
    mount = FaultMount(target, tmp_path, loss_tmo=20,
                       extra=("--path", second, *cli_via()))
    mount.transport = cut
    try:
        mount.start()
        status = mount.status()
        assert f"paths: {first}, {second})" in status, status
        before = paths_of(status)
        over = {"rdma": "n1 optimized* (over rdma, soft provider)",
                "tcp": "n1 optimized* (over tcp)"}
        assert before[first].startswith("live, controller "), before
        assert before[first].endswith(over[cut]), before
        assert before[second].endswith(over[other]), before
        fio = fio_verify(mount, tmp_path)
        proxy.wait_forwarded(1 << 20)       # fio's data crossed the proxied path too
        proxy.down()
        out, err = fio.communicate(timeout=60)
        assert fio.returncode == 0, out + err + mount.logs()
        status = mount.status()
        rec = recovery(status)
        assert rec["failovers"] >= 1 and rec["failed"] == 0, status
        after = paths_of(status)
        assert after[second].endswith(over[other]), status
        assert "*" not in after[first], status
        assert mount.counter("errors") == 0
    finally:
        mount.cleanup()
        proxy.close()
        target.stop()
    assert "Traceback" not in target.log, target.log

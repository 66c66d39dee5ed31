"""The host CLI against a real daemon, stable identity across restarts, several hosts."""

from __future__ import annotations

import json
import os
import subprocess
import threading

from blockfabric.initiator.host import connect

from .conftest import BIN, HOSTNQN, NQN, OTHER_HOSTNQN, addr_of, cli_via, free_port, ram_config, via
from .workload import verify_workload


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "blockfabric"), *argv], capture_output=True, text=True,
                          timeout=60)


def test_cli_discover_connect_identify(ram_target):
    port = str(ram_target.port)
    common = ["-a", addr_of(), "-s", port, *cli_via(), "-q", HOSTNQN]
    res = cli("discover", *common, "-o", "json")
    assert res.returncode == 0, res.stderr
    records = json.loads(res.stdout)["records"]
    assert [(r["subnqn"], r["traddr"], r["trsvcid"]) for r in records] == \
        [(NQN, addr_of(), port)]

    res = cli("connect", *common, "-n", NQN, "-i", "3", "-Q", "64", "-o", "json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert (info["io_queues"], info["queue_size"]) == (3, 64)
    assert info["namespaces"] == [{"nsid": 1, "size": 64 << 20, "block_size": 4096,
                                   "blocks": 16384, "read_only": False,
                                   "nguid": info["namespaces"][0]["nguid"]}]
    assert info["paths"] == [f"{addr_of()}:{port}"]
    res = cli("connect", *common, "-n", NQN)
    assert res.returncode == 0 and "namespace 1: 64 MiB" in res.stdout, res.stdout
    assert "paths" not in res.stdout
    # Every path is connected at once and listed with its state; the ones that do not
    # answer (nothing listens there) keep reconnecting while the first serves.
    res = cli("connect", *common, "-n", NQN, "--path", "[::1]", "--path", "127.0.0.2:4430")
    assert res.returncode == 0, res.stderr
    assert "paths (ANA state per namespace; * where I/O goes):" in res.stdout, res.stdout
    assert f"+- {addr_of()}:{port} live, controller " in res.stdout, res.stdout
    assert "n1 optimized*" in res.stdout, res.stdout
    assert "+- 127.0.0.2:4430 reconnecting: n1 -" in res.stdout, res.stdout
    assert "re-ranked" not in res.stderr, res.stderr      # closing is no failover

    res = cli("identify", *common, "-n", NQN, "-o", "json")
    assert res.returncode == 0, res.stderr
    ident = json.loads(res.stdout)
    assert ident["controller"]["subnqn"] == NQN
    assert ident["controller"]["sqes"] == 0x66 and ident["controller"]["cqes"] == 0x44
    assert ident["namespaces"]["1"]["nsze"] == 16384


def test_cli_errors_are_one_clear_line(ram_target):
    common = ["-a", addr_of(), "-s", str(ram_target.port), *cli_via()]
    res = cli("connect", *common, "-n", "nqn.2026-12.io.blockfabric:nope")
    assert res.returncode == 1
    assert "CONNECT_INVALID_PARAM" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("connect", "-a", addr_of(), "-s", str(free_port()), *cli_via(),
              "-n", NQN)
    assert res.returncode == 1 and "refused" in res.stderr


def test_identity_is_stable_across_restarts(start_target, tmp_path):
    port = free_port()
    config = ram_config(port, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(tmp_path / "a.img"), "size": "4MiB"},
        {"nsid": 2, "backend": "ramdisk", "size": "4MiB"}])
    seen = []
    for _ in range(2):
        target = start_target(config)
        with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN) as ctrl:
            seen.append((ctrl.identify.sn, ctrl.identify.mn,
                         {n: ns.nguid for n, ns in ctrl.namespaces.items()}))
        target.stop()
    assert seen[0] == seen[1]
    assert seen[0][2][1] != seen[0][2][2] and all(any(v) for v in seen[0][2].values())


def test_write_zeroes_and_discard(start_target, tmp_path):
    port = free_port()
    path = tmp_path / "z.img"
    start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(path), "size": "8MiB"},
        {"nsid": 2, "backend": "ramdisk", "size": "8MiB"}]))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN) as ctrl:
        written = {}
        for nsid, ns in ctrl.namespaces.items():
            data = written[nsid] = os.urandom(1 << 20)
            ns.write(0, data)
            ns.write_zeroes(4096, 8192)
            ns.discard(65536, 131072)
            expect = bytearray(data)
            expect[4096:12288] = bytes(8192)
            expect[65536:196608] = bytes(131072)
            assert ns.read(0, 1 << 20) == bytes(expect)
        ctrl.namespaces[1].flush()
    on_disk = path.read_bytes()
    assert on_disk[4096:12288] == bytes(8192) and on_disk[65536:196608] == bytes(131072)
    assert on_disk[:4096] == written[1][:4096]


#: (a UUID-form NQN must carry a UUID: the target checks NQNs as the spec says)
THIRD_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:33333333-2222-3333-4444-555555555555"


def test_several_hosts_at_once(ram_target):
    errors: list[BaseException] = []
    results: list[dict] = []

    def host(hostnqn: str, seed: int, region: int) -> None:
        try:
            with connect(addr_of(), NQN, ram_target.port, **via(),
                         hostnqn=hostnqn, nr_io_queues=2) as ctrl:
                ns = ctrl.namespaces[1]
                # each host in its own 16 MiB region of the shared namespace
                view = _Region(ns, region * (16 << 20), 16 << 20)
                results.append(verify_workload(view, seed, ops=120, inflight=16))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=host, args=(nqn, i, i))
               for i, nqn in enumerate([HOSTNQN, OTHER_HOSTNQN, THIRD_HOSTNQN])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 3 and all(r["bytes_verified"] for r in results)
    assert ram_target.log.count("created (kato") >= 3


class _Region:
    """A window of a namespace, so several hosts can verify side by side."""

    def __init__(self, ns, start: int, size: int) -> None:
        self.ns, self.start = ns, start
        self.block_size = ns.block_size
        self.nblocks = size // ns.block_size

    def submit_write(self, offset, data):
        return self.ns.submit_write(self.start + offset, data)

    def submit_read(self, offset, length):
        return self.ns.submit_read(self.start + offset, length)

"""The host side placed: ``blockfabric bench`` and ``blockfabric mount`` with --cpus, and
auto placement on the NUMA node of the NIC the route to the target leaves by (a fake
two-node sysfs tree where lo is on node 1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from bench.conftest import bench_cmd
from e2e.conftest import NQN, free_port, ram_config, start_target  # noqa: F401

from blockfabric import numa

from .conftest import make_sysfs
from .test_target_placement import allowed_cpus


@pytest.fixture
def soft_target(start_target):
    port = free_port()
    config = ram_config(port)
    config["listeners"][0]["provider"] = "soft"
    proc = start_target(config)
    proc.port = port
    return proc


def bench_json(port: int, *flags: str, env: dict | None = None) -> dict:
    done = subprocess.run(bench_cmd(port, "-o", "json", "--runtime", "0.3", *flags),
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_bench_auto_placement_follows_the_routes_nic(soft_target, tmp_path):
    sysfs = make_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, netdevs={"lo": 1})
    result = bench_json(soft_target.port, env={numa.SYSFS_ENV: str(sysfs)})
    placement = result["blockfabric"]["placement"]
    assert placement["cpus"] == "1", placement
    assert "route to 127.0.0.1: netdev lo on node 1" in placement["reason"]


def test_bench_on_a_one_node_machine_is_not_placed(soft_target):
    placement = bench_json(soft_target.port)["blockfabric"]["placement"]
    if len(numa.Topology().nodes()) == 1:
        assert placement == {"cpus": None, "node": None, "memory_policy": "default",
                             "reason": "one NUMA node"}


def test_bench_cpus_in_one_process(soft_target):
    cpu = max(os.sched_getaffinity(0))
    placement = bench_json(soft_target.port, "--cpus", str(cpu))["blockfabric"]["placement"]
    assert placement["cpus"] == str(cpu)


@pytest.mark.skipif(shutil.which("fusermount3") is None, reason="no fusermount3")
def test_mount_cpus_pins_every_thread_of_the_mount(soft_target, tmp_path):
    from fuse.conftest import Mount

    cpu = max(os.sched_getaffinity(0))

    class PinnedMount(Mount):
        def argv(self) -> list[str]:
            argv = super().argv()
            argv[argv.index("-n") + 1] = NQN          # the e2e target's subsystem
            return argv[:-1] + ["--cpus", str(cpu), argv[-1]]

    mount = PinnedMount(soft_target, tmp_path)
    try:
        mount.start()
        with open(mount.file("n1"), "r+b") as f:
            f.write(b"m" * 4096)
            f.flush()
            os.fsync(f.fileno())
        threads = allowed_cpus(mount.pid)
        assert len(threads) >= 2 and set(threads.values()) == {frozenset({cpu})}, threads
    finally:
        mount.cleanup()

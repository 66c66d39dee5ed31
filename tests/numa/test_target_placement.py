"""A started target put where its configuration says: its threads' CPU affinity read from
/proc/PID/task/*/status, its placement and memory as ``status`` reports them."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from e2e.conftest import BIN, NQN, free_port, ram_config, start_target  # noqa: F401

from blockfabric import numa
from blockfabric.initiator.host import connect

from .conftest import make_sysfs


def allowed_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Cpus_allowed_list of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out[int(tid)] = numa.parse_cpulist(line.split(":", 1)[1])
        except FileNotFoundError:
            pass
    return out


def status(proc) -> dict:
    done = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket",
                           proc.config["control_socket"], "--output-format", "json"],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def placed_config(tmp_path, **keys):
    port = free_port()
    config = ram_config(port)
    config["listeners"][0]["provider"] = "soft"
    config.update(control_socket=str(tmp_path / "t.sock"), **keys)
    return port, config


def test_cpus_zero_runs_every_thread_of_the_target_on_cpu_0(start_target, tmp_path):
    port, config = placed_config(tmp_path, cpus="0")
    proc = start_target(config)
    ctrl = connect("127.0.0.1", NQN, port, provider="soft", nr_io_queues=1)
    try:
        ctrl.namespaces[1].write(0, b"z" * 4096)       # the backend threads are started by now
        threads = allowed_cpus(proc.proc.pid)
        assert len(threads) >= 2 and set(threads.values()) == {frozenset({0})}, threads
        st = status(proc)["placement"]
        assert st["cpus"] == "0" and st["reactor"]["cpus"] == "0"
        assert st["reactor"]["last_cpu"] == 0 and st["reactor"]["nodes"] == [0]
        assert st["node"] is None and st["memory"] == []     # cpus only: memory not placed
    finally:
        ctrl.close()
    text = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket",
                           config["control_socket"]], capture_output=True, text=True).stdout
    assert "placement: reactor on CPUs 0 (node 0, last ran on CPU 0)" in text, text


def test_numa_node_puts_ramdisk_and_buffers_on_it_and_status_reads_it_back(start_target,
                                                                          tmp_path):
    mport = free_port()
    port, config = placed_config(tmp_path, numa_node=0, numa_memory="bind",
                                 metrics={"port": mport})
    proc = start_target(config)
    if "memory not placed" in proc.log:
        pytest.skip("this kernel has no memory policy: " + proc.log)
    ctrl = connect("127.0.0.1", NQN, port, provider="soft", nr_io_queues=1)
    try:
        for i in range(8):
            ctrl.namespaces[1].write(i * 4096, b"q" * 4096)
        st = status(proc)["placement"]
    finally:
        ctrl.close()
    assert st["node"] == 0 and st["memory_policy"] == "bind"
    regions = {m["what"]: m for m in st["memory"]}
    assert regions["ramdisks"]["policy"] == "bind:0", regions
    assert regions["ramdisks"]["bytes"] == 64 << 20
    assert regions["ramdisks"]["pages_by_node"]["0"] >= 8      # the blocks written
    assert regions["buffer pools"]["policy"] == "bind:0"
    assert set(allowed_cpus(proc.proc.pid).values()) == {frozenset(os.sched_getaffinity(0))
                                                         & frozenset(numa.Topology().nodes()[0])}
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=20).read().decode()
    assert 'memory_node="0",memory_policy="bind"' in text, text
    pages = [line for line in text.splitlines()
             if line.startswith('blockfabric_placed_memory_pages{region="ramdisks",node="0"}')]
    assert pages and int(float(pages[0].split()[-1])) >= 8, text


def test_auto_on_a_fake_two_node_machine_pins_to_the_nics_node(start_target, tmp_path):
    """lo is given node 1 in the fake tree: auto pins to node 1's CPU; the real kernel (one
    node) refuses memory on node 1, which the target reports and survives."""
    sysfs = make_sysfs(tmp_path / "sys", {0: "0", 1: "1"}, netdevs={"lo": 1})
    port, config = placed_config(tmp_path)
    proc = start_target(config, env={numa.SYSFS_ENV: str(sysfs)})
    assert set(allowed_cpus(proc.proc.pid).values()) == {frozenset({1})}
    st = status(proc)["placement"]
    assert st["cpus"] == "1" and st["reactor"]["cpus"] == "1"
    assert "auto: listener 127.0.0.1:" in st["reason"] and "netdev lo on node 1" in st["reason"]
    if "memory not placed on node 1" in proc.log:
        assert st["node"] is None and st["memory"] == []
    ctrl = connect("127.0.0.1", NQN, port, provider="soft", nr_io_queues=1)
    try:
        ctrl.namespaces[1].write(0, b"k" * 4096)
        assert ctrl.namespaces[1].read(0, 4096) == b"k" * 4096
    finally:
        ctrl.close()


def test_one_node_machine_runs_unplaced_as_before(start_target, tmp_path):
    port, config = placed_config(tmp_path)
    before = frozenset(os.sched_getaffinity(0))
    proc = start_target(config, env={numa.SYSFS_ENV: str(make_sysfs(
        tmp_path / "sys", {0: "0-1"}, netdevs={"lo": 0}))})
    assert set(allowed_cpus(proc.proc.pid).values()) == {before}
    assert "target placed" not in proc.log and "mbind" not in proc.log
    st = status(proc)["placement"]
    assert (st["cpus"], st["node"], st["reason"]) == (None, None, "one NUMA node")


def test_check_refuses_a_node_or_cpus_this_machine_lacks(tmp_path):
    for key, value in (("numa_node", 9), ("cpus", "0-4095")):
        _port, config = placed_config(tmp_path, **{key: value})
        path = tmp_path / "bad.yaml"
        import yaml
        path.write_text(yaml.safe_dump(config))
        done = subprocess.run([str(BIN / "blockfabric-target"), "check", "-C", str(path)],
                              capture_output=True, text=True, timeout=20)
        assert done.returncode == 2 and f"{key}: expected" in done.stderr, done.stderr


def test_a_reload_that_changes_placement_says_it_needs_a_restart(start_target, tmp_path):
    import signal

    import yaml
    _port, config = placed_config(tmp_path)
    proc = start_target(config)
    before = allowed_cpus(proc.proc.pid)
    proc.path.write_text(yaml.safe_dump(dict(config, cpus="0")))
    proc.proc.send_signal(signal.SIGHUP)
    assert proc.wait_log("a reload does not move a running target", 10), proc.log
    assert allowed_cpus(proc.proc.pid) == before

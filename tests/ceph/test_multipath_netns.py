"""A gateway group and its host in two network namespaces joined by veth (issue 16's
acceptance): the throwaway cluster and both gateways run in namespace B (the cluster on B's
own loopback, the gateways' listeners on B's veth address), the FUSE mount runs in
namespace A with both paths, and fio verifies crc32c through it while the optimized gateway
is SIGKILLed and then started again.  fio must finish without an error; the mount's .status
gives the times printed: SIGKILL -> the survivor's path optimized and serving, restart ->
failback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from e2e.conftest import TargetProc, free_port
from helpers.netns import netns_pair  # noqa: F401  (the fixture)

from .conftest import HERE, Cluster
from .test_gateway import gateway_config, wait_for
from .test_multipath import PathsMount

pytestmark = [pytest.mark.netns, pytest.mark.timeout(150)]


class NsCluster(Cluster):
    """The throwaway cluster, started inside a network namespace: it listens on that
    namespace's loopback, so every client (rbd, the gateways) runs there too."""

    def __init__(self, directory: str, netns: str) -> None:
        super().__init__(directory)
        self.netns = netns

    def rbd(self, *args: str, timeout: float = 30) -> str:
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", "rbd", "--conf",
                               self.conf, *args], check=True, text=True,
                              capture_output=True, timeout=timeout).stdout


class NsPathsMount(PathsMount):
    """PathsMount from namespace A, to the gateways' address in namespace B (nsenter --net
    only: the FUSE mount is made in this mount namespace, where fio runs)."""

    def __init__(self, ports, base, netns: str, address: str) -> None:
        super().__init__(ports, base)
        self.netns, self.address = netns, address

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("-a") + 1] = self.address
        argv[argv.index("--path") + 1] = f"{self.address}:{self.ports[1]}"
        return argv

    def program(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *super().program()]


@pytest.fixture
def ns_ceph(netns_pair):
    if shutil.which("nsenter") is None:
        pytest.skip("nsenter (util-linux) is missing")
    ns = netns_pair.names[1]
    directory = tempfile.mkdtemp(prefix="blockfabric-ceph-ns.")
    try:
        subprocess.run(["nsenter", f"--net=/run/netns/{ns}", str(HERE / "ceph-up.sh"),
                        directory], check=True, timeout=90, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, CEPH_IMAGE=""))
        yield NsCluster(directory, ns)
    finally:
        if os.path.exists(os.path.join(directory, "ceph.conf")):
            subprocess.run([str(HERE / "ceph-down.sh"), directory], timeout=60)


def _path_line(status: str, path: str) -> str:
    """The line of the .status "paths" section for ``path``."""
    return next((line for line in status.splitlines()
                 if line.strip().startswith(path + " ")), "")


def _serving(mount, path: str, timeout: float, what: str) -> float:
    """Wait until the mount's .status shows ``path`` optimized and taking the I/O."""
    try:
        return wait_for(lambda: "n1 optimized*" in _path_line(mount.status(), path), timeout,
                        what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n.status:\n{mount.status()}\nmount log:\n"
                             f"{mount.log()}") from None


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is missing")
def test_fio_through_the_mount_in_one_namespace_survives_gateway_failover_in_another(
        ns_ceph, netns_pair, tmp_path):
    ceph, (ns_a, ns_b), addr = ns_ceph, netns_pair.names, netns_pair.ipv4[1]
    image, group = f"gw-{uuid.uuid4().hex[:8]}", f"g{uuid.uuid4().hex[:6]}"
    ceph.rbd("create", "--size", "64M", "--image-feature", "layering", f"{ceph.pool}/{image}")
    ports = free_port(), free_port()
    confs = [gateway_config(ceph, [image], ports[0], "gw-a", group, (1, 99), [1]),
             gateway_config(ceph, [image], ports[1], "gw-b", group, (100, 199), [])]
    for conf in confs:
        conf["listeners"][0]["address"] = addr
    procs = [TargetProc(c, tmp_path, netns=ns_b).start() for c in confs]
    mount = None
    a, b = (f"{addr}:{p}" for p in ports)
    try:
        mount = NsPathsMount(ports, tmp_path, ns_a, addr).start()
        _serving(mount, a, 15, "A optimized and serving")
        assert "n1 non-optimized" in _path_line(mount.status(), b), mount.status()
        fio = subprocess.Popen(
            ["fio", "--name=verify", f"--filename={mount.file('n1')}", "--rw=randwrite",
             "--bs=4k", "--size=16m", "--iodepth=8", "--ioengine=libaio", "--direct=1",
             "--time_based", "--runtime=16", "--verify=crc32c", "--verify_backlog=64",
             "--verify_fatal=1", "--verify_state_save=0", "--output-format=terse"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)
        procs[0].proc.send_signal(signal.SIGKILL)
        procs[0].proc.wait(5)
        took = _serving(mount, b, 20, "B optimized and serving")
        time.sleep(1.0)
        restarted = time.monotonic()
        procs[0] = TargetProc(confs[0], tmp_path, netns=ns_b).start()
        failback = _serving(mount, a, 30, "failback to A")
        status = mount.status()
        fout, ferr = fio.communicate(timeout=90)
        print(f"\nnetns multipath: SIGKILL -> B optimized and serving {took:.2f} s; restarted "
              f"gateway ready -> failback {failback:.2f} s ({time.monotonic() - restarted:.2f}"
              f" s from its start command)\n{status}")
        assert fio.returncode == 0, fout + ferr + "\nmount log:\n" + mount.log()
        assert re.search(r"failed 0\b", status), status
        assert mount.counter("errors") == 0, mount.log()
    finally:
        if mount is not None:
            mount.cleanup()
        for p in procs:
            p.stop()
            assert "Traceback" not in p.log, p.log

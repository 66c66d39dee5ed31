"""A throwaway single-node Ceph cluster (one monitor, one memstore OSD, no mgr) for the RBD
tests: brought up once per test session by ``ceph-up.sh`` (about 1.4 s), taken down by pid
with ``ceph-down.sh``.  The Debian packages come from the Makefile's DEB_PKGS.

The daemons run on 127.0.0.1 without cephx (``ceph_cephx``: a second cluster with cephx, for
the tests of the Ceph user's caps); the client timeouts in the generated ceph.conf are
short, and every namespace the tests configure sets its own short ``rbd`` timeouts."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import uuid

import pytest

HERE = pathlib.Path(__file__).resolve().parent
MiB = 1 << 20


class Cluster:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.conf = os.path.join(directory, "ceph.conf")
        self.pool = "rbd"

    def pid(self, daemon: str) -> int:
        """The pid of ``mon.a`` or ``osd.0``."""
        with open(os.path.join(self.dir, "run", f"{daemon}.pid")) as f:
            return int(f.read())

    def rbd(self, *args: str, timeout: float = 30) -> str:
        return subprocess.run(["rbd", "--conf", self.conf, *args], check=True, text=True,
                              capture_output=True, timeout=timeout).stdout

    def create_image(self, size: int) -> str:
        name = f"t-{uuid.uuid4().hex[:8]}"
        self.rbd("create", "--size", f"{size // MiB}M", f"{self.pool}/{name}")
        return name

    def user(self, name: str, caps: list[str]) -> str:
        """Create Ceph user ``client.<name>`` with ``caps`` (["mon", "profile rbd", "osd",
        ...]), as an operator does: the path of its keyring."""
        keyring = os.path.join(self.dir, f"ceph.client.{name}.keyring")
        subprocess.run(["ceph", "--conf", self.conf, "auth", "get-or-create", f"client.{name}",
                        *caps, "-o", keyring], check=True, capture_output=True, timeout=30)
        return keyring

    def open(self, image: str):
        """(cluster, ioctx, image) through python3-rbd, for the tests to look at the image."""
        import rados
        import rbd
        c = rados.Rados(conffile=self.conf, conf={"rados_osd_op_timeout": "10",
                                                   "client_mount_timeout": "10"})
        c.connect()
        io = c.open_ioctx(self.pool)
        return c, io, rbd.Image(io, image)


def _cluster(**env: str):
    try:
        import rados  # noqa: F401
        import rbd  # noqa: F401
    except ImportError:
        pytest.skip("python3-rbd is not importable (make venv installs it; the venv needs "
                    "--system-site-packages)")
    for tool in ("ceph-mon", "ceph-osd", "rbd", "monmaptool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing (Debian packages ceph-mon ceph-osd ceph-common: "
                        "make venv installs them)")
    directory = tempfile.mkdtemp(prefix="blockfabric-ceph.")
    try:
        subprocess.run([str(HERE / "ceph-up.sh"), directory], check=True, timeout=90,
                       stdout=subprocess.DEVNULL, env=dict(os.environ, CEPH_IMAGE="", **env))
        yield Cluster(directory)
    finally:
        if os.path.exists(os.path.join(directory, "ceph.conf")):
            subprocess.run([str(HERE / "ceph-down.sh"), directory], timeout=60)


@pytest.fixture(scope="session")
def ceph() -> Cluster:
    yield from _cluster()


@pytest.fixture(scope="module")
def ceph_cephx() -> Cluster:
    """A cluster with cephx on (client.admin's keyring is the conf's default), for the
    tests that run gateways as a Ceph user with only the caps docs/ceph.md lists."""
    yield from _cluster(CEPH_AUTH="cephx")

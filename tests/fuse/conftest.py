"""Real FUSE mounts of a real target subprocess, through the real ``blockfabric`` command.

One target serves the module (ramdisk n1, file-backed n2, read-only n3).  Each mount runs
with its own runtime directory, and is taken down at teardown however the test ended:
``blockfabric umount``, else ``fusermount3 -u -z`` and a kill of the mount's process.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from e2e.conftest import TargetProc, addr_of, cli_via, free_port

BIN = pathlib.Path(sys.executable).parent
NQN = "nqn.2026-12.io.blockfabric:fuse"
#: a UUID-form host NQN must carry a UUID (the target checks NQNs as the spec says)
FUSE_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:f05e7e57-0000-4000-8000-000000000001"
MiB = 1 << 20

if not os.path.exists("/dev/fuse"):
    pytest.skip("/dev/fuse is missing: no FUSE here", allow_module_level=True)
if shutil.which("fusermount3") is None:
    pytest.skip("fusermount3 is missing (Debian package fuse3)", allow_module_level=True)


def run_cli(*args: str, env: dict | None = None, timeout: float = 30,
            check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "blockfabric"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"blockfabric {' '.join(args)} -> {proc.returncode}\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def mounted_at(path: str) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split(" ")[4] == path for line in f)


class Mount:
    """One ``blockfabric mount`` (daemonised) of the module's target."""

    def __init__(self, target: TargetProc, base: pathlib.Path, options: str = "",
                 name: str = "mnt", transport: str | None = None,
                 flags: tuple[str, ...] = ()) -> None:
        self.target = target
        self.flags = list(flags)
        self.transport = transport
        self.path = str(base / name)
        os.makedirs(self.path, exist_ok=True)
        self.env = dict(os.environ, BLOCKFABRIC_RUNTIME_DIR=str(base / "run"))
        self.options = options

    def argv(self) -> list[str]:
        tcp = self.transport == "tcp"
        argv = ["mount", "-a", addr_of(self.transport), "-s",
                str(self.target.tcp_port if tcp else self.target.port), "-n", NQN,
                *cli_via(self.transport), "-q", FUSE_HOSTNQN]
        if self.options:
            argv += ["-o", self.options]
        return argv + self.flags + [self.path]

    def start(self) -> Mount:
        run_cli(*self.argv(), env=self.env)
        assert mounted_at(self.path), "mount command returned 0 but nothing is mounted"
        return self

    @property
    def pid(self) -> int:
        import json
        out = run_cli("list", "--output-format", "json", env=self.env).stdout
        for rec in json.loads(out)["mounts"]:
            if rec["mountpoint"] == self.path:
                return rec["pid"]
        raise AssertionError(f"no record of {self.path}")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def status(self) -> str:
        with open(self.file(".status"), encoding="utf-8") as f:
            return f.read()

    def counter(self, name: str) -> int:
        for line in self.status().splitlines():
            if line.strip().startswith(name + ":"):
                return int(line.split(":")[1])
        raise AssertionError(f"no counter {name!r} in .status")

    def cleanup(self) -> None:
        if not mounted_at(self.path):
            return
        pid = None
        try:
            pid = self.pid
        except AssertionError:
            pass
        if run_cli("umount", self.path, env=self.env, check=False).returncode == 0:
            return
        subprocess.run(["fusermount3", "-u", "-z", self.path], check=False)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def gone(pid: int) -> bool:
    """True once `pid` has exited (reaped, or a zombie its parent has not yet reaped).
    The process may be reaped between any two reads, so a missing /proc entry at any
    point means gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(") ")[2].startswith(("Z", "X"))


def wait_gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuse-target")
    port = free_port()
    backing = base / "n2.img"
    tcp_port = free_port()          # the same subsystem over NVMe/TCP
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port},
                            {"transport": "tcp", "address": "127.0.0.1", "port": tcp_port}],
              "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                  {"nsid": 1, "backend": "ramdisk", "size": "64MiB"},
                  {"nsid": 2, "backend": "file", "path": str(backing), "size": "16MiB"},
                  {"nsid": 3, "backend": "ramdisk", "size": "4MiB", "read_only": True}]}]}
    proc = TargetProc(config, base).start()
    proc.port = port
    proc.tcp_port = tcp_port
    proc.backing = backing
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log, proc.log


@pytest.fixture
def make_mount(target, tmp_path):
    """make_mount(options="", name="mnt") -> a started Mount, always taken down."""
    mounts: list[Mount] = []

    def make(options: str = "", name: str = "mnt", transport: str = "rdma",
             flags: tuple[str, ...] = ()) -> Mount:
        m = Mount(target, tmp_path, options, name, transport, flags)
        mounts.append(m)
        return m.start()

    yield make
    for m in mounts:
        m.cleanup()


@pytest.fixture(scope="module")
def shared_mount(target, tmp_path_factory):
    """One read-write mount shared by the data tests of a module (mounting costs ~0.5 s)."""
    m = Mount(target, tmp_path_factory.mktemp("fuse-shared")).start()
    yield m
    m.cleanup()

"""Start and stop the systems under comparison, each a file that fio can open with O_DIRECT.

Every process is started here, owned by one :class:`Workspace`, and ended by pid in reverse
order on the way out (unmount before stopping a server: a FUSE mount whose server is gone
hangs whoever touches it).  Nothing is found or killed by name.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from demo import alive, is_mounted  # noqa: E402  (make demo's process and mount checks)

BIN = pathlib.Path(sys.executable).parent
PLUGIN = pathlib.Path(__file__).resolve().parent / "memplugin.py"
NQN = "nqn.2026-12.io.blockfabric:compare"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b1f1c9e-0d3a-4c52-9a53-636f6d700001"
VOLUME = 256 << 20
START_TIMEOUT = 30.0

#: Debian packages the comparison needs, by the command or module that shows each is present.
PEER_PACKAGES = {"nbdkit": "nbdkit", "nbdfuse": "libnbd-bin", "fio": "fio",
                 "fusermount3": "fuse3"}
PEER_FILES = {"/usr/lib/x86_64-linux-gnu/nbdkit/plugins/nbdkit-python-plugin.so":
              "nbdkit-plugin-python"}
PEER_MODULES = {"nbd": "python3-libnbd", "matplotlib": "python3-matplotlib"}


#: The pure-Python performance floor (floor_target.py + floor_host.py): the environment
#: variable that points at its directory, and the files it must hold.  It is not part of the
#: project and is never copied into it; see :func:`find_floor`.
FLOOR_ENV = "BLOCKFABRIC_PERF_FLOOR"
FLOOR_FILES = ("floor_target.py", "floor_host.py")


def find_floor(explicit: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The perf-floor directory: ``explicit`` (a --floor flag), else $BLOCKFABRIC_PERF_FLOOR,
    else ``shared/perf-floor`` next to the project root or next to any directory above it
    (../shared/perf-floor from a checkout, ../../shared/perf-floor from a worktree under
    wt/).  None when it is not there (or lacks floor_target.py / floor_host.py)."""
    given = explicit or os.environ.get(FLOOR_ENV)
    candidates = [pathlib.Path(given)] if given else \
        [d / "shared" / "perf-floor" for d in ROOT.parents]
    for path in candidates:
        if all((path / f).is_file() for f in FLOOR_FILES):
            return path.resolve()
    return None


class SetupError(Exception):
    """A system could not be started; the message says which and shows its log."""


@dataclass
class System:
    """One mounted (or plain) file under test and the processes that serve it."""

    key: str
    label: str
    path: pathlib.Path
    commands: list[str] = field(default_factory=list)
    server_pid: int | None = None
    client_pid: int | None = None
    port: int = 0    # the server's TCP port on 127.0.0.1


def missing_packages() -> list[str]:
    """Debian packages of the peers that are not installed."""
    import importlib.util
    missing = [pkg for cmd, pkg in PEER_PACKAGES.items() if shutil.which(cmd) is None]
    missing += [pkg for path, pkg in PEER_FILES.items() if not os.path.exists(path)]
    missing += [pkg for mod, pkg in PEER_MODULES.items()
                if importlib.util.find_spec(mod) is None]
    return sorted(set(missing))


def install_peers() -> None:
    """apt-get the missing peers (as root), so that one command sets the comparison up."""
    apt_install(missing_packages())


def apt_install(missing: list[str]) -> None:
    """apt-get the Debian packages ``missing`` (as root; SetupError otherwise)."""
    if not missing:
        return
    if os.getuid() != 0:
        raise SetupError(f"missing Debian packages (run as root to install): {missing}")
    print(f"installing Debian packages: {' '.join(missing)}", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdin=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env, stdin=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The command as one would type it, for the results file."""
    prefix = "".join(f"{k}={v} " for k, v in (env or {}).items())
    return prefix + " ".join(str(a) for a in argv)


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen | None, what: str,
             log: pathlib.Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            text = log.read_text() if log.exists() else ""
            raise SetupError(f"{what} did not start:\n{text}")
        time.sleep(0.05)


class Workspace:
    """A temp dir and every process and mount made in it; ``with`` releases them all."""

    def __init__(self) -> None:
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="blockfabric-compare-"))
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep releasing the rest
                print(f"cleanup: {exc!r}", file=sys.stderr)
        if not any(is_mounted(p) for p in self.tmp.iterdir() if p.is_dir()):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- processes -----------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, pathlib.Path]:
        """Start ``argv`` in its own session, its output in ``name``.log; stopped on close."""
        log = self.tmp / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=out, start_new_session=True,
                                    env=dict(os.environ, **(env or {})))
        self._undo.append(lambda: stop(proc.pid, proc))
        return proc, log

    def mountpoint(self, name: str) -> pathlib.Path:
        mnt = self.tmp / name
        mnt.mkdir()
        self._undo.append(lambda: unmount(mnt))
        return mnt

    # -- blockfabric ---------------------------------------------------------------------
    def target(self, progress: str = "thread") -> tuple[int, int, str]:
        """A ramdisk target on the soft provider (``progress`` "tcp": an NVMe/TCP listener
        instead), its metrics on port + 1 (so that a load can tell when its hosts are
        connected); returns (port, pid, command)."""
        reactors, tails_env = reactors_of(progress), env_of(progress)
        transport, progress = variant(progress)
        port = free_port()
        while not port_free(port + 1):
            port = free_port()
        config = self.tmp / f"target-{port}.yaml"
        listener = "transport: tcp" if transport == "tcp" else "transport: rdma, provider: soft"
        config.write_text(
            "listeners:\n"
            f"  - {{{listener}, address: 127.0.0.1, port: {port}}}\n"
            "subsystems:\n"
            f"  - nqn: {NQN}\n"
            "    allow_any_host: true\n"
            "    namespaces:\n"
            f"      - {{nsid: 1, backend: ramdisk, size: {VOLUME}, block_size: 4096}}\n"
            f"control_socket: {self.tmp}/control-{port}.sock\n"
            f"metrics: {{port: {port + 1}}}\n"
            # only when asked: an older tree (ab_pair.py's A side) has no such key
            + (f"reactors: {reactors}\n" if reactors > 1 else ""))
        env = {"BLOCKFABRIC_SOFT_PROGRESS": progress, **tails_env}
        argv = [BIN / "blockfabric-target", "run", "-C", config]
        proc, log = self.spawn(f"target-{port}", argv, env)
        wait_for(lambda: "ready:" in log.read_text(), proc, "blockfabric-target", log)
        return port, proc.pid, shell(argv, env)

    def blockfabric(self, progress: str) -> System:
        """The FUSE mount of a target of its own (``progress`` "tcp": over NVMe/TCP)."""
        port, target_pid, target_cmd = self.target(progress)
        mnt = self.mountpoint(f"bf-{progress}")
        transport, soft = variant(progress)
        env = {"BLOCKFABRIC_SOFT_PROGRESS": soft, **env_of(progress)}
        workers = workers_of(progress)
        argv = [BIN / "blockfabric", "mount", *connect_flags(port, transport),
                *(["--fuse-workers", str(workers)] if workers else []), mnt]
        proc, log = self.spawn(f"mount-{progress}", argv, env)
        wait_for(lambda: is_mounted(mnt), None, "blockfabric mount", log)
        daemon: list[int] = []      # it outlives the command: unmount, then end it
        self._undo.append(lambda: (unmount(mnt), [stop(p, None) for p in daemon]))
        # the mount is visible before its runtime record is written (with FUSE workers, the
        # record waits for them): the daemon's pid is the CPU this run measures, so wait for it
        wait_for(lambda: mount_pid(mnt) is not None, None, "blockfabric mount's record", log)
        pid = mount_pid(mnt)
        daemon.append(pid)
        label = ("blockfabric (NVMe/TCP)" if transport == "tcp" else
                 f"blockfabric ({soft})") + (f", reactors {reactors_of(progress)}"
                                             if reactors_of(progress) > 1 else "") \
            + "".join(f", {text}" for text in tails_text(progress))
        return System(f"bf-{progress}", label, mnt / "n1",
                      [target_cmd, shell(argv, env)], target_pid, pid, port)

    # -- nbdkit + nbdfuse ----------------------------------------------------------------
    def nbdkit(self, name: str, plugin: list[str]) -> tuple[int, int, str]:
        port = free_port()
        pidfile = self.tmp / f"{name}.pid"
        argv = ["nbdkit", "-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", str(port),
                "-P", pidfile, *plugin]
        proc, log = self.spawn(name, argv)
        wait_for(pidfile.exists, proc, "nbdkit", log)
        return port, proc.pid, shell(argv)

    def nbdfuse(self, key: str, label: str, plugin: list[str]) -> System:
        port, server_pid, server_cmd = self.nbdkit(f"nbdkit-{key}", plugin)
        mnt = self.mountpoint(key)
        pidfile = self.tmp / f"nbdfuse-{key}.pid"
        argv = ["nbdfuse", "-P", pidfile, mnt, "--tcp", "127.0.0.1", str(port)]
        proc, log = self.spawn(f"nbdfuse-{key}", argv)
        wait_for(pidfile.exists, proc, "nbdfuse", log)
        return System(key, label, mnt / "nbd", [server_cmd, shell(argv)], server_pid,
                      proc.pid, port)

    def nbd_memory(self) -> System:
        return self.nbdfuse("nbd-memory", "nbdkit memory + nbdfuse",
                            ["memory", str(VOLUME)])

    def nbd_python(self) -> System:
        return self.nbdfuse("nbd-python", "nbdkit python + nbdfuse",
                            ["python", PLUGIN, f"size={VOLUME}"])

    # -- the performance floor ---------------------------------------------------------
    def floor(self, floor_dir: pathlib.Path) -> System:
        """floor_target.py (a 256 MiB mmap, one connection) and floor_host.py, which mounts
        its own FUSE file n1 with mount(2); the same interpreter as blockfabric.  Stopped by
        pid and unmounted on the way out, also when starting fails half way."""
        port = free_port()
        argv = [sys.executable, floor_dir / "floor_target.py", str(port)]
        target, log = self.spawn(f"floor-target-{port}", argv)
        wait_for(lambda: log.read_text().startswith("ready"), target, "floor_target.py", log)
        mnt = self.mountpoint("floor")
        host_argv = [sys.executable, floor_dir / "floor_host.py", mnt, str(port)]
        host, host_log = self.spawn("floor-host", host_argv)
        self._undo.append(lambda: unmount(mnt))     # unmount before the host is stopped
        wait_for(lambda: (mnt / "n1").exists(), host, "floor_host.py", host_log)
        return System("floor", "floor (pure Python)", mnt / "n1",
                      [shell(argv), shell(host_argv)], target.pid, host.pid, port)

    # -- tmpfs ---------------------------------------------------------------------------
    def tmpfs(self) -> System:
        """A file on a tmpfs of our own (the ceiling: no network, no FUSE)."""
        mnt = self.mountpoint("tmpfs")
        argv = ["mount", "-t", "tmpfs", "-o", f"size={VOLUME + (16 << 20)}", "tmpfs", mnt]
        subprocess.run([str(a) for a in argv], check=True, stdin=subprocess.DEVNULL)
        path = mnt / "file"
        with open(path, "wb") as f:
            f.truncate(VOLUME)
        return System("tmpfs", "tmpfs file", path, [shell(argv)])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def controllers(target_port: int) -> int:
    """How many controllers the target on ``target_port`` has (from its metrics)."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{target_port + 1}/metrics",
                                timeout=5) as r:
        text = r.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("blockfabric_subsystem_controllers{"))


def connect_flags(port: int, transport: str = "rdma") -> list[str]:
    how = ["-t", "tcp"] if transport == "tcp" else ["--provider", "soft"]
    return ["-a", "127.0.0.1", "-s", str(port), "-n", NQN, "-q", HOSTNQN, *how]


def variant(progress: str) -> tuple[str, str]:
    """(transport, soft provider progress) of a blockfabric system's key: "thread" and
    "poll" are the soft RDMA provider's two progress modes, "tcp" is NVMe/TCP (whose host
    and target run their connections on their reactors, like poll)."""
    base = progress.split("-", 1)[0]
    return ("tcp", "poll") if base == "tcp" else ("rdma", base)


def reactors_of(progress: str) -> int:
    """The target's poll groups: a progress "tcp-2r" is NVMe/TCP with ``reactors: 2``."""
    tails = [t for t in progress.split("-")[1:] if t.endswith("r")]
    return int(tails[0].rstrip("r")) if tails else 1


def env_of(progress: str) -> dict[str, str]:
    """The environment for a progress's reactor spin and same-host shared memory:
    "tcp-s100" runs the target and the mount with $BLOCKFABRIC_REACTOR_SPIN_US=100 (none
    given: the tree's default); "poll-noshm" with $BLOCKFABRIC_SOFT_SHM=0 (the soft
    provider over TCP loopback, as between hosts)."""
    tails = progress.split("-")[1:]
    env = {"BLOCKFABRIC_REACTOR_SPIN_US": t[1:] for t in tails
           if t.startswith("s") and t[1:].isdigit()}
    if "noshm" in tails:
        env["BLOCKFABRIC_SOFT_SHM"] = "0"
    return env


def tails_text(progress: str) -> list[str]:
    """What a progress's tails change, as a label says it: "spin 100 us" (-s100), "over TCP
    loopback" (-noshm), "2 FUSE workers" (-w2)."""
    out = []
    for t in progress.split("-")[1:]:
        if t == "noshm":
            out.append("over TCP loopback")
        elif t[:1] in ("s", "w") and t[1:].isdigit():
            out.append(f"spin {t[1:]} us" if t[0] == "s" else f"{t[1:]} FUSE workers")
    return out


def workers_of(progress: str) -> int:
    """The mount's FUSE worker processes: "poll-w2" is ``--fuse-workers 2``."""
    tails = [t for t in progress.split("-")[1:] if t.startswith("w") and t[1:].isdigit()]
    return int(tails[0][1:]) if tails else 0


def mount_pid(mnt: pathlib.Path) -> int | None:
    """The pid of the blockfabric mount daemon serving ``mnt``, from its runtime record."""
    done = subprocess.run([str(BIN / "blockfabric"), "list", "-o", "json"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    try:
        records = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        return None
    if isinstance(records, dict):
        records = records.get("mounts", [])
    return next((r.get("pid") for r in records if r.get("mountpoint") == str(mnt)), None)


def unmount(mnt: pathlib.Path) -> None:
    """Unmount; the mount's process is ended by :func:`stop` or exits by itself."""
    if not is_mounted(mnt):
        return
    subprocess.run(["fusermount3", "-u", str(mnt)], stdin=subprocess.DEVNULL,
                   capture_output=True, timeout=20)
    if is_mounted(mnt):
        subprocess.run(["umount", str(mnt)], stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=20)
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=20)


def stop(pid: int, proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s, one pid."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc is not None and proc.poll() is not None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc is not None:
                if proc.poll() is not None:
                    return
            elif not alive(pid):
                return
            time.sleep(0.05)

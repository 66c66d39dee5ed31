"""``blockfabric mount``, ``umount``, ``list`` and ``disconnect``.

A mount is one process: it holds the controller, serves FUSE, and on unmount (SIGTERM,
``blockfabric umount``, ``fusermount -u``) disconnects and removes its record.  Without
``-f`` the command forks that process and exits 0 only once the mount is live, or non-zero
with the child's reason: a caller (a script, a systemd unit) can trust the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

from blockfabric import numa
from blockfabric.errors import BlockfabricError
from blockfabric.initiator import runtime
from blockfabric.initiator.fusefs import MountOptions, VolumeFS
from blockfabric.initiator.host import ConnectOptions, Controller

if TYPE_CHECKING:
    from blockfabric.initiator.initiator_config import MountSpec

log = logging.getLogger(__name__)

READY = b"ready\n"
UMOUNT_WAIT = 15.0
_TERM_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


class MountError(BlockfabricError):
    """A mount could not be set up or taken down; the message says why."""


# --------------------------------------------------------------------------- mounting

def check_mountpoint(mountpoint: str) -> str:
    """The resolved mount point (resolved now, before it is mounted: later a stat of it
    would go through FUSE), or MountError if it cannot take a mount now."""
    path = os.path.realpath(mountpoint)
    if not os.path.isdir(path):
        raise MountError(f"mount point {path} does not exist or is not a directory")
    if path in runtime.blockfabric_mounts():
        raise MountError(f"{path} already carries a blockfabric mount")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise MountError("/dev/fuse is missing or not accessible (is the fuse module loaded?)")
    return path


def serve_mount(conn: ConnectOptions, mountpoint: str, options: MountOptions,
                on_ready: Callable[[], object] | None = None,
                cpus: frozenset[int] | None = None) -> None:
    """Connect, mount, serve until unmounted, then disconnect and drop the record.

    Termination signals are blocked while the controller's threads start, so that they
    inherit the block and libfuse's handler runs in the main thread, the one it wakes."""
    if options.binding == "libfuse":
        from blockfabric.initiator import fuse_binding as binding
    else:   # the same interface (serve, mount), in another module
        from blockfabric.initiator import fuse_kernel as binding  # type: ignore[no-redef]
    nworkers = options.fuse_workers
    check_workers(nworkers, options, conn)
    if nworkers > 1:    # -i is the controller's total: at least one queue per process
        conn = dataclasses.replace(conn, nr_io_queues=max(conn.nr_io_queues, nworkers))
    # --cpus, or the route's NIC's node; before the threads and buffers exist (best effort)
    numa.place_host(conn.traddr, cpus, rdma=conn.transport == "rdma")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _TERM_SIGNALS)
    try:
        ctrl = Controller(conn)
        ctrl.io_share = (0, nworkers)       # the first share; the workers connect the rest
        ctrl.connect()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    live = False
    fs = None
    try:
        fs = VolumeFS(ctrl, options)

        def record() -> None:
            runtime.write_record(make_record(ctrl, mountpoint, options, fs))

        def ready() -> None:
            nonlocal live
            if nworkers > 1:
                start_workers(fs, nworkers, mountpoint, conn.subnqn, record)
            record()
            live = True
            log.info("mounted %s at %s", conn.subnqn, mountpoint)
            if on_ready is not None:
                on_ready()

        try:
            binding.serve(fs, mountpoint, fsname=conn.subnqn, on_ready=ready)
        except RuntimeError as exc:
            # libfuse reports "ended by a signal" as an error code too; only a mount that
            # never came up is a failure.
            if not live:
                raise MountError(f"could not mount at {mountpoint} ({exc})") from exc
    finally:
        if fs is not None and fs.workers is not None:
            fs.workers.stop()
        if live:
            runtime.remove_record(mountpoint, os.getpid())
        ctrl.close()
        log.info("unmounted %s and disconnected", mountpoint)


def check_workers(count: int, options: MountOptions, conn: ConnectOptions) -> None:
    from blockfabric.initiator.fuse_workers import check_count
    try:
        check_count(count, options, conn)
    except ValueError as exc:
        raise MountError(str(exc)) from None


def start_workers(fs: VolumeFS, count: int, mountpoint: str, fsname: str,
                  on_change: Callable[[], None]) -> None:
    """Start the mount's FUSE worker processes on clones of its session; if they cannot
    all start, unmount and raise MountError."""
    from blockfabric.initiator.fuse_workers import FuseWorkers
    session = fs.session
    pool = FuseWorkers(fs, session.fd, count, mountpoint, fsname, on_change)
    try:
        pool.start()
    except OSError as exc:
        pool.stop()
        session.stop()
        raise MountError(f"could not start the FUSE workers: {exc}") from exc
    fs.workers = pool


def make_record(ctrl: Controller, mountpoint: str, options: MountOptions,
                fs: VolumeFS | None = None) -> runtime.MountRecord:
    opts = ctrl.opts
    return runtime.MountRecord(
        mountpoint=mountpoint, pid=os.getpid(), subnqn=opts.subnqn, traddr=opts.traddr,
        trsvcid=opts.trsvcid, provider=ctrl.provider.name, cntlid=ctrl.cntlid,
        hostnqn=ctrl.hostnqn, options=options.words(),
        namespaces=[{"nsid": ns.nsid, "file": f"n{ns.nsid}", "size": ns.size,
                     "block_size": ns.block_size, "read_only": ns.read_only}
                    for ns in ctrl.namespaces.values()],
        fuse_workers=fs.workers.record() if fs is not None and fs.workers is not None else [],
        started=fs.started if fs is not None else time.time())


def daemonize(run: Callable[[Callable[[], None]], None]) -> int:
    """Fork ``run(on_ready)``; return 0 once it reports ready, 1 with its reason if not.

    The child detaches (new session, stdio to /dev/null once live, so a caller's pipes
    close) and exits when ``run`` returns."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as pipe:
            message = pipe.read()
        if message.startswith(READY):
            return 0
        os.waitpid(pid, 0)
        text = message.decode(errors="replace").strip() or "the mount process exited early"
        print(f"blockfabric mount: {text}", file=sys.stderr)
        return 1
    os.close(rfd)
    os.setsid()
    code = 0

    def on_ready() -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        os.write(wfd, READY)
        os.close(wfd)

    try:
        run(on_ready)
    except (BlockfabricError, OSError, TimeoutError, ValueError) as exc:
        code = 1
        _tell(wfd, str(exc))
    except BaseException as exc:  # noqa: BLE001  (the parent must hear why, whatever it is)
        code = 1
        _tell(wfd, f"{type(exc).__name__}: {exc}")
    os._exit(code)


def _tell(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode() + b"\n")
    except OSError:
        pass  # already reported ready and closed: stdio is gone, nothing left to tell


def mount_one(conn: ConnectOptions, mountpoint: str, options: MountOptions,
              foreground: bool, cpus: frozenset[int] | None = None) -> int:
    mountpoint = check_mountpoint(mountpoint)
    if foreground:
        from blockfabric.sdnotify import sd_notify
        serve_mount(conn, mountpoint, options, lambda: sd_notify("READY=1"), cpus)
        return 0
    return daemonize(lambda ready: serve_mount(conn, mountpoint, options, ready, cpus))


def cmd_mount(args: argparse.Namespace) -> int:
    """Flags as nvme-cli; or, without -a/-n, MOUNTPOINT names an entry of the initiator
    YAML (--config, default /etc/blockfabric/initiator.yaml), as the systemd unit does."""
    from blockfabric.initiator.initiator_config import DEFAULT_PATH, load
    if args.all or not (args.traddr and args.nqn):
        if args.traddr or args.nqn:
            print("blockfabric mount: give both -a and -n, or neither (to use --config)",
                  file=sys.stderr)
            return 2
        if not args.all and not args.mountpoint:
            print("blockfabric mount: give -a, -n and MOUNTPOINT, or --config FILE --all",
                  file=sys.stderr)
            return 2
        config = load(args.config or DEFAULT_PATH)
        if args.all:
            return mount_all(config.mounts)
        spec = config.find(args.mountpoint)
        if spec is None:
            print(f"blockfabric mount: {config.path}: no mount named or mounted at "
                  f"{args.mountpoint}", file=sys.stderr)
            return 2
        mopts = spec.mount_options()
        if args.fuse_workers is not None:
            mopts.fuse_workers = args.fuse_workers
        return mount_one(spec.connect_options(), spec.mountpoint, mopts, args.foreground,
                         args.cpus)
    if not args.mountpoint:
        print("blockfabric mount: missing MOUNTPOINT", file=sys.stderr)
        return 2
    from blockfabric.initiator.commands import options as connect_options
    try:
        mopts = MountOptions.parse(args.options)
    except ValueError as exc:
        print(f"blockfabric mount: {exc}", file=sys.stderr)
        return 2
    if args.fuse_workers is not None:
        mopts.fuse_workers = args.fuse_workers
    return mount_one(connect_options(args, args.nqn), args.mountpoint, mopts, args.foreground,
                     args.cpus)


def mount_all(specs: Sequence[MountSpec]) -> int:
    """Bring up every listed mount (each daemonised, in turn), skipping live ones; one
    failure does not stop the others."""
    failed = 0
    for spec in specs:
        if os.path.abspath(spec.mountpoint) in runtime.blockfabric_mounts():
            print(f"{spec.mountpoint}: already mounted")
            continue
        try:
            code = mount_one(spec.connect_options(), spec.mountpoint, spec.mount_options(),
                             foreground=False)
        except MountError as exc:
            print(f"blockfabric mount: {spec.name}: {exc}", file=sys.stderr)
            code = 1
        if code:
            failed += 1
        else:
            print(f"{spec.mountpoint}: mounted {spec.nqn}")
    return 1 if failed else 0


# --------------------------------------------------------------------------- unmounting

def unmount(mountpoint: str, timeout: float = UMOUNT_WAIT) -> None:
    """Unmount and wait until the mount's process has disconnected and exited."""
    rec = runtime.find_record(mountpoint)
    path = rec.mountpoint if rec is not None else os.path.abspath(mountpoint)
    if rec is None and path not in runtime.blockfabric_mounts():
        raise MountError(f"{path} is not a blockfabric mount")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is not None:
        done = subprocess.run([tool, "-u", path], capture_output=True, text=True, check=False)
        if done.returncode and rec is not None:
            log.info("%s -u failed (%s); asking the mount process", tool, done.stderr.strip())
            _signal(rec.pid, signal.SIGTERM)
        elif done.returncode:
            raise MountError(f"{tool} -u {path}: {done.stderr.strip()}")
    elif rec is not None:
        _signal(rec.pid, signal.SIGTERM)
    else:
        raise MountError("neither fusermount3 nor fusermount is installed")
    if rec is not None and not wait_gone(rec.pid, timeout):
        raise MountError(f"mount process {rec.pid} of {path} did not exit within {timeout:g} s")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)   # reap it if it happens to be our child
        except ChildProcessError:
            pass
        if not runtime.pid_alive(pid):
            return True
        time.sleep(0.02)
    return False


def cmd_umount(args: argparse.Namespace) -> int:
    unmount(args.mountpoint)
    return 0


def cmd_disconnect(args: argparse.Namespace) -> int:
    records = [r for r in runtime.active_records() if r.subnqn == args.nqn]
    if not records:
        print(f"blockfabric disconnect: no mount of {args.nqn}", file=sys.stderr)
        return 1
    for rec in records:
        unmount(rec.mountpoint)
        print(f"NQN:{args.nqn} disconnected (unmounted {rec.mountpoint})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    records = runtime.active_records()
    if args.output_format == "json":
        json.dump({"mounts": [vars(r) for r in records]}, sys.stdout, indent=2)
        print()
        return 0
    if not records:
        print("no blockfabric mounts")
        return 0
    header = ("Mountpoint", "Subsystem NQN", "Address", "Cntlid", "Namespaces", "PID")
    rows = [(r.mountpoint, r.subnqn, f"tcp {r.traddr}:{r.trsvcid}" if r.provider == "tcp"
             else f"rdma {r.traddr}:{r.trsvcid} ({r.provider})",
             str(r.cntlid), " ".join(n["file"] for n in r.namespaces),
             str(r.pid) + (f" (+{len(r.fuse_workers) - 1} FUSE workers)"
                           if len(r.fuse_workers) > 1 else ""))
            for r in records]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0

#!/usr/bin/env python3
"""``make demo``: the whole product in under a minute, leaving nothing behind.

Starts a target (a ramdisk on the soft RDMA provider, a free port on 127.0.0.1, its config
in a temp dir), mounts it through FUSE, runs short fio jobs on the mounted file (the job files
of benchmarks/fio/ with shorter runtimes), verifies data, prints a table, and tears everything
down in order (unmount, then stop the target, then remove the temp dir) on success, failure,
Ctrl-C or SIGTERM.  Where FUSE, the mount command or fio is missing it runs the same
workloads with ``blockfabric bench`` instead, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
FIO_JOBS = ROOT / "benchmarks" / "fio"
NQN = "nqn.2026-12.io.blockfabric:demo"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:6b1f1c9e-0d3a-4c52-9a53-64656d6f0001"
VOLUME = "256MiB"
RUNTIME = 3
VERIFY_SIZE = "32m"
MOUNT_TIMEOUT = 20

#: (title, the side of the results shown, fio job file, the same as blockfabric bench flags)
WORKLOADS = (
    ("randread 4k QD16", "read", "randread-4k-qd16.fio",
     ["--rw", "randread", "--bs", "4k", "--iodepth", "16"]),
    ("randwrite 4k QD16", "write", "randwrite-4k-qd16.fio",
     ["--rw", "randwrite", "--bs", "4k", "--iodepth", "16"]),
    ("seq write 1M + verify", "write", "verify-crc32c.fio",
     ["--rw", "write", "--bs", "1m", "--iodepth", "4", "--verify", "crc32c",
      "--size", VERIFY_SIZE, "--no-time_based"]),
)


class DemoError(Exception):
    """A step failed; the message says which and why."""


def say(text: str) -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Demo:
    """Owns every resource the demo makes; :meth:`cleanup` releases them in reverse order."""

    def __init__(self, force_bench: bool) -> None:
        self.force_bench = force_bench
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="blockfabric-demo-"))
        self.port = free_port()
        self.target: subprocess.Popen | None = None
        self.mountpoint: pathlib.Path | None = None
        self.rows: list[tuple[str, dict[str, Any]]] = []   # (title, fio's read or write)

    # -- target ------------------------------------------------------------------------
    def start_target(self) -> None:
        say(f"starting target (ramdisk {VOLUME}, soft RDMA provider, 127.0.0.1:{self.port})...")
        config = self.tmp / "target.yaml"
        config.write_text(
            "listeners:\n"
            f"  - {{transport: rdma, provider: soft, address: 127.0.0.1, port: {self.port}}}\n"
            "subsystems:\n"
            f"  - nqn: {NQN}\n"
            "    allow_any_host: true\n"
            "    namespaces:\n"
            f"      - {{nsid: 1, backend: ramdisk, size: {VOLUME}, block_size: 4096}}\n")
        log = open(self.tmp / "target.log", "w")
        self.target = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C",
                                        str(config)], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while "ready:" not in (self.tmp / "target.log").read_text():
            if self.target.poll() is not None or time.monotonic() > deadline:
                raise DemoError("the target did not start:\n"
                                + (self.tmp / "target.log").read_text())
            time.sleep(0.05)
        say(f"target ready: {NQN}")

    def connection_flags(self) -> list[str]:
        return ["-a", "127.0.0.1", "-s", str(self.port), "-n", NQN, "-q", HOSTNQN,
                "--provider", "soft"]

    # -- FUSE ----------------------------------------------------------------------------
    def why_not_fuse(self) -> str | None:
        """Why the FUSE path cannot run here, or None when it can."""
        if self.force_bench:
            return "--no-fuse given"
        if not os.path.exists("/dev/fuse"):
            return "/dev/fuse is missing"
        if not shutil.which("fusermount3"):
            return "fusermount3 is not installed (Debian package fuse3)"
        if not shutil.which("fio"):
            return "fio is not installed (Debian package fio)"
        try:
            import blockfabric.initiator.mount as mount
        except ImportError as exc:
            return f"blockfabric mount is not available ({exc})"
        if not hasattr(mount, "cmd_mount"):
            return "blockfabric mount is not built yet"
        return None

    def mount(self) -> bool:
        """Mount, and wait for n1.  The mount daemonises, so its output goes to a file: a
        daemon holding our pipes open would make a captured run wait for it forever."""
        mnt = self.tmp / "mnt"
        mnt.mkdir()
        self.mountpoint = mnt   # from here on cleanup unmounts, whatever happens next
        say(f"mounting with blockfabric mount at {mnt}...")
        log_path = self.tmp / "mount.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(BIN / "blockfabric"), "mount",
                                     *self.connection_flags(), str(mnt)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(mnt):
            code = proc.poll()
            if code not in (None, 0):
                say(f"mount failed (exit {code}): {log_path.read_text().strip()}")
                return False
            if time.monotonic() > deadline:
                say(f"mount did not appear within {MOUNT_TIMEOUT} s: "
                    f"{log_path.read_text().strip()}")
                return False
            time.sleep(0.05)
        size = (mnt / "n1").stat().st_size
        say(f"mounted at {mnt}: n1 is {human(size)}")
        return True

    def run_fio(self) -> None:
        jobs = self.tmp / "jobs"
        jobs.mkdir()
        for title, side, name, _flags in WORKLOADS:
            text = (FIO_JOBS / name).read_text()
            text = re.sub(r"(?m)^runtime=\d+", f"runtime={RUNTIME}", text)
            text = re.sub(r"(?m)^ramp_time=\d+\n", "", text)
            text = re.sub(r"(?m)^size=\S+", f"size={VERIFY_SIZE}", text)
            job = jobs / name
            job.write_text(text)
            say(f"fio {title} on {self.mountpoint}/n1 ...")
            done = subprocess.run(["fio", f"--filename={self.mountpoint}/n1",
                                   "--output-format=json", str(job)], cwd=self.tmp,
                                  capture_output=True, text=True, timeout=120,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise DemoError(f"fio {title} failed (exit {done.returncode}):\n"
                                f"{done.stderr or done.stdout}")
            self.rows.append((title, _fio_json(done.stdout)["jobs"][0][side]))

    # -- blockfabric bench -----------------------------------------------------------------
    def run_bench(self) -> None:
        for title, side, _name, flags in WORKLOADS:
            say(f"blockfabric bench {title} ...")
            done = subprocess.run([str(BIN / "blockfabric"), "bench",
                                   *self.connection_flags(), "--runtime", str(RUNTIME),
                                   "--eta", "never", "-o", "json", *flags],
                                  capture_output=True, text=True, timeout=120,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise DemoError(f"blockfabric bench {title} failed (exit {done.returncode}):"
                                f"\n{done.stderr}")
            self.rows.append((title, json.loads(done.stdout)["jobs"][0][side]))

    # -- results and teardown -------------------------------------------------------------
    def table(self, through: str) -> str:
        lines = [f"results ({through}, {RUNTIME} s each; clat in microseconds):",
                 f"  {'workload':<22}{'IOPS':>10}{'MB/s':>10}{'p50':>9}{'p99':>9}"
                 f"{'p99.9':>9}  verify"]
        for title, d in self.rows:
            pct = d["clat_ns"]["percentile"]
            verify = "passed" if "verify" in title else "-"
            lines.append(f"  {title:<22}{d['iops']:>10.0f}{d['bw_bytes'] / 1e6:>10.1f}"
                         + "".join(f"{pct[k] / 1000:>9.0f}" for k in
                                   ("50.000000", "99.000000", "99.900000"))
                         + f"  {verify}")
        return "\n".join(lines)

    def cleanup(self) -> None:
        """Unmount, end the mount's process, stop the target, remove the workspace: in that
        order, since a FUSE mount whose server is gone hangs whoever touches it."""
        mnt = self.mountpoint
        if mnt is not None and is_mounted(mnt):
            say(f"unmounting {mnt}...")
            try:
                subprocess.run([str(BIN / "blockfabric"), "umount", str(mnt)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=20)
            except subprocess.TimeoutExpired:
                pass
            if is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], timeout=10,
                               stdin=subprocess.DEVNULL, capture_output=True)
        self._end_leftovers()
        if self.target is not None and self.target.poll() is None:
            say("stopping target...")
            self.target.send_signal(signal.SIGTERM)
            try:
                self.target.wait(15)
            except subprocess.TimeoutExpired:
                self.target.kill()
                self.target.wait()
        if mnt is not None and is_mounted(mnt):
            say(f"{mnt} is still mounted: leaving {self.tmp} in place")
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        say("cleaned up")

    def _end_leftovers(self) -> None:
        """A mount daemon that outlived its unmount: found by our workspace path, which its
        command line names, and ended by pid."""
        target = self.target.pid if self.target is not None else None
        pids = [pid for pid in processes_naming(str(self.tmp)) if pid != target]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(alive(p) for p in pids):
                time.sleep(0.05)
            pids = [p for p in pids if alive(p)]
            if not pids:
                return


def processes_naming(text: str) -> list[int]:
    """Live processes (not this one) whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which has an empty cmdline, does not count)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fio_json(text: str) -> dict[str, Any]:
    """fio may print notes before its JSON document."""
    return json.loads(text[text.index("{"):])


def is_mounted(path: pathlib.Path) -> bool:
    with open("/proc/mounts", encoding="utf-8") as f:
        return any(line.split()[1] == str(path) for line in f)


def human(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fuse", action="store_true",
                        help="skip the FUSE mount: run the workloads with blockfabric bench")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    started = time.monotonic()
    demo = Demo(args.no_fuse)
    say(f"workspace {demo.tmp}")
    try:
        demo.start_target()
        reason = demo.why_not_fuse()
        if reason is None and demo.mount():
            demo.run_fio()
            through = "fio through the FUSE mount"
        else:
            say(f"FUSE path unavailable ({reason or 'the mount failed'}): falling back to "
                "blockfabric bench, which drives the host library without FUSE")
            demo.run_bench()
            through = "blockfabric bench, no FUSE"
        say("data verified: every block read back matched its crc32c")
        say(demo.table(through))
    except (DemoError, OSError, subprocess.SubprocessError) as exc:
        say(f"demo failed: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        demo.cleanup()
    say(f"demo finished in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

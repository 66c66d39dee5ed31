#!/usr/bin/env python3
"""Issue 14's sequential 1 MiB goals, prototyped on the pure-Python floor: which data path
beats nbdkit memory + nbdfuse by 1.5x (reads) and 1.2x (writes), where the copying floor and
the mount are level with it?  Two designs that copy less:

- zero-copy over the socket: a read's data goes with sendfile(2) from a memfd volume at the
  target, and with splice(2) at the host (socket -> pipe -> /dev/fuse);
- shared memory, as an RDMA NIC reaches registered memory: both ends map the host's request
  buffers (a file), the target copies a read's data straight into the buffer and a write's
  straight out of it; only capsules and completions cross the socket; and that with two
  processes serving the mount (a cloned /dev/fuse, as the mount's --fuse-workers 2).

    python3 benchmarks/prototypes/zerocopy_floor/run.py [--rounds 3] [--runtime 5]
        [--rw read|write] [--floor DIR] [--out FILE.json]

The prototype is zerocopy.patch, applied to a copy of the floor (--floor, as make bench finds
it): --maxio, --pipe and --splice for floor_host.py, --sendfile for floor_target.py.

Systems, in interleaved rounds of the same fio job (benchmarks/fio/seqread-1m.fio's: 1 MiB,
libaio, QD8, direct): nbdkit memory + nbdfuse; FUSE alone (the floor's host answering from
its own memory, 1 MiB requests: the ceiling); the floor as shipped (128 KiB FUSE requests);
the floor with 1 MiB FUSE requests (as the mount uses); that one with --sendfile/--splice.
Reports GB/s (median and spread) and CPU microseconds per MiB (server + client processes).
Needs root, fio, nbdkit and nbdfuse (make bench installs them).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from compare import systems  # noqa: E402
from compare.cpu import children, cpu_seconds  # noqa: E402


def patched_floor(floor_dir: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of the floor with zerocopy.patch applied."""
    dest = into / "zerocopy-floor"
    dest.mkdir()
    for name in ("floor_host.py", "floor_target.py"):
        shutil.copy(floor_dir / name, dest / name)
    subprocess.run(["patch", "-s", "-p1", "-d", dest, "-i", HERE / "zerocopy.patch"], check=True)
    return dest


def _target(ws: systems.Workspace, floor_dir: pathlib.Path, name: str, args: list[str]
            ) -> tuple[int, int]:
    """A (patched) floor_target.py, ready: its (port, pid)."""
    port = systems.free_port()
    target, log = ws.spawn(name, [sys.executable, floor_dir / "floor_target.py", str(port),
                                  *args])
    systems.wait_for(lambda: log.read_text().startswith("ready"), target, name, log)
    return port, target.pid


def _host(ws: systems.Workspace, floor_dir: pathlib.Path, key: str, port: int,
          args: list[str]) -> tuple[pathlib.Path, int]:
    """A (patched) floor_host.py, its file there: (the file, the host's pid)."""
    mnt = ws.mountpoint(key)
    host, log = ws.spawn(f"{key}-host", [sys.executable, floor_dir / "floor_host.py", mnt,
                                         str(port), *args])
    systems.wait_for(lambda: (mnt / "n1").exists(), host, key, log)
    return mnt / "n1", host.pid


def floor(ws: systems.Workspace, floor_dir: pathlib.Path, key: str,
          target_args: list[str] | None, host_args: list[str]) -> systems.System:
    """The (patched) floor; ``target_args`` None: no target, FUSE alone (--local)."""
    port, target = (systems.free_port(), None) if target_args is None else \
        _target(ws, floor_dir, f"{key}-target", target_args)
    path, host = _host(ws, floor_dir, key, port, host_args)
    return systems.System(key, key, path, [], target, host, port)


def two_readers(ws: systems.Workspace, floor_dir: pathlib.Path, key: str) -> systems.System:
    """Shared memory, and two processes serving the mount (as --fuse-workers 2): the floor
    host forks a second reader with a cloned /dev/fuse, each talks to a target of its own,
    and both targets map one volume file."""
    buffers = [ws.tmp / f"{key}-buffers{i}" for i in (1, 2)]
    (port1, pid1), (port2, pid2) = (
        _target(ws, floor_dir, f"{key}-target{i}", [f"--volume={ws.tmp / f'{key}-volume'}",
                                                    f"--shm={buffers[i - 1]}"])
        for i in (1, 2))
    path, host = _host(ws, floor_dir, key, port1, ["--maxio=1024", f"--shm={buffers[0]}",
                                                   f"--clone={port2},{buffers[1]}"])
    system = systems.System(key, key, path, [], pid1, host, port1)
    system.more_pids = [pid2]           # type: ignore[attr-defined]
    return system


def fio(path: pathlib.Path, rw: str, runtime: float) -> dict:
    argv = ["fio", "--name=seq", f"--filename={path}", f"--rw={rw}", "--bs=1m",
            "--iodepth=8", "--ioengine=libaio", "--direct=1", "--time_based",
            f"--runtime={runtime}", "--ramp_time=1", "--output-format=json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read" if rw == "read" else "write"]
    return {"bw_gbs": side["bw_bytes"] / 1e9, "ios": side["total_ios"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=float, default=5.0)
    ap.add_argument("--rw", choices=("read", "write"), default="read")
    ap.add_argument("--floor", help="the perf-floor directory (default: as make bench)")
    ap.add_argument("--out")
    args = ap.parse_args()
    found = systems.find_floor(args.floor)
    if found is None:
        ap.error("no perf-floor directory: give --floor")
    # floor-1m-splice's pipe holds a whole 1 MiB reply: above the default fs.pipe-max-size
    sysctl = pathlib.Path("/proc/sys/fs/pipe-max-size")
    pipe_max = int(sysctl.read_text())
    if pipe_max < 4 << 20:
        sysctl.write_text(str(4 << 20))
    try:
        return measure(args, found)
    finally:
        sysctl.write_text(str(pipe_max))


def measure(args: argparse.Namespace, found: pathlib.Path) -> int:
    results: dict[str, list[dict]] = {}
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        fd = patched_floor(found, pathlib.Path(tmp))
        shm = ws.tmp / "floor-buffers"         # --shm: the host's buffers, both ends map it
        order = [ws.nbd_memory(),
                 floor(ws, fd, "fuse-alone-1m", None, ["--local", "--maxio=1024"]),
                 floor(ws, fd, "floor-128k", [], []),
                 floor(ws, fd, "floor-1m", [], ["--maxio=1024"]),
                 floor(ws, fd, "floor-1m-sendfile", ["--sendfile"], ["--maxio=1024"]),
                 floor(ws, fd, "floor-1m-splice", ["--sendfile"], ["--maxio=1024", "--splice"]),
                 floor(ws, fd, "floor-512k-splice", ["--sendfile"],
                       ["--maxio=512", "--splice", "--pipe=1024"]),
                 floor(ws, fd, "floor-1m-shm", [f"--shm={shm}"],
                       ["--maxio=1024", f"--shm={shm}"]),
                 two_readers(ws, fd, "floor-1m-shm-2readers")]
        for path in (s.path for s in order):       # data everywhere, and a warm start
            subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", "count=64",
                            "oflag=direct", "conv=notrunc", "status=none"], check=True)
        for rnd in range(args.rounds):
            for s in order:
                pids = [p for p in (s.server_pid, s.client_pid, *getattr(s, "more_pids", ()))
                        if p]
                pids += [c for p in pids for c in children(p)]    # a forked second reader
                before = [cpu_seconds(p) for p in pids]
                t0 = time.monotonic()
                res = fio(s.path, args.rw, args.runtime)
                res["wall"] = time.monotonic() - t0
                used = sum(cpu_seconds(p) - b for p, b in zip(pids, before))
                res["cpu_us_per_mib"] = used / max(1, res["ios"]) * 1e6
                results.setdefault(s.key, []).append(res)
                print(f"round {rnd + 1} {s.key:18} {res['bw_gbs']:.2f} GB/s "
                      f"{res['cpu_us_per_mib']:.0f} us CPU/MiB", flush=True)
    base = statistics.median(r["bw_gbs"] for r in results["nbd-memory"])
    print(f"\nseq {args.rw} 1 MiB QD8, medians of {args.rounds} interleaved rounds:")
    summary = {}
    for key, runs in results.items():
        bw = statistics.median(r["bw_gbs"] for r in runs)
        cpu = statistics.median(r["cpu_us_per_mib"] for r in runs)
        summary[key] = {"bw_gbs": bw, "ratio": bw / base, "cpu_us_per_mib": cpu,
                        "runs": runs}
        print(f"  {key:18} {bw:.2f} GB/s ({bw / base:.2f}x nbdfuse), {cpu:.0f} us CPU/MiB "
              f"(server + client), spread {min(r['bw_gbs'] for r in runs):.2f}-"
              f"{max(r['bw_gbs'] for r in runs):.2f}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

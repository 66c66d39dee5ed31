#!/usr/bin/env python3
"""The host side on several cores: ``blockfabric mount --fuse-workers 1`` against ``2``,
side by side, fio through the mount.

    python benchmarks/fuse_workers.py [--workers 1,2] [--numjobs 2,4] [--transports rdma,tcp]
                                      [--iodepth 16] [--runtime 3] [--rounds 3]

One ramdisk target (soft provider and NVMe/TCP listeners); for each transport one mount per
worker count, all up at once, ``-i 2`` each (the controller's total: with 2 workers, one
queue per process).  Each round runs fio (4 KiB randread, libaio, direct, ``--iodepth`` per
job, ``--numjobs`` jobs, 1 s ramp) on every mount, the order turned every round.  For each
run: IOPS (fio's), CPU microseconds per I/O of the target, the host (the mount process and
its workers, summed) and fio (its process tree), read from /proc every 25 ms over fio's
counted run; and the host's cores (its CPU seconds / the run's seconds) with the busiest
one process's share, which says whether the host side used more than one core.  The report
gives medians and the median of the per-round ratios N workers / 1 worker.  The machine may
be shared: quote ranges and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from numjobs import (BIN, TreeSampler, children, medians, spread,  # noqa: E402
                     start_target_on)

NQN = "nqn.2026-12.io.blockfabric:fuseworkers"


def mount(tmp: pathlib.Path, env: dict, transport: str, port: int, workers: int) -> str:
    path = tmp / f"mnt-{transport}-{workers}"
    path.mkdir()
    how = ["-t", "tcp"] if transport == "tcp" else ["--provider", "soft"]
    subprocess.run([str(BIN / "blockfabric"), "mount", "-a", "127.0.0.1", "-s", str(port),
                    "-n", NQN, *how, "-i", "2", "--fuse-workers", str(workers), str(path)],
                   check=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    return str(path)


def mount_pid(env: dict, path: str) -> int:
    out = subprocess.run([str(BIN / "blockfabric"), "list", "-o", "json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return next(r["pid"] for r in json.loads(out)["mounts"] if r["mountpoint"] == path)


def one(path: str, host_pid: int, target_pid: int, numjobs: int,
        args: argparse.Namespace) -> dict:
    argv = ["fio", "--name=r", f"--filename={path}/n1", "--rw=randread", "--bs=4k",
            "--ioengine=libaio", "--direct=1", f"--iodepth={args.iodepth}",
            f"--numjobs={numjobs}", "--time_based", f"--runtime={args.runtime}",
            "--ramp_time=1", "--group_reporting", "--output-format=json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    pids = {"target": target_pid, "host": host_pid, "fio": proc.pid}
    # each serving process on its own, for the busiest one's share
    procs = {f"p{p}": p for p in [host_pid] + children(host_pid)}
    with TreeSampler(dict(pids, **procs), trees=("host", "fio")) as sampler:
        out, err = proc.communicate(timeout=args.runtime + 60)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)}: {err}")
    doc = json.loads(out)
    job = doc["jobs"][0]
    t1 = doc["timestamp_ms"] / 1000
    secs = job["read"]["runtime"] / 1000
    t0 = t1 - secs
    ios = job["read"]["total_ios"]
    cpu = sampler.between(t0, t1)
    return {"iops": job["read"]["iops"], "ios": ios,
            "target_us": cpu["target"] / ios * 1e6, "host_us": cpu["host"] / ios * 1e6,
            "fio_us": cpu["fio"] / ios * 1e6, "host_cores": cpu["host"] / secs,
            "busiest_cores": max(cpu[k] for k in procs) / secs,
            "processes": len(procs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--numjobs", default="2,4")
    ap.add_argument("--transports", default="rdma,tcp")
    ap.add_argument("--iodepth", type=int, default=16)
    ap.add_argument("--runtime", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    jobs = [int(x) for x in args.numjobs.split(",")]
    transports = args.transports.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = pathlib.Path(tmpdir)
        env = dict(os.environ, BLOCKFABRIC_RUNTIME_DIR=str(tmp / "run"))
        target, ports = start_target_on(tmp, NQN, tuple(transports))
        mounts: dict[tuple[str, int], tuple[str, int]] = {}
        try:
            for t in transports:
                for n in counts:
                    path = mount(tmp, env, t, ports[t], n)
                    mounts[t, n] = (path, mount_pid(env, path))
            time.sleep(1)
            for r in range(args.rounds):
                for t in transports:
                    for nj in jobs:
                        order = counts if r % 2 == 0 else counts[::-1]
                        for n in order:
                            path, pid = mounts[t, n]
                            row = one(path, pid, target.pid, nj, args)
                            row.update(round=r, transport=t, numjobs=nj, workers=n)
                            rows.append(row)
                            print(json.dumps(row), file=sys.stderr)
        finally:
            for path, _pid in mounts.values():
                subprocess.run([str(BIN / "blockfabric"), "umount", path], env=env,
                               check=False, timeout=60)
            target.terminate()
            target.wait(30)
    print(f"fio 4k randread, libaio, iodepth {args.iodepth} per job, {args.runtime} s x "
          f"{args.rounds} rounds, through blockfabric mount -i 2 --fuse-workers N (load "
          f"average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")
    print("| transport | numjobs | workers | IOPS median (range) | host cores (busiest "
          "process) | target us/IO | host us/IO | fio us/IO |")
    print("|---|---|---|---|---|---|---|---|")
    for t in transports:
        for nj in jobs:
            for n in counts:
                mine = [x for x in rows if (x["transport"], x["numjobs"], x["workers"]) ==
                        (t, nj, n)]
                m = medians(mine)
                print(f"| {t} | {nj} | {n} | {spread([x['iops'] for x in mine])} | "
                      f"{m['host_cores']:.2f} ({m['busiest_cores']:.2f}) | "
                      f"{m['target_us']:.1f} | {m['host_us']:.1f} | {m['fio_us']:.1f} |")
            base = counts[0]
            for n in counts[1:]:
                ratios = [x["iops"] / y["iops"] for x in rows for y in rows
                          if x["round"] == y["round"] and x["transport"] == y["transport"] == t
                          and x["numjobs"] == y["numjobs"] == nj and x["workers"] == n
                          and y["workers"] == base]
                print(f"  {t} numjobs {nj}: IOPS {n}/{base} workers per round: median "
                      f"{spread(ratios, '.2f', 'range ')}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

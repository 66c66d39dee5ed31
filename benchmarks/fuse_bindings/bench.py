"""Measure FUSE bindings on the real workload: a remote ramdisk over the soft provider.

    .venv/bin/python benchmarks/fuse_bindings/bench.py [--runtime 3] [--reps 3]
        [--variants mfusepy-mt,...] [--out benchmarks/results/fuse_bindings.json]

Starts a target subprocess (256 MiB ramdisk, soft provider, loopback), then for each
variant mounts n1, runs fio --direct=1 jobs (4k randread/randwrite QD16 libaio, 4k randread
QD1 psync, 1M sequential read/write QD4 libaio), each ``--reps`` times, and keeps the
median.  Writes a JSON file and prints a table.  Cleans up mounts and processes on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = pathlib.Path(sys.executable).parent
NQN = "nqn.2026-12.io.blockfabric:bench"

JOBS = {
    "randread-4k-qd16": ["--rw=randread", "--bs=4k", "--iodepth=16", "--ioengine=libaio"],
    "randwrite-4k-qd16": ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--ioengine=libaio"],
    "randread-4k-qd1": ["--rw=randread", "--bs=4k", "--iodepth=1", "--ioengine=psync"],
    "read-1m-qd4": ["--rw=read", "--bs=1m", "--iodepth=4", "--ioengine=libaio"],
    "write-1m-qd4": ["--rw=write", "--bs=1m", "--iodepth=4", "--ioengine=libaio"],
}

# variant -> how to mount it; {mnt}, {port} are filled in
VARIANTS = {
    "kernel": "blockfabric -o binding=kernel",
    "kernel-cache": "blockfabric -o binding=kernel,cache",
    "mfusepy-mt": "blockfabric -o binding=libfuse,threads=16",
    "mfusepy-mt4": "blockfabric -o binding=libfuse,threads=4",
    "mfusepy-single": "blockfabric -o binding=libfuse,single_thread",
    "mfusepy-mt-cache": "blockfabric -o binding=libfuse,threads=16,cache",
    "pyfuse3": "other pyfuse3",
    "fusepy": "other fusepy",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_mounted(mnt: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/self/mountinfo") as f:
            if any(f" {mnt} " in line for line in f):
                if os.path.exists(os.path.join(mnt, "n1")):
                    return
        if proc.poll() is not None:
            raise RuntimeError(f"mount process exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{mnt} not mounted in {timeout} s")


def mount(variant: str, port: int, mnt: str) -> subprocess.Popen:
    kind, _, arg = VARIANTS[variant].partition(" ")
    if kind == "blockfabric":
        opt = arg.split(" ", 1)[1]
        argv = [str(BIN / "blockfabric"), "mount", "-a", "127.0.0.1", "-s", str(port), "-n", NQN,
                "--provider", "soft", "-f", "-o", opt, mnt]
    else:
        argv = [sys.executable, str(HERE / "serve_other.py"), arg, "127.0.0.1", str(port), NQN,
                mnt]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_mounted(mnt, proc)
    return proc


def unmount(mnt: str, proc: subprocess.Popen) -> None:
    subprocess.run(["fusermount3", "-u", mnt], capture_output=True, check=False)
    subprocess.run(["fusermount", "-u", mnt], capture_output=True, check=False)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fio(path: str, job: list[str], runtime: float) -> dict[str, float]:
    out = subprocess.run(["fio", "--name=j", f"--filename={path}", "--direct=1", "--size=128M",
                          "--time_based", f"--runtime={runtime}", "--randrepeat=1",
                          "--output-format=json", *job], capture_output=True, text=True,
                         check=True)
    data = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = data["read"] if data["read"]["io_bytes"] else data["write"]
    return {"iops": side["iops"], "mb_s": side["bw_bytes"] / 1e6,
            "lat_p50_us": side["clat_ns"]["percentile"].get("50.000000", 0) / 1000}


def status_max_inflight(mnt: str) -> int:
    try:
        text = pathlib.Path(mnt, ".status").read_text()
    except OSError:
        return -1
    return max((int(line.rsplit("max in flight ", 1)[1].split(",")[0])
                for line in text.splitlines() if "(io)" in line), default=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fuse_bindings.json"))
    args = ap.parse_args()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="fusebench-")
    cfg = pathlib.Path(tmp, "target.yaml")
    cfg.write_text(yaml.safe_dump({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
        "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
            {"nsid": 1, "backend": "ramdisk", "size": "256MiB"}]}]}))
    target = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C", str(cfg)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    results: dict[str, dict] = {}
    try:
        for line in target.stderr:
            if "ready:" in line:
                break
        env = dict(os.environ, BLOCKFABRIC_RUNTIME_DIR=tmp)
        os.environ.update(env)
        for variant in args.variants.split(","):
            mnt = os.path.join(tmp, variant)
            os.makedirs(mnt, exist_ok=True)
            proc = mount(variant, port, mnt)
            try:
                per_job = {}
                for name, job in JOBS.items():
                    runs = [fio(os.path.join(mnt, "n1"), job, args.runtime)
                            for _ in range(args.reps)]
                    per_job[name] = {key: round(statistics.median(r[key] for r in runs), 1)
                                     for key in runs[0]}
                    print(f"{variant:18} {name:18} {per_job[name]}", flush=True)
                per_job["max_inflight_per_queue"] = status_max_inflight(mnt)
                results[variant] = per_job
            finally:
                unmount(mnt, proc)
    finally:
        target.terminate()
        target.wait(20)
        subprocess.run(["rm", "-rf", tmp], check=False)
    report = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                          "python": platform.python_version()},
              "runtime_s": args.runtime, "reps": args.reps, "statistic": "median",
              "workload": "remote 256 MiB ramdisk, soft provider on loopback, fio --direct=1",
              "results": results}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

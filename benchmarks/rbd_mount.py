#!/usr/bin/env python3
"""backend rbd through the FUSE mount, side by side with python3-rbd used directly (the
ceiling): 4 KiB random write/read at QD16 and 1 MiB sequential write/read at QD4, with
client CPU microseconds per I/O.

    .venv/bin/python benchmarks/rbd_mount.py [--runtime 5] [--ceph-conf FILE] [--out DIR]

Without --ceph-conf it brings up the tests' throwaway one-node cluster (tests/ceph/ceph-up.sh:
one monitor, one memstore OSD) and takes it down after.  "client CPU" is, for python3-rbd,
this process (all its threads: librbd's too); for the mount, the target daemon + the FUSE
daemon + fio (utime + stime from /proc/<pid>/stat, all threads); "cluster CPU" is the OSD
and monitor, the same for both.  Memstore keeps the data in RAM, so the cluster is as fast
as it gets here and the numbers show what each client path costs.  (Not named rbd.py: run as a
script, that would shadow python3-rbd's module.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
NQN = "nqn.2026-12.io.blockfabric:rbdbench"
MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")
IMAGE_SIZE = 1024 * MiB
REGION = 256 * MiB      # where the 4 KiB random I/O lands (written first, so reads hit data)
WORKLOADS = (("randwrite", 4096, 16), ("randread", 4096, 16),
             ("write", MiB, 4), ("read", MiB, 4))


def cpu_seconds(pid: int | str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, conf: str | None) -> None:
        self.dir = None
        if conf is None:
            self.dir = tempfile.mkdtemp(prefix="rbdbench-ceph.")
            subprocess.run([str(ROOT / "tests/ceph/ceph-up.sh"), self.dir], check=True,
                           stdout=subprocess.DEVNULL, env=dict(os.environ, CEPH_IMAGE=""),
                           timeout=120)
            conf = os.path.join(self.dir, "ceph.conf")
        self.conf = conf

    def pids(self) -> list[int]:
        if self.dir is None:
            return []
        run = pathlib.Path(self.dir, "run")
        return [int(p.read_text()) for p in run.glob("*.pid")]

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def rbd(self, *args: str) -> None:
        subprocess.run(["rbd", "--conf", self.conf, *args], check=True, timeout=60,
                       capture_output=True)

    def close(self) -> None:
        if self.dir is not None:
            subprocess.run([str(ROOT / "tests/ceph/ceph-down.sh"), self.dir], timeout=60)


def direct(cluster: Cluster, image: str, rw: str, bs: int, depth: int, runtime: float
           ) -> dict:
    """python3-rbd aio at ``depth``, from this process."""
    import rados
    import rbd
    c = rados.Rados(conffile=cluster.conf, conf={"rbd_cache": "false"})
    c.connect()
    io = c.open_ioctx("rbd")
    img = rbd.Image(io, image)
    sem = threading.Semaphore(depth)
    lock = threading.Lock()
    state = {"done": 0, "err": 0}
    payload = os.urandom(bs)
    region = REGION if bs == 4096 else IMAGE_SIZE
    blocks = region // bs
    seq = [0]

    def cb(comp, *_data) -> None:
        with lock:
            state["done"] += 1
            if comp.get_return_value() < 0:
                state["err"] += 1
        sem.release()

    def next_offset() -> int:
        if rw.startswith("rand"):
            return random.randrange(blocks) * bs
        seq[0] = (seq[0] + 1) % blocks
        return seq[0] * bs
    t0, c0, k0 = time.monotonic(), cpu_seconds("self"), cluster.cpu()
    end = t0 + runtime
    while time.monotonic() < end:
        sem.acquire()
        if "write" in rw:
            img.aio_write(payload, next_offset(), cb)
        else:
            img.aio_read(next_offset(), bs, cb)
    for _ in range(depth):
        sem.acquire()
    took, cpu, kcpu = time.monotonic() - t0, cpu_seconds("self") - c0, cluster.cpu() - k0
    img.close()
    io.close()
    c.shutdown()
    return result("python3-rbd", rw, bs, depth, state["done"], took, cpu, kcpu, state["err"])


def result(system: str, rw: str, bs: int, depth: int, ios: int, took: float, cpu: float,
           kcpu: float, errors: int) -> dict:
    return {"system": system, "workload": f"{rw} {bs // 1024}k QD{depth}"
            if bs < MiB else f"{rw} 1M QD{depth}", "iops": ios / took,
            "mib_s": ios * bs / took / MiB, "client_cpu_us_per_io": cpu / ios * 1e6,
            "cluster_cpu_us_per_io": kcpu / ios * 1e6, "errors": errors}


def through_mount(cluster: Cluster, image: str, runtime: float, tmp: pathlib.Path
                  ) -> list[dict]:
    import yaml
    port = free_port()
    conf = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
            "control_socket": str(tmp / "target.sock"),
            "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                {"nsid": 1, "backend": "rbd", "rbd": {"pool": "rbd", "image": image,
                                                      "ceph_conf": cluster.conf}}]}]}
    path = tmp / "target.yaml"
    path.write_text(yaml.safe_dump(conf))
    target = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C", str(path)],
                              stderr=subprocess.PIPE, text=True)
    mnt = tmp / "mnt"
    mnt.mkdir()
    env = dict(os.environ, BLOCKFABRIC_RUNTIME_DIR=str(tmp / "run"))
    out = []
    try:
        for line in target.stderr:
            if "ready:" in line:
                break
        threading.Thread(target=lambda: [None for _ in target.stderr], daemon=True).start()
        subprocess.run([str(BIN / "blockfabric"), "mount", "-a", "127.0.0.1", "-s", str(port),
                        "-n", NQN, "--provider", "soft", str(mnt)], check=True, env=env,
                       timeout=60)
        listing = json.loads(subprocess.run(
            [str(BIN / "blockfabric"), "list", "--output-format", "json"], env=env,
            check=True, capture_output=True, text=True).stdout)
        mount_pid = next(m["pid"] for m in listing["mounts"] if m["mountpoint"] == str(mnt))
        n1 = str(mnt / "n1")
        for rw, bs, depth in WORKLOADS:
            size = REGION if bs == 4096 else IMAGE_SIZE
            argv = ["fio", "--name=rbd", f"--filename={n1}", f"--rw={rw}", f"--bs={bs}",
                    "--ioengine=libaio", f"--iodepth={depth}", "--direct=1",
                    f"--size={size}", "--time_based", f"--runtime={runtime}",
                    "--output-format=json"]
            c0 = cpu_seconds(target.pid) + cpu_seconds(mount_pid)
            k0 = cluster.cpu()
            t0 = time.monotonic()
            fio = subprocess.run(argv, capture_output=True, text=True, check=True,
                                 timeout=runtime + 60)
            took = time.monotonic() - t0
            c1 = cpu_seconds(target.pid) + cpu_seconds(mount_pid)
            job = json.loads(fio.stdout)["jobs"][0]
            side = job["write" if "write" in rw else "read"]
            ios = side["total_ios"]
            fio_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["elapsed"]
            r = result("blockfabric mount", rw, bs, depth, ios, side["runtime"] / 1000,
                       c1 - c0 + fio_cpu, cluster.cpu() - k0, job["error"])
            r["wall_s"] = took
            out.append(r)
    finally:
        subprocess.run([str(BIN / "blockfabric"), "umount", str(mnt)], env=env, timeout=60)
        target.terminate()
        target.wait(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", type=float, default=5.0)
    ap.add_argument("--ceph-conf", help="an existing cluster (pool rbd) instead of a "
                    "throwaway one")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio is missing")
    cluster = Cluster(args.ceph_conf)
    rows = []
    try:
        image = f"rbdbench-{os.getpid()}"
        cluster.rbd("create", "--size", f"{IMAGE_SIZE // MiB}M", f"rbd/{image}")
        try:
            # fill the random region once so that reads return data on both sides
            import rados
            import rbd
            with rados.Rados(conffile=cluster.conf) as c, c.open_ioctx("rbd") as io, \
                    rbd.Image(io, image) as img:
                chunk = os.urandom(4 * MiB)
                for off in range(0, IMAGE_SIZE, len(chunk)):
                    img.write(chunk, off)
            for rw, bs, depth in WORKLOADS:
                rows.append(direct(cluster, image, rw, bs, depth, args.runtime))
            with tempfile.TemporaryDirectory(prefix="rbdbench.") as tmp:
                rows += through_mount(cluster, image, args.runtime, pathlib.Path(tmp))
        finally:
            cluster.rbd("rm", f"rbd/{image}")
    finally:
        cluster.close()
    lines = ["| workload | system | IOPS | MiB/s | client CPU us/IO | cluster CPU us/IO |",
             "|---|---|---|---|---|---|"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        for r in rows:
            if r["workload"] == w:
                lines.append(f"| {w} | {r['system']} | {r['iops']:.0f} | {r['mib_s']:.1f} | "
                             f"{r['client_cpu_us_per_io']:.0f} | "
                             f"{r['cluster_cpu_us_per_io']:.0f} |")
    table = "\n".join(lines)
    print(table)
    stamp = datetime.date.today().isoformat()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rbd-{stamp}.json").write_text(json.dumps(
        {"runtime": args.runtime, "load": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    (out / f"rbd-{stamp}.md").write_text(
        f"# backend rbd vs python3-rbd ({stamp}, {args.runtime:g} s each, load "
        f"{os.getloadavg()[0]:.1f})\n\n{table}\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""``blockfabric bench --numjobs N``: jobs as processes (the default, as fio) against jobs
as threads of one process (``--thread``, one shared controller), side by side.

    python benchmarks/numjobs.py [--numjobs 2] [--iodepth 16] [--runtime 3] [--rounds 5]

One soft-provider ramdisk target; each round runs both modes, the order flipped every
round, 4 KiB randread.  For each run: IOPS (the bench's own count), and CPU microseconds per
I/O of the target and of the bench (the bench process and its job processes, read from
/proc every 25 ms) over exactly the counted run (the bench's ``window``, ramp and start-up
excluded).  The report gives the medians per mode and the median of the per-round ratios
processes/thread.  On a shared machine quote ranges, not points.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
NQN = "nqn.2026-12.io.blockfabric:numjobs"
sys.path.insert(0, str(ROOT / "benchmarks" / "compare"))

from cpu import Sampler, cpu_seconds, machine_busy  # noqa: E402  (0.0: gone)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class TreeSampler(Sampler):
    """:class:`cpu.Sampler` over process trees: the CPU seconds of a process and of its
    children (the last value seen of each, so that a child that has exited still counts),
    for the keys named in ``trees``; the same wall-clock samples and interpolation."""

    def __init__(self, pids: dict[str, int], interval: float = 0.025,
                 trees: tuple[str, ...] = ("bench",)) -> None:
        super().__init__(pids, interval)  # type: ignore[arg-type]
        self.trees = trees          # the keys whose children count too
        self.last: dict[str, dict[int, float]] = {k: {} for k in self.pids}

    def _sample(self) -> None:
        for key, pid in self.pids.items():
            tree = [pid] + (children(pid) if key in self.trees else [])
            for p in tree:
                v = cpu_seconds(p)
                if v:                   # gone (0.0): its last value stands
                    self.last[key][p] = v
        self.samples.append((time.time(), {k: sum(v.values()) for k, v in self.last.items()},
                             machine_busy()))

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds of each key's tree between wall-clock instants t0 and t1."""
        return self.span(t0, t1).cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_target(tmp: pathlib.Path) -> tuple[subprocess.Popen, int]:
    proc, ports = start_target_on(tmp, NQN, ("rdma",))
    return proc, ports["rdma"]


def start_target_on(tmp: pathlib.Path, nqn: str, transports: tuple[str, ...]
                    ) -> tuple[subprocess.Popen, dict[str, int]]:
    """A 256 MiB ramdisk target listening on each of ``transports`` (rdma: the soft
    provider, tcp), on free ports: (process, transport -> port)."""
    ports = {t: free_port() for t in transports}
    conf = tmp / "target.yaml"
    conf.write_text(json.dumps({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}
                      if t == "rdma" else {"transport": t, "address": "127.0.0.1",
                                           "port": port} for t, port in ports.items()],
        "control_socket": str(tmp / "target.sock"),
        "subsystems": [{"nqn": nqn, "allow_any_host": True, "namespaces": [
            {"nsid": 1, "backend": "ramdisk", "size": "256MiB"}]}]}))
    proc = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C", str(conf)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "ready:" in line:
            break
    else:
        raise SystemExit("the target did not start")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, ports


def one(port: int, target_pid: int, mode: str, args: argparse.Namespace) -> dict:
    argv = [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(port), "-n", NQN,
            "--provider", "soft", "--rw", "randread", "--bs", "4k",
            "--iodepth", str(args.iodepth), "--numjobs", str(args.numjobs),
            "-i", str(args.numjobs), "--runtime", str(args.runtime), "--ramp_time", "1",
            "--group_reporting", "--eta", "never", "-o", "json"]
    if mode == "thread":
        argv.append("--thread")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    with TreeSampler({"target": target_pid, "bench": proc.pid}) as sampler:
        out, err = proc.communicate(timeout=args.runtime + 120)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)}: {err}")
    job = json.loads(out)["jobs"][0]
    t0, t1 = job["blockfabric"]["window"]
    ios = job["read"]["total_ios"]
    cpu = sampler.between(t0, t1)
    return {"mode": mode, "iops": job["read"]["iops"], "ios": ios,
            "target_us": cpu["target"] / ios * 1e6, "bench_us": cpu["bench"] / ios * 1e6,
            "bench_cores": cpu["bench"] / (t1 - t0), "target_cores": cpu["target"] / (t1 - t0)}


def medians(rows: list[dict]) -> dict[str, float]:
    """Each number's median over ``rows`` (rows of one kind: the same keys)."""
    return {k: statistics.median(r[k] for r in rows) for k, v in rows[0].items()
            if isinstance(v, (int, float))}


def spread(values: list[float], spec: str = ".0f", within: str = "") -> str:
    """``median (min-max)`` of ``values``, each in the format ``spec``; ``within`` opens the
    bracket ("range ")."""
    return (f"{statistics.median(values):{spec}} ({within}{min(values):{spec}}-"
            f"{max(values):{spec}})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numjobs", type=int, default=2)
    ap.add_argument("--iodepth", type=int, default=16)
    ap.add_argument("--runtime", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, port = start_target(pathlib.Path(tmp))
        try:
            for r in range(args.rounds):
                for mode in ("thread", "processes") if r % 2 == 0 else ("processes", "thread"):
                    row = one(port, target.pid, mode, args)
                    row["round"] = r
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
        finally:
            target.terminate()
            target.wait(30)
    print(f"blockfabric bench --numjobs {args.numjobs} -i {args.numjobs} --iodepth "
          f"{args.iodepth}, 4k randread, {args.runtime} s x {args.rounds} rounds "
          f"(load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")
    print("| mode | IOPS median (range) | bench cores | target cores | bench us/IO | "
          "target us/IO |")
    print("|---|---|---|---|---|---|")
    for mode in ("thread", "processes"):
        mine = [x for x in rows if x["mode"] == mode]
        m = medians(mine)
        print(f"| {mode} | {spread([x['iops'] for x in mine])} | {m['bench_cores']:.2f} | "
              f"{m['target_cores']:.2f} | {m['bench_us']:.1f} | {m['target_us']:.1f} |")
    ratios = [p["iops"] / t["iops"] for r in range(args.rounds)
              for t in rows if t["round"] == r and t["mode"] == "thread"
              for p in rows if p["round"] == r and p["mode"] == "processes"]
    print(f"IOPS processes/thread per round: median {spread(ratios, '.2f', 'range ')}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

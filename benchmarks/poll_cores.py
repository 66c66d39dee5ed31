#!/usr/bin/env python3
"""How many cores the target uses under a load with several queues, per poll-group count:
for each ``--reactors`` value a ramdisk target (NVMe/TCP) is started, ``--hosts`` bench
processes run at once (each its own controller with ``--queues`` I/O queues at ``--iodepth``),
and the CPU of the target's processes (the coordinator and each worker, from
/proc/<pid>/stat, utime + stime) over the run is reported in cores, with the IOPS.  One
process cannot use more than one core; with ``reactors: 2`` the target's processes
together can.  Rounds are interleaved (reactors 1, 2, 1, 2...) and medians reported.

    python benchmarks/poll_cores.py [--reactors 1,2] [--hosts 3] [--queues 2] [--runtime 6]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import cpu  # noqa: E402
import systems  # noqa: E402


#: The Write Zeroes load: one host (controller) with N queues, a thread per queue issuing
#: Write Zeroes of SIZE bytes one after another for RUNTIME s; prints {"ops", "seconds"}.
#: The target fills the zeros (its memory is registered, so no page is dropped instead)
#: and the host only sends a command: a load whose cost is the target's.  BASE: the first
#: of this host's ranges (--regions distinct: each queue of each host its own range; shared:
#: 0 for every host, so that two groups zero the same bytes at once).
ZEROES = """
import json, sys, threading, time
from blockfabric.initiator.host import connect
port, nqn, hostnqn, queues, runtime, size, base = sys.argv[1:]
queues, runtime, size, base = int(queues), float(runtime), int(size), int(base)
with connect("127.0.0.1", nqn, int(port), transport="tcp", hostnqn=hostnqn,
             nr_io_queues=queues) as ctrl:
    ns = ctrl.namespaces[1]
    ns.write(0, bytes(4096))            # the volume's memory registered: zeros are written
    count = [0]
    end = time.monotonic() + runtime
    def run(i):
        at = ((base + i) * size) % (ns.size - size)
        while time.monotonic() < end:
            ns.write_zeroes(at, size)
            count[0] += 1
    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(queues)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"ops": count[0], "seconds": time.monotonic() - t0}))
"""


def one_run(ws: systems.Workspace, reactors: int, a: argparse.Namespace) -> dict:
    port, pid, _cmd = ws.target(f"tcp-{reactors}r")
    time.sleep(1.0)                             # the workers start
    pids = {"coordinator": pid, **{f"worker{i + 1}": c for i, c in
                                   enumerate(sorted(cpu.children(pid)))}}
    loads = []
    for h in range(a.hosts):
        hostnqn = f"{systems.HOSTNQN[:-4]}{h + 1:04d}"
        if a.load == "zeroes":
            base = h * a.queues if a.regions == "distinct" else 0
            argv = [sys.executable, "-c", ZEROES, str(port), systems.NQN, hostnqn,
                    str(a.queues), str(a.runtime), str(a.zeroes_size), str(base)]
            loads.append(subprocess.Popen(argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
            continue
        argv = [str(systems.BIN / "blockfabric"), "bench",
                *systems.connect_flags(port, "tcp")[:-4], "-q", hostnqn, "-t", "tcp",
                "-i", str(a.queues), "--numjobs", str(a.queues), "--rw", a.rw, "--bs", "4k",
                "--iodepth", str(a.iodepth), "--runtime", str(a.runtime), "--ramp_time", "1",
                "--eta", "never", "-o", "json"]
        loads.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    time.sleep(1.5)                             # connected, past the ramp
    own = {k: cpu.cpu_seconds(p) for k, p in pids.items()}
    faults = {k: minor_faults(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(a.runtime - 1.0)
    seconds = time.monotonic() - t0
    used = {k: (cpu.cpu_seconds(p) - own[k]) / seconds for k, p in pids.items()}
    faults = {k: (minor_faults(p) - faults[k]) / seconds for k, p in pids.items()}
    iops = 0.0
    for p in loads:
        out, err = p.communicate(timeout=a.runtime + 60)
        if p.returncode != 0:
            raise SystemExit(f"bench failed: {err}")
        data = json.loads(out[out.index("{"):])
        if "jobs" not in data:                  # the Write Zeroes load
            iops += data["ops"] / data["seconds"]
            continue
        job = data["jobs"][0]
        iops += job["read"]["iops"] + job["write"]["iops"]
    return {"reactors": reactors, "cores": used, "total": sum(used.values()), "iops": iops,
            "faults": sum(faults.values())}


def minor_faults(pid: int) -> int:
    """Minor page faults of ``pid`` so far (/proc/<pid>/stat, field 10): a volume's pages
    allocated (and cleared by the kernel) as they are touched."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reactors", default="1,2", help="comma list (default: %(default)s)")
    p.add_argument("--hosts", type=int, default=3, help="bench processes at once")
    p.add_argument("--queues", type=int, default=2, help="I/O queues (and jobs) per host")
    p.add_argument("--iodepth", type=int, default=16)
    p.add_argument("--rw", default="randread")
    p.add_argument("--load", choices=("bench", "zeroes"), default="bench",
                   help="bench: blockfabric bench 4k; zeroes: Write Zeroes of --zeroes-size "
                        "(the target's work, the host's little)")
    p.add_argument("--zeroes-size", type=int, default=4 << 20)
    p.add_argument("--regions", choices=("distinct", "shared"), default="distinct",
                   help="Write Zeroes ranges: distinct (each queue of each host its own) or "
                        "shared (every host's queue i on range i: groups on two cores then "
                        "zero the same bytes at once and bounce their cache lines)")
    p.add_argument("--runtime", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    counts = [int(x) for x in a.reactors.split(",")]
    rows: dict[int, list[dict]] = {n: [] for n in counts}
    for rnd in range(a.rounds):
        for n in counts:
            with systems.Workspace() as ws:
                r = one_run(ws, n, a)
            rows[n].append(r)
            shown = "  ".join(f"{k} {v:.2f}" for k, v in r["cores"].items())
            print(f"round {rnd + 1} reactors {n}: target {r['total']:.2f} cores ({shown})  "
                  f"{r['iops']:.0f} IOPS  {r['faults'] / max(1.0, r['iops']):.1f} minor "
                  "faults/IO", flush=True)
    what = (f"Write Zeroes of {a.zeroes_size >> 10} KiB, one per queue at a time, "
            f"{a.regions} ranges"
            if a.load == "zeroes" else f"{a.rw} 4k QD{a.iodepth}")
    print(f"\n{a.hosts} hosts x {a.queues} queues, {what}, "
          f"{a.runtime:g} s, {a.rounds} rounds (medians):")
    for n in counts:
        tot = statistics.median(r["total"] for r in rows[n])
        iops = statistics.median(r["iops"] for r in rows[n])
        peak = max(r["total"] for r in rows[n])
        faults = statistics.median(r["faults"] / max(1.0, r["iops"]) for r in rows[n])
        print(f"  reactors {n}: target processes {tot:.2f} cores (max {peak:.2f}), "
              f"{iops:.0f} IOPS, {1e6 * tot / max(1.0, iops):.1f} us target CPU per I/O, "
              f"{faults:.1f} minor faults per I/O")
    return 0


if __name__ == "__main__":
    sys.exit(main())

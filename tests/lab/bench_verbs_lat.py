"""4 KiB latency of the product over verbs, in the lab guest (run by tests/lab/bench-verbs-lat.sh).

Starts blockfabric-target with a ramdisk namespace on a verbs listener (rxe0's address), then
runs `blockfabric bench --provider verbs` for each case (4 KiB randread QD1, QD16, randwrite
QD16) and reports IOPS, completion latency p50/p99 (bench's fio JSON) and the CPU time per I/O
of the target and of the bench process, from /proc/PID/stat (utime + stime) sampled at bench's
once-a-second eta lines: the window runs from the first line after --ramp_time to the last one,
and its I/O count is bench's measured IOPS times the window's wall time, so the process start-up
(imports, connect) and teardown are not charged to the I/Os.

    python tests/lab/bench_verbs_lat.py --tag after-bf87df7 --out-dir DIR     (in the guest)
    python tests/lab/bench_verbs_lat.py --combine OUT.md A.json B.json ...     (medians, anywhere)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

NQN = "nqn.2026-12.io.blockfabric:lab-lat"
CASES = [("randread", 1), ("randread", 16), ("randwrite", 16)]
TICK = os.sysconf("SC_CLK_TCK")
ETA = re.compile(r"^\[\s*(\d+)s/")


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime (fields 14, 15)


def start_target(py_bin: str, addr: str, port: int, work: str, provider: str
                 ) -> tuple[subprocess.Popen, str]:
    cfg = os.path.join(work, "target.yaml")
    with open(cfg, "w") as f:
        f.write(f"""listeners:
  - {{transport: rdma, provider: {provider}, address: {addr}, port: {port}}}
subsystems:
  - nqn: {NQN}
    allow_any_host: true
    namespaces:
      - {{nsid: 1, backend: ramdisk, size: 256MiB, block_size: 4096}}
control_socket: {work}/target.sock
""")
    log = os.path.join(work, "target.log")
    proc = subprocess.Popen([os.path.join(py_bin, "blockfabric-target"), "run", "-C", cfg],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with open(log) as f:
            text = f.read()
        if "ready:" in text:
            return proc, log
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"target did not become ready:\n{open(log).read()}")


def run_case(py_bin: str, addr: str, port: int, tgt: int, rw: str, qd: int,
             runtime: float, ramp: float, provider: str) -> dict:
    cmd = [os.path.join(py_bin, "blockfabric"), "bench", "-a", addr, "-s", str(port), "-n", NQN,
           "--provider", provider, "--rw", rw, "--bs", "4k", "--iodepth", str(qd),
           "--runtime", str(runtime), "--ramp_time", str(ramp), "--size", "128MiB",
           "-o", "json", "--eta", "always"]
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[tuple[int, float, float | None, float | None]] = []
    errlines: list[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            m = ETA.match(line)
            if m:   # sample right away: the line was written at this moment of bench's run
                samples.append((int(m.group(1)), time.monotonic(), cpu_seconds(tgt),
                                cpu_seconds(proc.pid)))
            else:
                errlines.append(line)

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out = proc.stdout.read()
    proc.wait()
    reader.join(5)
    wall = time.monotonic() - t_start
    if proc.returncode != 0:
        return {"rw": rw, "iodepth": qd, "error": f"bench rc={proc.returncode}: "
                + "".join(errlines[-10:]) + out[-2000:]}
    job = json.loads(out)["jobs"][0]
    d = job["read" if rw == "randread" else "write"]
    pct = d["clat_ns"]["percentile"]
    window = [s for s in samples if s[0] >= ramp and None not in s]
    res = {"rw": rw, "bs": 4096, "iodepth": qd, "iops": round(d["iops"], 1),
           "total_ios": d["total_ios"], "runtime_ms": d["runtime"],
           "clat_p50_us": pct["50.000000"] / 1e3, "clat_p99_us": pct["99.000000"] / 1e3,
           "clat_mean_us": round(d["clat_ns"]["mean"] / 1e3, 1),
           "bench_wall_s": round(wall, 1), "eta_samples": len(samples)}
    if len(window) >= 2:
        (_, t0, c0t, c0h), (_, t1, c1t, c1h) = window[0], window[-1]
        ios = d["iops"] * (t1 - t0)
        res.update(cpu_window_s=round(t1 - t0, 2), cpu_window_ios=round(ios),
                   target_cpu_us_per_io=round((c1t - c0t) * 1e6 / ios, 1) if ios else None,
                   host_cpu_us_per_io=round((c1h - c0h) * 1e6 / ios, 1) if ios else None,
                   target_cpu_util=round((c1t - c0t) / (t1 - t0), 2),
                   host_cpu_util=round((c1h - c0h) / (t1 - t0), 2))
    return res


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


ROW = "| {case} | {iops} | {p50} | {p99} | {tcpu} | {hcpu} |"
HEAD = ("| case | IOPS | p50 (us) | p99 (us) | target CPU us/IO | host CPU us/IO |\n"
        "|---|---:|---:|---:|---:|---:|")


def fmt(v, nd=0) -> str:
    return "-" if v is None else (f"{v:,.{nd}f}" if isinstance(v, (int, float)) else str(v))


def table(results: list[dict]) -> list[str]:
    lines = [HEAD]
    for r in results:
        case = f"{r['rw']} 4k QD{r['iodepth']}"
        if "error" in r:
            lines.append(f"| {case} | error: {r['error'][:80]!r} | | | | |")
            continue
        lines.append(ROW.format(case=case, iops=fmt(r["iops"]), p50=fmt(r["clat_p50_us"]),
                                p99=fmt(r["clat_p99_us"]), tcpu=fmt(r.get("target_cpu_us_per_io")),
                                hcpu=fmt(r.get("host_cpu_us_per_io"))))
    return lines


def measure(args: argparse.Namespace) -> int:
    py_bin = os.path.dirname(args.py)
    work = tempfile.mkdtemp(prefix="verbs-lat.")
    info = {"tag": args.tag, "provider": args.provider, "commit": git_rev(),
            "kernel": os.uname().release,
            "cpus": os.cpu_count(), "addr": args.addr, "runtime_s": args.runtime,
            "ramp_s": args.ramp, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        with open("/proc/loadavg") as f:
            info["guest_loadavg_before"] = f.read().split()[:3]
    except OSError:
        pass
    t0 = time.monotonic()
    tgt, log = start_target(py_bin, args.addr, args.port, work, args.provider)
    info["target_start_s"] = round(time.monotonic() - t0, 1)
    print(f"target ready in {info['target_start_s']} s (pid {tgt.pid})", flush=True)
    results = []
    try:
        for rw, qd in CASES:
            r = run_case(py_bin, args.addr, args.port, tgt.pid, rw, qd, args.runtime, args.ramp,
                         args.provider)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        tgt.send_signal(signal.SIGTERM)
        try:
            tgt.wait(60)
        except subprocess.TimeoutExpired:
            tgt.kill()
    errs = [line for line in open(log) if "Traceback" in line or " ERROR " in line]
    info["target_log_errors"] = errs[:5]
    base = os.path.join(args.out_dir, f"verbs_lat-{time.strftime('%Y-%m-%d', time.gmtime())}"
                        f"-{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"info": info, "results": results}, f, indent=2)
    md = [f"# blockfabric bench over verbs (rxe0, lab guest under QEMU), {args.tag}", "",
          f"commit {info['commit']}, kernel {info['kernel']}, {info['cpus']} vCPUs, target and "
          f"host in the same guest; 4 KiB on a 256 MiB ramdisk namespace (128 MiB region), "
          f"{args.ramp:g} s ramp + {args.runtime:g} s per case.  CPU us/IO: utime+stime from "
          f"/proc/PID/stat over the measured window (target process, bench process).", "",
          *table(results), ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    print(f"wrote {base}.md and .json")
    return 1 if any("error" in r for r in results) else 0


def combine(out: str, files: list[str]) -> int:
    """Medians per tag (before/after) over runs, and the after/before ratios."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(files):
        with open(path) as f:
            doc = json.load(f)
        key = doc["info"]["tag"].split("-run")[0]
        runs.setdefault(key, []).append(doc)
    keys = ["iops", "clat_p50_us", "clat_p99_us", "target_cpu_us_per_io", "host_cpu_us_per_io"]
    med: dict[str, list[dict]] = {}
    md = ["# blockfabric bench over verbs in the lab: medians", ""]
    for tag, docs in sorted(runs.items(), key=lambda kv: (not kv[0].startswith("before"), kv[0])):
        rows = []
        for i, (rw, qd) in enumerate(CASES):
            vals = [d["results"][i] for d in docs if "error" not in d["results"][i]]
            row = {"rw": rw, "iodepth": qd, "runs": len(vals)}
            for k in keys:
                xs = [v[k] for v in vals if v.get(k) is not None]
                row[k] = statistics.median(xs) if xs else None
                row[k + "_all"] = xs
            rows.append(row)
        med[tag] = rows
        md += [f"## {tag}: median of {len(docs)} run(s), min-max in brackets", "",
               "| case | IOPS | p50 (us) | p99 (us) | target CPU us/IO | host CPU us/IO |",
               "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            cells = [f"{fmt(r[k])} ({fmt(min(r[k + '_all']))}-{fmt(max(r[k + '_all']))})"
                     if r[k] is not None else "-" for k in keys]
            md.append(f"| {r['rw']} 4k QD{r['iodepth']} | " + " | ".join(cells) + " |")
        md.append("")
    tags = sorted(med, key=lambda t: (not t.startswith("before"), t))   # before, then after
    if len(tags) == 2:
        a, b = tags
        md += [f"## ratio {b} / {a}", "",
               "| case | IOPS | p50 | p99 | target CPU/IO | host CPU/IO |",
               "|---|---:|---:|---:|---:|---:|"]
        for ra, rb in zip(med[a], med[b]):
            cells = [f"{rb[k] / ra[k]:.2f}" if ra[k] and rb[k] else "-" for k in keys]
            md.append(f"| {ra['rw']} 4k QD{ra['iodepth']} | " + " | ".join(cells) + " |")
        md.append("")
    with open(out, "w") as f:
        f.write("\n".join(md))
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"files": [os.path.basename(p) for p in files], "medians": med}, f, indent=2)
    print("\n".join(md))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--py", default=os.path.join(os.getcwd(), ".venv/bin/python"))
    p.add_argument("--addr", default=os.environ.get("LAB_IP", "10.99.0.1"))
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--provider", default="verbs", help="soft: try it out off the lab")
    p.add_argument("--tag", default="run")
    p.add_argument("--out-dir", default=os.environ.get("LAB_OUT_GUEST", "/tmp"))
    p.add_argument("--runtime", type=float, default=5.0)
    p.add_argument("--ramp", type=float, default=2.0)
    p.add_argument("--combine", metavar="OUT.md")
    p.add_argument("files", nargs="*")
    args = p.parse_args()
    if args.combine:
        return combine(args.combine, args.files)
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where each side's CPU per 4 KiB I/O goes: the Python interpreter, the kernel, libc and
the rest, from ``perf record`` (cpu-clock samples) of the target and the FUSE host while
fio runs through the mount, for blockfabric (soft provider, NVMe/TCP) and the floor.

    python benchmarks/cpu_split.py [--systems soft,tcp,floor] [--qd 16] [--rw randread]
                                   [--runtime 5] [--rounds 2] [--freq 999] [--floor DIR]
                                   [--tag NAME] [--out DIR]

Every sample is charged to the object it was taken in (perf's "dso"): the interpreter
binary (Debian's python3.11 has the interpreter linked in; a libpython counts the same),
[kernel.kallsyms] (system calls, the copies into and out of sockets and /dev/fuse, the
scheduler), libc, and the rest (C extension modules, the vDSO).  Samples / frequency / the
I/Os fio counted in the same window = microseconds per I/O.  py-spy's --gil view misses
samples it cannot read consistently and so undercounts Python; perf sees every one.

Rounds are interleaved (every system once per round, the order rotated) and each cell is
the median over rounds.  perf slows nothing measurably at 999 Hz, but the rate still moves
with the machine: compare systems within one run.  Needs perf (Debian linux-perf: installed
when missing and run as root) and root (FUSE mounts, attaching to the processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "compare"))

import systems  # noqa: E402

KINDS = ("interpreter", "kernel", "libc", "other")
SYSTEMS = {"soft": "poll", "tcp": "tcp", "floor": None}


def kind_of(dso: str) -> str:
    if dso.startswith(("python", "libpython")):
        return "interpreter"
    if dso.startswith("[kernel"):
        return "kernel"
    if dso.startswith("libc.") or dso.startswith("libc-"):
        return "libc"
    return "other"


def samples(path: pathlib.Path) -> dict[str, int]:
    """{kind: samples} of one ``perf record`` file."""
    out = subprocess.run(["perf", "report", "-i", str(path), "-n", "--no-children",
                          "--sort", "dso", "--stdio", "-g", "none"],
                         capture_output=True, text=True, check=True).stdout
    got = dict.fromkeys(KINDS, 0)
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 3 and not line.startswith("#") and f[0].endswith("%") and f[1].isdigit():
            got[kind_of(f[2])] += int(f[1])
    return got


def ensure_perf() -> None:
    if shutil.which("perf") is not None and subprocess.run(
            ["perf", "--version"], capture_output=True).returncode == 0:
        return
    try:
        systems.apt_install(["linux-perf"])
    except systems.SetupError as exc:
        raise SystemExit(f"perf is missing: {exc}") from None


def measure(s: systems.System, args: argparse.Namespace, tmp: pathlib.Path
            ) -> dict[str, object]:
    """One fio run through ``s`` with perf on both of its processes for ``args.runtime``."""
    engine = ["--ioengine=psync"] if args.qd == 1 else \
        ["--ioengine=libaio", f"--iodepth={args.qd}"]
    fio = subprocess.Popen(
        ["fio", "--name=split", f"--filename={s.path}", f"--rw={args.rw}", "--bs=4k",
         "--direct=1", *engine, "--time_based", f"--runtime={args.runtime + 2}",
         "--output-format=json"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)                     # past fio's start
    files = {side: tmp / f"{s.key}-{side}.perf" for side in ("target", "host")}
    perfs = [subprocess.Popen(
        ["perf", "record", "-e", "cpu-clock", "-F", str(args.freq), "-o", str(files[side]),
         "-p", str(pid), "--", "sleep", str(args.runtime)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for side, pid in (("target", s.server_pid), ("host", s.client_pid))]
    for p in perfs:
        p.wait()
    out, _ = fio.communicate(timeout=60)
    job = json.loads(out)["jobs"][0]
    iops = sum(job[d]["iops"] for d in ("read", "write"))
    ios = iops * args.runtime
    row: dict[str, object] = {"iops": iops}
    for side, path in files.items():
        row[side] = {k: n / args.freq / ios * 1e6 for k, n in samples(path).items()}
    return row


def report(runs: dict[str, list[dict]], order: list[str], args: argparse.Namespace) -> str:
    """The medians over rounds, per system and side, as a markdown table."""
    lines = [f"{args.rw} 4k QD{args.qd}: CPU us per I/O by where it was spent (perf "
             f"cpu-clock at {args.freq} Hz, medians of {args.rounds} interleaved rounds)", "",
             "| system | IOPS | side | interpreter | kernel | libc | other | total |",
             "|---|---|---|---|---|---|---|---|"]
    for key in order:
        rows = runs[key]
        iops = statistics.median(r["iops"] for r in rows)
        both = dict.fromkeys(KINDS, 0.0)
        for side in ("target", "host"):
            med = {k: statistics.median(r[side][k] for r in rows) for k in KINDS}
            for k in KINDS:
                both[k] += med[k]
            lines.append(f"| {key} | {iops:.0f} | {side} | " +
                         " | ".join(f"{med[k]:.1f}" for k in KINDS) +
                         f" | {sum(med.values()):.1f} |")
        lines.append(f"| {key} | | both | " + " | ".join(f"{both[k]:.1f}" for k in KINDS) +
                     f" | {sum(both.values()):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="soft,tcp,floor",
                    help="comma list of soft, tcp, floor (default: all three), or of the "
                         "blockfabric variants benchmarks/compare names (poll-s0: the soft "
                         "provider with no reactor spin, tcp-s0, poll-w2, ...)")
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--rw", default="randread", choices=("randread", "randwrite"))
    ap.add_argument("--runtime", type=float, default=5.0, help="seconds perf samples, per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--freq", type=int, default=999, help="perf samples per second")
    ap.add_argument("--floor", help="the perf-floor directory (as benchmarks/compare finds it)")
    ap.add_argument("--tag", help="names the results: cpu_split-<date>-TAG.md")
    ap.add_argument("--out", help="write cpu_split-<date>[-TAG].md and .json into this directory")
    args = ap.parse_args()
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    bad = [k for k in keys if k not in SYSTEMS
           and k.split("-", 1)[0] not in ("poll", "thread", "tcp")]
    if bad:
        ap.error(f"unknown systems {bad}: choose from {', '.join(SYSTEMS)}, or a variant "
                 "such as poll-s0")
    ensure_perf()
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    with systems.Workspace() as ws, tempfile.TemporaryDirectory() as tmp:
        started: dict[str, systems.System] = {}
        for key in keys:
            if key == "floor":
                floor = systems.find_floor(args.floor)
                if floor is None:
                    print("floor: skipped (not found)", flush=True)
                    continue
                started[key] = ws.floor(floor)
            else:
                started[key] = ws.blockfabric(SYSTEMS.get(key) or key)
        order = [k for k in keys if k in started]
        for r in range(args.rounds):
            for key in order[r % len(order):] + order[:r % len(order)]:
                row = measure(started[key], args, pathlib.Path(tmp))
                runs[key].append(row)
                t, h = row["target"], row["host"]
                print(f"round {r + 1} {key:5s} {row['iops']:8.0f} IOPS  target "
                      f"{sum(t.values()):5.1f} us/IO (interpreter {t['interpreter']:.1f})  "
                      f"host {sum(h.values()):5.1f} (interpreter {h['interpreter']:.1f})",
                      flush=True)
    text = report(runs, order, args)
    print("\n" + text, end="")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"cpu_split-{datetime.date.today()}" + (f"-{args.tag}" if args.tag else "")
        (out / f"{stem}.md").write_text(f"# {stem}\n\n`{' '.join(sys.argv)}`\n\n{text}")
        (out / f"{stem}.json").write_text(json.dumps(
            {"rw": args.rw, "qd": args.qd, "freq": args.freq, "runs": runs}, indent=1))
        print(f"wrote {out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

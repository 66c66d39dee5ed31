#!/usr/bin/env python3
"""Soak: several hosts x several queues verify their data (CRC-32C per block) against one
file-backed target for a long time, while a random fault is injected every minute.

Each host is a separate process (``tests/faults/verifyload.py``) reaching the target
through its own userspace TCP proxy, so faults can hit one host's path or the target itself:

  kill       target SIGKILLed, restarted 2 s later (file backend: the data survives)
  pause      target SIGSTOPped 3 s (past the 1 s keep-alive), then SIGCONT
  cut        every connection of one host's path reset
  partition  one host's path refuses and cuts everything for 3 s
  delay      20 ms added per chunk on one host's path for 5 s

ctrl_loss_tmo is far longer than any fault, so the expected outcome is exact: no errors and
no mismatches.  Prints I/Os, bytes verified, faults injected, errors and mismatches, and
exits 1 unless both of the last two are zero.

    .venv/bin/python benchmarks/soak.py --duration 600      # make soak
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from faults.conftest import HOSTNQN, NQN, Restartable, file_config, free_port  # noqa: E402
from faults.proxy import TcpProxy  # noqa: E402

LOAD = ROOT / "tests" / "faults" / "verifyload.py"
FAULTS = ("kill", "pause", "cut", "partition", "delay")


def host_nqn(i: int) -> str:
    return HOSTNQN[:-2] + f"{i:02d}"


def inject(kind: str, target: Restartable, proxy: TcpProxy) -> None:
    if kind == "kill":
        target.kill()
        time.sleep(2.0)
        target.start()
    elif kind == "pause":
        target.signal(19)                           # SIGSTOP
        time.sleep(3.0)
        target.signal(18)                           # SIGCONT
    elif kind == "cut":
        proxy.cut()
    elif kind == "partition":
        proxy.down()
        time.sleep(3.0)
        proxy.up()
    elif kind == "delay":
        proxy.delay = 0.02
        time.sleep(5.0)
        proxy.delay = 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600, help="seconds (default 600)")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--queues", type=int, default=2, help="I/O queues per host")
    p.add_argument("--threads", type=int, default=4, help="verify threads per host")
    p.add_argument("--fault-every", type=float, default=60, help="seconds between faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    region = 256
    with tempfile.TemporaryDirectory(prefix="bf-soak-") as tmp:
        tmpdir = pathlib.Path(tmp)
        port = free_port()
        target = Restartable(file_config(port, tmpdir / "soak.img"), tmpdir)
        proxies = [TcpProxy(("127.0.0.1", port)) for _ in range(args.hosts)]
        hosts = []
        try:
            for i, proxy in enumerate(proxies):
                hosts.append(subprocess.Popen(
                    [sys.executable, str(LOAD), "--traddr", "127.0.0.1",
                     "--port", str(proxy.port), "--nqn", NQN, "--hostnqn", host_nqn(i),
                     "--seconds", str(args.duration), "--threads", str(args.threads),
                     "--queues", str(args.queues), "--kato", "1", "--reconnect-delay", "1",
                     "--ctrl-loss-tmo", "60", "--seed", str(args.seed + i),
                     "--region-blocks", str(region),
                     "--first-block", str(i * args.threads * region)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            faults: collections.Counter[str] = collections.Counter()
            start = time.monotonic()
            next_fault = start + args.fault_every
            # No fault in the last 15 s: every host must finish its final verify pass.
            while time.monotonic() < start + args.duration - 15:
                if time.monotonic() >= next_fault:
                    kind = rng.choice(FAULTS)
                    victim = rng.randrange(args.hosts)
                    print(f"{time.monotonic() - start:7.1f} s  fault {kind}"
                          + (f" (host {victim})" if kind in ("cut", "partition", "delay")
                             else ""), file=sys.stderr, flush=True)
                    inject(kind, target, proxies[victim])
                    faults[kind] += 1
                    next_fault += args.fault_every
                time.sleep(0.2)
            results = []
            for i, host in enumerate(hosts):
                out, _ = host.communicate(timeout=args.duration + 120)
                results.append(json.loads(out) if out.strip() else
                               {"ios": 0, "bytes_verified": 0, "errors": 1, "mismatches": 0,
                                "recovery": {}, "exit": host.returncode})
        finally:
            for host in hosts:
                if host.poll() is None:
                    host.kill()
                    host.wait()
            for proxy in proxies:
                proxy.close()
            target.stop()
    summary = {
        "duration_s": args.duration, "hosts": args.hosts, "queues_per_host": args.queues,
        "threads_per_host": args.threads,
        "ios": sum(r["ios"] for r in results),
        "bytes_verified": sum(r["bytes_verified"] for r in results),
        "faults": sum(faults.values()), "faults_by_kind": dict(faults),
        "errors": sum(r["errors"] for r in results),
        "mismatches": sum(r["mismatches"] for r in results),
        "reconnects": sum(r["recovery"].get("reconnects", 0) for r in results),
        "held": sum(r["recovery"].get("held", 0) for r in results),
        "retried": sum(r["recovery"].get("retried", 0) for r in results),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            print(f"{key:18} {value}")
    return 0 if summary["errors"] == 0 and summary["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

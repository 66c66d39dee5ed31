#!/usr/bin/env python3
"""A host doing verified I/O against the target service while tests/lab/systemd.sh reloads,
hangs, kills and restarts it (runs inside the lab guest).

Writes a fresh random block, reads it back and compares, one at a time (so an error is
pinned to one block), over the first ``--blocks`` blocks of namespace 1; reconnects as
nvme-cli's host does (reconnect_delay, ctrl_loss_tmo) and keeps going.  A block whose write
raised is forgotten (its content is unknown); every other block is checked again at the end.
Every half second, and at the end, the counters go to ``--stats`` as JSON (written whole, then
renamed): I/Os, bytes verified, mismatches, errors, the controller's recovery counters.
SIGTERM ends the loop; the exit status is 0 only with no mismatch and something verified.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

from blockfabric.initiator.host import connect


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traddr", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4420)
    ap.add_argument("--nqn", required=True)
    ap.add_argument("--hostnqn", required=True)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--stats", required=True)
    args = ap.parse_args()
    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    stats = {"ios": 0, "verified_bytes": 0, "mismatches": 0, "errors": 0, "last_error": "",
             "final_verified_bytes": 0, "done": False}
    ctrl = connect(args.traddr, args.nqn, args.port, provider="soft", hostnqn=args.hostnqn,
                   nr_io_queues=1, keep_alive_tmo=2, reconnect_delay=1, ctrl_loss_tmo=180)

    def save() -> None:
        stats["recovery"] = ctrl.recovery.as_dict()
        stats["state"] = str(ctrl.state.value)
        tmp = args.stats + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, args.stats)

    ns = ctrl.namespaces[1]
    bs = ns.block_size
    blocks = min(args.blocks, ns.nblocks)
    expected: dict[int, bytes] = {}
    rng = random.Random(os.getpid())
    saved = time.monotonic()
    print(f"host: connected to {args.nqn} as {args.hostnqn}, {blocks} blocks of {bs} B",
          flush=True)
    while not stop:
        block = rng.randrange(blocks)
        data = rng.randbytes(bs)
        try:
            ns.write(block * bs, data)
            expected[block] = data
            got = ns.read(block * bs, bs)
        except Exception as exc:  # noqa: BLE001  (counted and shown; the run goes on)
            expected.pop(block, None)
            stats["errors"] += 1
            stats["last_error"] = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
            continue
        stats["ios"] += 2
        if got == data:
            stats["verified_bytes"] += bs
        else:
            stats["mismatches"] += 1
            print(f"host: MISMATCH at block {block}", flush=True)
        if time.monotonic() - saved > 0.5:
            save()
            saved = time.monotonic()
    # the end: every block written (and not lost to an error) read back once more
    for block, data in sorted(expected.items()):
        if ns.read(block * bs, bs) == data:
            stats["final_verified_bytes"] += bs
        else:
            stats["mismatches"] += 1
            print(f"host: MISMATCH at block {block} in the final pass", flush=True)
    stats["done"] = True
    save()
    ctrl.close()
    print("host: " + json.dumps(stats), flush=True)
    return 0 if stats["mismatches"] == 0 and stats["final_verified_bytes"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Paired A/B of two source trees: CPU us per 4 KiB read, target + host, for the mount and
for ``blockfabric bench``, with both trees' targets and mounts up at the same time and the
loads alternated run by run (the order flipped every iteration).

    python benchmarks/ab_pair.py TREE_A TREE_B [--iterations 8] [--runtime 3] [--out F.json]
    python benchmarks/ab_pair.py TREE_A TREE_B -t tcp --kinds mount \
        --workloads randread-4k-qd16,randread-4k-qd1,randwrite-4k-qd16   # over NVMe/TCP

Each tree needs its own ``.venv`` (``make venv``).  On a shared machine the load changes
within seconds, and cost_per_io.py's rounds (a minute or more apart) compare A and B under
different loads; here each A run has a B run next to it, and the report gives the median of
the per-pair ratios B/A with their range, beside the medians of each side.  CPU comes from
/proc over each load's counted span, as in cost_per_io.py (whose loads and sampling this
reuses).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "compare"))

import cost_per_io as cost  # noqa: E402
import systems  # noqa: E402

WORKLOADS = ("randread-4k-qd16", "randread-4k-qd1")
KINDS = ("mount", "bench")


def run(tree_a: pathlib.Path, tree_b: pathlib.Path, iterations: int,
        runtime: float, transport: str = "rdma", workloads: tuple = WORKLOADS,
        kinds: tuple = KINDS) -> list[dict]:
    rows: list[dict] = []
    trees = {"A": tree_a, "B": tree_b}
    progress = "tcp" if transport == "tcp" else "poll"
    with systems.Workspace() as ws_a, systems.Workspace() as ws_b:
        up = {}
        for side, ws in (("A", ws_a), ("B", ws_b)):
            systems.BIN = trees[side] / ".venv" / "bin"
            up[side] = ws.blockfabric(progress)
        for i in range(iterations):
            for wkey in workloads:
                w = cost.WORKLOADS[wkey]
                for kind in kinds:
                    for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                        s = up[side]
                        systems.BIN = trees[side] / ".venv" / "bin"
                        if kind == "mount":
                            res, span = cost.measure(cost.fio_argv(s.path, w, runtime),
                                                     {"server": s.server_pid,
                                                      "host": s.client_pid}, runtime)
                        else:
                            res, span = cost.measure(
                                cost.bench_argv(s.port, w, runtime, "-i", "1",
                                                transport=transport),
                                {"server": s.server_pid}, runtime,
                                {"BLOCKFABRIC_SOFT_PROGRESS": "poll"})
                        per = span.us_per_io(res.pop("ios"))
                        row = {"iteration": i, "side": side, "kind": kind, "workload": wkey,
                               "target": per.get("server", 0.0), "host": per.get("host", 0.0),
                               "iops": res["iops"], "p50": res.get("p50_us"),
                               "p99": res.get("p99_us")}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per workload and kind, over the iterations with a run of each side: each side's
    median target+host and host, and the median (min, max) of the per-iteration ratios B/A."""
    out = []
    for wkey in cost.WORKLOADS:
        for kind in KINDS:
            side = {s: {r["iteration"]: r for r in rows if r["workload"] == wkey
                        and r["kind"] == kind and r["side"] == s} for s in "AB"}
            pairs = [i for i in side["A"] if i in side["B"]]
            if not pairs:
                continue
            item = {"workload": wkey, "kind": kind, "pairs": len(pairs)}
            for name, part in (("t+h", lambda r: r["target"] + r["host"]),
                               ("host", lambda r: r["host"]), ("iops", lambda r: r["iops"])):
                ratios = sorted(part(side["B"][i]) / part(side["A"][i]) for i in pairs)
                item[name] = {"A": statistics.median(part(side["A"][i]) for i in pairs),
                              "B": statistics.median(part(side["B"][i]) for i in pairs),
                              "ratio": statistics.median(ratios),
                              "range": (ratios[0], ratios[-1])}
            out.append(item)
    return out


def markdown(items: list[dict]) -> str:
    lines = ["| workload | path | pairs | A t+h | B t+h | B/A t+h (min-max) | A host | B host | "
             "B/A host (min-max) | A IOPS | B IOPS | B/A IOPS (min-max) |", "|---" * 12 + "|"]
    for it in items:
        th, h, io = it["t+h"], it["host"], it["iops"]
        lines.append(f"| {cost.WORKLOADS[it['workload']].title} | {it['kind']} | {it['pairs']} "
                     f"| {th['A']:.1f} | {th['B']:.1f} | {th['ratio']:.2f} "
                     f"({th['range'][0]:.2f}-{th['range'][1]:.2f}) | {h['A']:.1f} | "
                     f"{h['B']:.1f} | {h['ratio']:.2f} ({h['range'][0]:.2f}-{h['range'][1]:.2f}) "
                     f"| {io['A']:.0f} | {io['B']:.0f} | {io['ratio']:.2f} "
                     f"({io['range'][0]:.2f}-{io['range'][1]:.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree_a", type=pathlib.Path)
    p.add_argument("tree_b", type=pathlib.Path)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--runtime", type=float, default=3.0, help="seconds per run")
    p.add_argument("--out", type=pathlib.Path, help="the rows and the summary, as JSON")
    p.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="rdma",
                   help="rdma: the soft provider, poll progress (default); tcp: NVMe/TCP")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma list of {', '.join(cost.WORKLOADS)} (default: "
                        f"{','.join(WORKLOADS)})")
    p.add_argument("--kinds", default=",".join(KINDS), help="mount, bench or both")
    a = p.parse_args(argv)
    workloads = tuple(a.workloads.split(","))
    kinds = tuple(a.kinds.split(","))
    for w in workloads:
        if w not in cost.WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for k in kinds:
        if k not in KINDS:
            p.error(f"unknown kind {k!r}")
    for tree in (a.tree_a, a.tree_b):
        if not (tree / ".venv" / "bin" / "blockfabric").exists():
            p.error(f"{tree}: no .venv/bin/blockfabric (make venv there)")
    rows = run(a.tree_a.resolve(), a.tree_b.resolve(), a.iterations, a.runtime,
               a.transport, workloads, kinds)
    items = summary(rows)
    if a.out:
        a.out.write_text(json.dumps({"tree_a": str(a.tree_a), "tree_b": str(a.tree_b),
                                     "rows": rows, "summary": items}, indent=1))
    print(markdown(items), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

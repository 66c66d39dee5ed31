#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/bench-verbs.sh, from the project root): the
# RDMA benchmark with the verbs provider on rxe0, small sizes (rxe under TCG is slow).  The
# report lands in $LAB_OUT_GUEST; run with LAB_OUT=benchmarks/results to keep it.
set -u
[ -f benchmarks/rdma_bw.py ] || { echo "bench-verbs.sh: run from the project root" >&2; exit 2; }
PY=${PY:-$PWD/.venv/bin/python}
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
out=${LAB_OUT_GUEST:-/tmp}/rdma_bw-$(date -u +%F)-verbs-rxe.md
timeout "${BENCH_TIMEOUT:-600}" "$PY" benchmarks/rdma_bw.py --provider verbs \
    --address "${LAB_IP:-10.99.0.1}" --sizes 4K,64K,1M --bytes 16M --lat-iters 200 \
    --runs 3 --out "$out" "$@"

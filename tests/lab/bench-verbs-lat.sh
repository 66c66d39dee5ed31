#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/bench-verbs-lat.sh [--tag TAG], from the project
# root): the product over verbs on rxe0 -- blockfabric-target (ramdisk namespace, verbs listener
# on $LAB_IP) and `blockfabric bench --provider verbs`, 4 KiB randread QD1/QD16 and randwrite
# QD16: IOPS, p50/p99 and CPU us per I/O of target and host (tests/lab/bench_verbs_lat.py).
# The report (verbs_lat-DATE-TAG.md/.json) lands in $LAB_OUT_GUEST; LAB_OUT=benchmarks/results
# keeps it.  Under TCG the absolute numbers are slow: compare runs of the same session.
set -u
[ -f tests/lab/bench_verbs_lat.py ] || { echo "bench-verbs-lat.sh: run from the project root" >&2; exit 2; }
PY=${PY:-$PWD/.venv/bin/python}
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
echo "##### verbs latency ($(uname -r), $(rdma link show 2>/dev/null | head -1))"
timeout "${BENCH_TIMEOUT:-540}" "$PY" tests/lab/bench_verbs_lat.py --py "$PY" "$@"

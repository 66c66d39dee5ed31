#!/bin/bash
# Runs INSIDE the lab guest, from the project root: everything `make lab` proves, in one boot
# (a boot costs ~10 s, and pyverbs' import ~3 s per process under TCG).
#   1. tests/lab/run-suite.sh  the verbs smoke test and the RDMA contract suite on rxe0
#   2. tests/lab/interop.sh    blockfabric against the Linux kernel's NVMe-oF host and target
#   3. tests/lab/tcp.sh        NVMe/TCP both ways: the kernel's nvme-tcp host against our tcp
#                              listener, our host and mount against the kernel's nvmet-tcp
#   4. tests/lab/gateways.sh   the kernel host (native multipath) against two gateways of ours
#                              on one RBD image (Ceph in the guest): ANA paths, failover, failback
#   5. tests/lab/pollgroups.sh poll groups (reactors: 2) on verbs: queues in the worker, the
#                              kernel host and ours, worker kill, stop, provider: auto
#   6. tests/lab/verbsfix.sh   the verbs provider's teardown order, refusals, stale connect
#                              requests and one PD per device (issue 19), about 1 min
# Exit status 0 only when all passed; each part's own summary says what failed.
set -u
[ -f tests/lab/interop.sh ] || { echo "all.sh: run from the project root" >&2; exit 2; }
rc=0
t0=$EPOCHREALTIME
bash tests/lab/run-suite.sh || rc=1
t1=$EPOCHREALTIME
echo; echo "##### run-suite.sh: rc=$rc in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.0f", b-a}') s"
bash tests/lab/interop.sh || rc=1
t2=$EPOCHREALTIME
echo "##### interop.sh done in $(awk -v a="$t1" -v b="$t2" 'BEGIN{printf "%.0f", b-a}') s; rc=$rc"
bash tests/lab/tcp.sh || rc=1
t3=$EPOCHREALTIME
echo "##### tcp.sh done in $(awk -v a="$t2" -v b="$t3" 'BEGIN{printf "%.0f", b-a}') s; rc=$rc"
bash tests/lab/gateways.sh || rc=1
t4=$EPOCHREALTIME
echo "##### gateways.sh done in $(awk -v a="$t3" -v b="$t4" 'BEGIN{printf "%.0f", b-a}') s; rc=$rc"
bash tests/lab/pollgroups.sh || rc=1
t5=$EPOCHREALTIME
echo "##### pollgroups.sh done in $(awk -v a="$t4" -v b="$t5" 'BEGIN{printf "%.0f", b-a}') s; rc=$rc"
bash tests/lab/verbsfix.sh || rc=1
echo "##### verbsfix.sh done in $(awk -v a="$t5" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.0f", b-a}') s; all.sh rc=$rc"
exit $rc

#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/suites.sh [PYTEST-ARGS...], from the project
# root): the end-to-end, fault and hostile suites (issue 19) with BLOCKFABRIC_TEST_TRANSPORTS=
# verbs, that is NVMe-oF over the verbs provider on rxe0 ($IP), the target and its hosts in
# this guest.  Pass 1 runs every target with one poll group, pass 2 with
# BLOCKFABRIC_TEST_REACTORS=2 (as make test-reactors does on the host: the tests already
# parametrised with 1r and 2r run in pass 1 only).  Tests that speak the soft provider's or
# NVMe/TCP's wire themselves are skipped, each saying why (pytest -rs lists them).
#
# Knobs (environment, or NAME=VALUE arguments before the rest: lab/run passes no environment
# into the guest, so make lab-suites hands them over as arguments):
#   SUITES="tests/e2e tests/faults tests/hostile"   what pytest runs (files or dirs)
#   PASSES="1 2"          which passes: 1 (one poll group) and/or 2 (reactors: 2)
#   JOBS=1                pytest-xdist workers (--dist loadfile)
#   SUITE_TIMEOUT=3000    seconds for each pass before it is killed
#   START_TIMEOUT=90      BLOCKFABRIC_TEST_START_TIMEOUT: how long fixtures wait for a daemon
#                         to get ready (pyverbs and a worker start slowly under TCG)
# The other arguments go to pytest (e.g. -k reconnect, -x).  One RESULT line per pass (its pytest
# summary); exit status 0 only when every pass passed.  Not in .ci/run: see make lab-suites.
set -u
while [ $# -gt 0 ]; do
    case $1 in
        SUITES=*|PASSES=*|JOBS=*|SUITE_TIMEOUT=*|START_TIMEOUT=*) export "${1?}"; shift ;;
        *) break ;;
    esac
done
[ -f tests/lab/suites.sh ] || { echo "suites.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
SUITES=${SUITES:-tests/e2e tests/faults tests/hostile}
PASSES=${PASSES:-1 2}
JOBS=${JOBS:-1}
RESULT_WIDTH=10
trap 'rm -rf "$W"' EXIT

export BLOCKFABRIC_TEST_TRANSPORTS=verbs BLOCKFABRIC_TEST_ADDR=$IP
export BLOCKFABRIC_TEST_START_TIMEOUT=${START_TIMEOUT:-90}
# the attackers of tests/hostile connect from other addresses than the bystander's
# (tests/e2e/conftest.py peer_addr: $IP with last octet 2-9); rxe adds a GID for each
dev=$(ip -o -4 addr show | awk -v ip="$IP" '$4 ~ "^"ip"/" {print $2; exit}')
prefix=${IP%.*}
for n in 2 3 4 5 6 7 8 9; do
    [ "$prefix.$n" = "$IP" ] || ip addr add "$prefix.$n/24" dev "$dev" 2> /dev/null
done
# always through pytest-xdist, even for one job: a worker that crashes (a segfault in pyverbs
# was seen) is replaced and the pass goes on, its test reported as failed
xdist=(-n "$JOBS" --dist loadfile)

echo "##### end-to-end, fault and hostile suites on verbs ($(uname -r), $(rdma link show 2>/dev/null | head -1))"
echo "# $IP on $dev (+ $prefix.2-9), SUITES=$SUITES PASSES=\"$PASSES\" JOBS=$JOBS," \
     "BLOCKFABRIC_TEST_START_TIMEOUT=$BLOCKFABRIC_TEST_START_TIMEOUT"
for pass in $PASSES; do
    case $pass in
        1) env=(BLOCKFABRIC_TEST_REACTORS=1); select=() ;;
        2) env=(BLOCKFABRIC_TEST_REACTORS=2); select=(-k "not 1r and not 2r") ;;
        *) echo "suites.sh: PASSES: 1 and/or 2, not $pass" >&2; exit 2 ;;
    esac
    echo; echo "##### pass $pass: ${env[*]} pytest $SUITES ${select[*]} $*"
    t0=$(now)
    # shellcheck disable=SC2086  # SUITES is a list of paths
    env "${env[@]}" timeout -k 30 "${SUITE_TIMEOUT:-3000}" "$PY" -X faulthandler -m pytest \
        $SUITES "${xdist[@]}" "${select[@]}" -v -rfEs -p no:cacheprovider \
        -o junit_family=xunit2 --junitxml="$W/pass$pass.xml" "$@" 2>&1 | tee "$W/pass$pass.txt"
    rc=${PIPESTATUS[0]}
    line=$(grep -E "^=+ .*(passed|failed|skipped|error).* in [0-9.]+s" "$W/pass$pass.txt" | tail -1)
    [ "$rc" = 124 ] && line="killed after SUITE_TIMEOUT=${SUITE_TIMEOUT:-3000} s; $line"
    if [ "$rc" = 0 ]; then result "pass$pass" OK "${line//=/} ($(since "$t0") s)"
    else result "pass$pass" FAIL "rc=$rc ${line//=/} ($(since "$t0") s)"; fi
    grep -E "^(FAILED|ERROR) " "$W/pass$pass.txt" | sed "s/^/  pass$pass /" | tee -a "$W/failed.txt"
done
summary "suites on verbs: summary"
[ -s "$W/failed.txt" ] && { echo "failing tests:"; cat "$W/failed.txt"; }
exit $fail

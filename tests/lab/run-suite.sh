#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/run-suite.sh, from the project root):
# the verbs provider's smoke test, then the RDMA contract suite (tests/rdma) with the verbs
# provider on rxe0.  Exit status 0 only when both passed.
set -u
# lab/run hands over a copy of this script but keeps the working directory: the project root
[ -f tests/lab/verbs_smoke.py ] || { echo "run-suite.sh: run from the project root" >&2; exit 2; }
PY=${PY:-$PWD/.venv/bin/python}
export BLOCKFABRIC_TEST_PROVIDERS=verbs BLOCKFABRIC_TEST_ADDR=${LAB_IP:-10.99.0.1}
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
# an IPv6 address on rxe0's netdev too (rxe adds its GID), for the suite's IPv6 test
if [ -n "${LAB_IP:-}" ] && ip -6 addr add fd00:99::1/64 dev labnet0 nodad 2>/dev/null; then
    export BLOCKFABRIC_TEST_ADDR6=fd00:99::1
fi
rc=0
echo "##### verbs smoke ($(uname -r), $(rdma link show 2>/dev/null | head -1))"
timeout 300 "$PY" -X faulthandler tests/lab/verbs_smoke.py "$BLOCKFABRIC_TEST_ADDR" || rc=1
if [ -d tests/rdma ]; then
    # Only the provider-parametrised contract suite: test_soft.py and test_net.py test the
    # soft provider and the netns helpers, which `make test` covers on the host; under TCG
    # they would only cost minutes (and their subprocess timeouts).
    echo "##### contract suite: tests/rdma/test_contract.py with BLOCKFABRIC_TEST_PROVIDERS=verbs"
    timeout "${SUITE_TIMEOUT:-900}" "$PY" -X faulthandler -m pytest tests/rdma/test_contract.py \
        -v -p no:cacheprovider "$@" || rc=1
else
    echo "##### tests/rdma not present: contract suite skipped"
fi
exit $rc

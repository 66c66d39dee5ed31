#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/verbsfix.sh, from the project root): the verbs
# provider's resource and connection bugs of issue 19, on rxe0.
#   V/teardown   connections closed with a failing QP close, dropped without close() and left
#                open at exit: the process exits 0 (it crashed with SIGSEGV in destroy order)
#   V/refused    a connect nothing listens for, and one the peer rejects with an NVMe-oF
#                status, say which (tests/lab/verbs_fixes.py refused); the host CLI too
#   V/stale      a connect request whose host gave up before the accept: ConnectionAbandoned
#                (verbs_fixes.py stale); then the target, stopped while the kernel host gives
#                up, logs it abandoned, keeps no half-made queue, and serves the next host
#   V/resources  the target's protection domains and registered memory (rdma res) with the
#                kernel host's 3 queues, twice over: one PD per device, no growth
# Arguments name the cases to run (teardown refused stale refused-host stale-target
# resources); none runs them all.  Exit status 0 when all passed.
set -u
[ -f tests/lab/verbsfix.sh ] || { echo "verbsfix.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
export PYTHONDONTWRITEBYTECODE=1
PORT=4420
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-00000000f1c5
NQN=nqn.2026-12.io.blockfabric:verbsfix
TGT_PID=
RESULT_WIDTH=12
cleanup() { nvme disconnect-all > /dev/null 2>&1; stop_target > /dev/null; rm -rf "$W"; }
trap cleanup EXIT

probe() {  # probe CASE: tests/lab/verbs_fixes.py CASE, its result line
    local rc
    say "V/$1"
    timeout 300 "$PY" -X faulthandler tests/lab/verbs_fixes.py "$1" "$IP" 2>&1 | tee "$W/$1.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" = 0 ]; then result "V/$1" OK "$(tail -n 1 "$W/$1.txt")"
    else result "V/$1" FAIL "rc=$rc $(grep -m1 'FAIL\|Segmentation\|Fatal' "$W/$1.txt")"; fi
}

start_target() {  # start_target [LIMITS-YAML]
    local listener="{transport: rdma, provider: verbs, address: $IP, port: $PORT}"
    { target_yaml "$NQN" "$listener"; [ -n "${1:-}" ] && echo "limits: $1"; } > "$W/target.yaml"
    launch_target "$W/target.yaml"
}
# rdma res lines of the target process: res KIND
res() { rdma res show "$1" 2> /dev/null | grep -c " pid $TGT_PID " ; }
# the protection domains our memory is registered on (librdmacm allocates one more per device
# for its own use, with nothing registered on it: rdma res counts it in the process too)
mr_pds() { rdma res show mr 2> /dev/null | grep " pid $TGT_PID " | grep -o "pdn [0-9]*" |
           sort -u | wc -l; }
mr_bytes() { rdma res show mr 2> /dev/null | grep " pid $TGT_PID " |
             awk '{for (i = 1; i < NF; i++) if ($i == "mrlen") s += $(i + 1)} END {print s + 0}'; }
connections() { "$BIN/blockfabric-target" status --socket "$W/target.sock" --output-format json |
                 "$PY" -c 'import json, sys; print(json.load(sys.stdin)["resources"]["connections"])'; }
connect_kernel() {
    nvme connect -t rdma -a "$IP" -s "$PORT" -n "$NQN" -q "$HOSTNQN" -i 2 "$@" || return 1
    POLL_MAX=100 poll ns_dev "$NQN" 2 > /dev/null || { echo "no namespace 2"; return 1; }
}
# read a block of every namespace: a volume's memory is registered at its first read, which
# the kernel's partition scan may or may not have made yet (so both counts see it)
read_all() {
    local n d
    for n in 1 2; do
        d=$(ns_dev "$NQN" "$n") || { echo "no namespace $n"; return 1; }
        dd if="$d" of=/dev/null bs=4k count=1 iflag=direct status=none || return 1
    done
}

case_resources() {
    local ok=OK pds=() mrs=() i
    say "V/resources: kernel host -i 2 (3 queues), connected twice"
    start_target || { result V/resources FAIL "target did not start"; return; }
    for i in 1 2; do
        connect_kernel || { result V/resources FAIL "nvme connect $i failed"; stop_target; return; }
        read_all || { result V/resources FAIL "reads after connect $i failed"; stop_target; return; }
        pds+=("$(mr_pds)/$(res pd)"); mrs+=("$(mr_bytes)")
        echo "connection $i: $(res qp) QPs, ${pds[-1]} PDs (with memory/all), ${mrs[-1]} B registered"
        rdma res show pd 2> /dev/null | grep " pid $TGT_PID "
        nvme disconnect -n "$NQN" > /dev/null
        wait_for 30 eval '[ "$(res qp)" = 0 ]' || { echo "QPs left: $(res qp)"; ok=FAIL; }
    done
    echo "after both: $(res pd) PDs, $(mr_bytes) B registered"
    [ "${pds[0]%/*}" = 1 ] && [ "${pds[1]}" = "${pds[0]}" ] || ok=FAIL
    [ "${mrs[0]}" = "${mrs[1]}" ] || ok=FAIL
    stop_target > /dev/null || ok=FAIL
    result V/resources "$ok" "PDs with memory/all ${pds[*]}, registered bytes ${mrs[*]} (one PD per device, no growth)"
}

case_refused_cli() {
    local ok=OK out
    say "V/refused-host: blockfabric connect --provider verbs"
    out=$("$BIN/blockfabric" connect --provider verbs -a "$IP" -s 4499 -n "$NQN" -i 1 2>&1)
    echo "no listener: $out" | tail -n 2
    echo "$out" | grep -q "is a target listening there" || ok=FAIL
    start_target "{max_connections_per_host: 1}" || { result V/refused-host FAIL "no target"; return; }
    out=$("$BIN/blockfabric" connect --provider verbs -a "$IP" -s "$PORT" -n "$NQN" -i 1 2>&1)
    echo "over the limit: $out" | tail -n 2
    echo "$out" | grep -q "target rejected queue 1: NO_RESOURCES" || ok=FAIL
    stop_target > /dev/null || ok=FAIL
    result V/refused-host "$ok" "no listener / NO_RESOURCES named by the host"
}

case_stale() {
    local ok=OK n
    say "V/stale-target: the target stopped while the kernel host gives up"
    start_target || { result V/stale-target FAIL "target did not start"; return; }
    kill -STOP "$TGT_PID"
    # With the target stopped, its kernel CM answers the REQ with MRAs (a 68 s service
    # timeout, renewed on every retry), so the host's connect would wait for many minutes:
    # the host gives up itself, with SIGINT after 10 s, as a user's ^C would.
    t0=$(now)
    timeout -s INT 10 nvme connect -t rdma -a "$IP" -s "$PORT" -n "$NQN" -q "$HOSTNQN" -i 2 \
        -l 1 > "$W/stale-connect.txt" 2>&1 && { echo "connected while stopped?"; ok=FAIL; }
    echo "nvme connect gave up after $(since "$t0") s: $(tail -n 1 "$W/stale-connect.txt")"
    nvme disconnect-all > /dev/null 2>&1
    kill -CONT "$TGT_PID"
    wait_for 30 grep -q "abandoned" "$W/target.log" || { echo "no 'abandoned' in the log"; ok=FAIL; }
    grep "abandoned\|Traceback" "$W/target.log" | head -n 5
    n=$(connections); echo "connections after: $n"
    [ "$n" = 0 ] || ok=FAIL
    grep -q Traceback "$W/target.log" && ok=FAIL
    connect_kernel || { echo "the next host could not connect"; ok=FAIL; }
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    stop_target > /dev/null || ok=FAIL
    result V/stale-target "$ok" "stale request logged abandoned, $n connections left, next host served"
}

modprobe nvme-rdma 2> /dev/null || { echo "cannot load nvme-rdma"; exit 1; }
for c in "${@:-teardown refused stale refused-host stale-target resources}"; do
    for c in $c; do
        case $c in
            teardown|refused|stale) probe "$c";;
            refused-host) case_refused_cli;;
            stale-target) case_stale;;
            resources) case_resources;;
            *) echo "verbsfix.sh: no case $c" >&2; exit 2;;
        esac
    done
done
summary "verbsfix.sh"
exit $fail

#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/pollgroups.sh, from the project root): poll
# groups (reactors: 2) on a verbs listener on rxe0, issue 19: the rdma_cm id of a handed-over
# I/O queue stays in the coordinator, its QP is the worker's (docs/scaling.md).
#   pg/kernel   the kernel's nvme-rdma host, -i 2: one I/O queue in the worker, one in the
#               coordinator (status says which), dd and fio verify, then the host's disconnect
#               reaches the worker's queue through the coordinator's event channel
#   pg/ours     blockfabric bench --provider verbs, 2 jobs (processes, a controller each) x 2
#               queues: the 4 I/O queues, some in the worker, crc32c verify
#   pg/kill     SIGKILL of the worker under the kernel host's fio: the coordinator disconnects
#               the worker's queues (it has their rdma_cm ids), the host resets and reconnects,
#               a new worker serves again, the data verifies
#   pg/stop     SIGTERM with hosts connected: the target exits 0 with no traceback
#   pg/auto     pg/kernel again with provider: auto (it picks verbs on rxe0's address)
# REACTORS=1 runs the same with one process (the baseline).  Exit status 0 when all passed.
set -u
[ -f tests/lab/pollgroups.sh ] || { echo "pollgroups.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
PORT=4420
REACTORS=${REACTORS:-2}
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-00000000a12b
NQN=nqn.2026-12.io.blockfabric:pollgroups
TGT_PID=
RESULT_WIDTH=12
cleanup() { nvme disconnect-all > /dev/null 2>&1; stop_target > /dev/null; rm -rf "$W"; }
trap cleanup EXIT

start_target() {  # a fresh $W/target.log each start (the worker's lines below are this one's)
    local listener="{transport: rdma, provider: ${PROVIDER:-verbs}, address: $IP, port: $PORT}"
    { echo "reactors: $REACTORS"; target_yaml "$NQN" "$listener"; } > "$W/target.yaml"
    launch_target "$W/target.yaml" || return 1
    if [ "$REACTORS" -gt 1 ]; then     # the worker takes verbs queues once its devices are open
        POLL_MAX=900 poll grep -q "RDMA devices open" "$W/target.log" || { echo "worker: no RDMA devices"; return 1; }
    fi
    grep "poll groups\|RDMA devices" "$W/target.log"
}

# where each I/O queue is served: "c1.q1:g1 c1.q2:g0 | g0=1@PID g1=1@PID" (tests/lab/pg_status.py)
placement() { "$PY" tests/lab/pg_status.py "$W/target.sock" "$@"; }

connect_kernel() {
    nvme connect -t rdma -a "$IP" -s "$PORT" -n "$NQN" -q "$HOSTNQN" -i 2 -c 1 -l 60 || return 1
    POLL_MAX=100 poll ns_dev "$NQN" 2 > /dev/null
}

case_kernel() {
    local ok=OK t0 dev1 dev2 where name=${1:-pg/kernel}
    say "$name: kernel nvme-rdma host, -i 2, reactors: $REACTORS, provider: ${PROVIDER:-verbs}"
    t0=$(now)
    connect_kernel || { result "$name" FAIL "nvme connect failed"; tail -n 30 "$W/target.log"; return; }
    dev1=$(ns_dev "$NQN" 1); dev2=$(ns_dev "$NQN" 2)
    where=$(placement queues 2 20); echo "placement: $where"
    if [ "$REACTORS" -gt 1 ] && ! placement worker 10 > /dev/null; then echo "no I/O queue in the worker"; ok=FAIL; fi
    dd_verify "$dev1" || ok=FAIL
    fio_verify "$dev2" 2 9 || ok=FAIL
    echo "after I/O: $(placement)"
    nvme disconnect -n "$NQN" || ok=FAIL
    # the host's DREQ: the coordinator's id, forwarded, ends the worker's queue too
    placement empty 20 || ok=FAIL
    result "$name" "$ok" "$where; 8 MiB dd + 16 MiB fio verified, $(since "$t0") s"
}

case_ours() {
    local ok=OK t0 pid where=""
    say "pg/ours: blockfabric bench --provider verbs, -i 2 --numjobs 2, crc32c verify"
    t0=$(now)
    "$BIN/blockfabric" bench --provider verbs -a "$IP" -s "$PORT" -n "$NQN" -q "$HOSTNQN" \
        -i 2 --numjobs 2 --nsid 2 --rw randrw --bs 4k --iodepth 8 --size 8M --runtime 8 \
        --verify crc32c > "$W/bench.txt" 2>&1 &
    pid=$!
    # Each job process connects its own controller with -i 2: 4 I/O queues, all connected
    # before the jobs start and until their 8 s end.  (This waited for 2, which only the
    # moment between the two jobs' connects shows: under TCG that was missed at times.)
    where=$(placement queues 4 60) || { echo "placement: $where"; ok=FAIL; }
    if [ "$REACTORS" -gt 1 ] && [[ "$where" != *":g1"* ]]; then echo "no I/O queue in the worker"; ok=FAIL; fi
    wait "$pid" || ok=FAIL
    grep -E "read:|write:|error|verify" "$W/bench.txt" | head -n 6
    [ "$ok" = OK ] || cat "$W/bench.txt"
    placement empty 20 || ok=FAIL
    result pg/ours "$ok" "$where; $(since "$t0") s"
}

case_kill() {
    local ok=OK t0 wpid fio_pid before after
    say "pg/kill: SIGKILL of the worker under the kernel host's fio"
    [ "$REACTORS" -gt 1 ] || { result pg/kill OK "skipped with one reactor"; return; }
    t0=$(now)
    connect_kernel || { result pg/kill FAIL "nvme connect failed"; return; }
    before=$(placement queues 2 20); echo "placement: $before"
    wpid=$(echo "$before" | sed -n 's/.*g1=[0-9]*@\([0-9]*\).*/\1/p')
    fio --name=kill --filename="$(ns_dev "$NQN" 2)" --direct=1 --ioengine=libaio --rw=randwrite \
        --bs=4k --size=16M --iodepth=8 --numjobs=2 --offset_increment=16M --time_based \
        --runtime=12 --output="$W/fio-kill.txt" --group_reporting &
    fio_pid=$!
    sleep 2
    echo "killing worker pid $wpid"; kill -KILL "$wpid"
    POLL_MAX=100 poll grep -q "poll group 1 (pid $wpid) exited" "$W/target.log" \
        || { echo "the coordinator did not notice"; ok=FAIL; }
    wait "$fio_pid" || { echo "fio saw errors:"; ok=FAIL; }
    grep -E "WRITE:|err=" "$W/fio-kill.txt"
    # the host reconnects (-c 1); a new worker serves I/O queues again
    placement queues 2 60 || ok=FAIL
    after=$(placement); echo "after: $after"
    dd_verify "$(ns_dev "$NQN" 1)" || ok=FAIL
    dmesg | grep -i "nvme" | tail -n 6
    nvme disconnect -n "$NQN" > /dev/null || ok=FAIL
    result pg/kill "$ok" "worker $wpid killed; after: $after; $(since "$t0") s"
}

case_stop() {
    local ok=OK rc
    say "pg/stop: SIGTERM with a host connected"
    connect_kernel || ok=FAIL
    kill -TERM "$TGT_PID"
    POLL_MAX=200 poll eval '! kill -0 $TGT_PID 2>/dev/null' || ok=FAIL
    wait "$TGT_PID"; rc=$?; TGT_PID=
    [ "$rc" = 0 ] || { echo "target exited rc=$rc"; ok=FAIL; }
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    if grep -q "Traceback" "$W/target.log"; then grep -B2 -A25 "Traceback" "$W/target.log" | head -n 60; ok=FAIL; fi
    result pg/stop "$ok" "target rc=$rc, tracebacks in its log: $(grep -c Traceback "$W/target.log")"
}

echo "##### poll groups on verbs ($(uname -r), $(rdma link show 2>/dev/null | head -1)), reactors: $REACTORS"
modprobe nvme-rdma 2>/dev/null
start_target || exit 1
case_kernel
case_ours
case_kill
case_stop
echo; echo "----- target log (warnings, errors) -----"
grep -E "WARNING|ERROR|Traceback|exited" "$W/target.log" | tail -n 25
mv "$W/target.log" "$W/target-verbs.log"
# provider: auto picks verbs for an address of rxe0's netdev: the same hand-over
PROVIDER=auto start_target && grep "provider auto" "$W/target.log"
PROVIDER=auto case_kernel pg/auto
stop_target > /dev/null || result pg/auto-stop FAIL "target exit status"
summary "pollgroups summary (reactors: $REACTORS)"
exit $fail

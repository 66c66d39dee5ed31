#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/gateways.sh, from the project root; make lab
# runs it from tests/lab/all.sh): the Linux kernel's NVMe host against a gateway group of
# ours (issue 16).  A throwaway Ceph (tests/ceph/ceph-up.sh: one mon, one memstore OSD, in
# the guest) holds one RBD image; two blockfabric-target gateways (gw-a, gw-b: verbs
# listeners on rxe0, ports 4420 and 4421, ANA leases in RADOS) export it as nsid 1 of one
# subsystem, in ANA group 1, whose home is gw-a.  The kernel host (nvme-rdma, native
# multipath) connects to both:
#   G/paths     `nvme list-subsys` shows one subsystem with two paths, gw-a optimized and
#               gw-b non-optimized; one multipath block device.
#   G/failover  fio crc32c-verified random writes on that device while gw-a is SIGKILLed
#               (gw-b takes group 1 when gw-a's lease runs out) and then started again (it
#               takes group 1 back): fio finishes with no error; the times from kill to gw-b
#               optimized, and from restart to failback, are printed.
# Prints one "RESULT" line per case; exit status 0 when all passed.  Skips (exit 0, saying
# so) where Ceph's daemons are not installed (make test installs them).
set -u
[ -f tests/lab/gateways.sh ] || { echo "gateways.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh     # PY, BIN, IP, W, say, since, wait_for, result, summary
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000a7e00
NQN=nqn.2026-12.io.blockfabric:lab-gateways
# a TCG guest on a loaded machine takes seconds per RADOS call: a longer lease than the
# defaults (6 s, 2 s), so that a slow renewal is not taken for a dead gateway
LEASE=${GW_LEASE:-20} RENEW=${GW_RENEW:-4}
declare -A PID

cleanup() {
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    local g; for g in "${!PID[@]}"; do kill -KILL "${PID[$g]}" 2> /dev/null; done
    [ -f "$W/ceph/ceph.conf" ] && tests/ceph/ceph-down.sh "$W/ceph" > /dev/null 2>&1
    rm -rf "$W"
}
trap cleanup EXIT

if ! command -v ceph-mon > /dev/null || ! command -v ceph-osd > /dev/null \
        || ! "$PY" -c "import rbd, rados" 2> /dev/null; then
    result G/paths SKIP "Ceph's daemons or python3-rbd are not installed (make test installs them)"
    exit 0
fi

modprobe -a nvme-rdma > /dev/null 2>&1 || { result G/paths FAIL "cannot load nvme-rdma"; exit 1; }

say "a throwaway Ceph in the guest"
t0=$EPOCHREALTIME
mkdir -p "$W/ceph"
CEPH_STORE_BYTES=$((1 << 30)) CEPH_IMAGE= CEPH_UP_TIMEOUT=600 CEPH_CMD_TIMEOUT=120 \
    tests/ceph/ceph-up.sh "$W/ceph" \
    > "$W/ceph.env" || { result G/paths FAIL "ceph-up.sh failed"; exit 1; }
CONF=$W/ceph/ceph.conf
# gateways write one image concurrently: no exclusive-lock (docs/ceph.md)
timeout 180 rbd --conf "$CONF" create --size 256M --image-feature layering rbd/gw \
    || { result G/paths FAIL "rbd create failed"; exit 1; }
echo "Ceph up and rbd/gw created in $(since "$t0") s"

gateway_yaml() {  # gateway_yaml NAME PORT CNTLID_MIN CNTLID_MAX HOME_GROUPS
    cat <<YAML
listeners:
  - {transport: rdma, provider: verbs, address: $IP, port: $2}
subsystems:
  - nqn: $NQN
    allow_any_host: true
    namespaces:
      - nsid: 1
        backend: rbd
        ana_group: 1
        rbd: {pool: rbd, image: gw, ceph_conf: $CONF, connect_timeout: 20, op_timeout: 20,
              size_poll_interval: 0}
gateway: {name: $1, group: lab, cntlid_min: $3, cntlid_max: $4, ana_groups: $5,
          others: non-optimized, lease: $LEASE, renew_interval: $RENEW}
control_socket: $W/$1.sock
YAML
}
start_gateway() {  # start_gateway NAME: a fresh log each start, so "ready:" is this start's
    local n=$1
    [ -e "$W/$n.log" ] && cat "$W/$n.log" >> "$W/$n.log.old"
    "$BIN/blockfabric-target" run -C "$W/$n.yaml" > "$W/$n.log" 2>&1 &
    PID[$n]=$!
    wait_for 300 grep -q "ready:" "$W/$n.log" || { echo "$n not ready:"; tail -n 30 "$W/$n.log"; return 1; }
}
gateway_yaml gw-a 4420 1 99 "[1]" > "$W/gw-a.yaml"
gateway_yaml gw-b 4421 100 199 "[]" > "$W/gw-b.yaml"

# the ANA state of the path through port $1 ("optimized", "non-optimized", ...), from sysfs:
# the controller whose address names that port, and its hidden per-path node nvmeXcYn1
path_state() {
    local c y n
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2> /dev/null)" = "$NQN" ] || continue
        case "$(cat "$c/address" 2> /dev/null)" in *"trsvcid=$1"*) ;; *) continue;; esac
        # a path that is not live keeps the ANA state it last read: not an answer
        [ "$(cat "$c/state" 2> /dev/null)" = live ] || { echo "$(cat "$c/state" 2> /dev/null)"; return 0; }
        y=${c##*/nvme}
        for n in /sys/block/nvme*c"${y}"n1; do [ -e "$n/ana_state" ] && cat "$n/ana_state" && return 0; done
    done
    echo none
}
show_state() {  # what each side thinks, for a failure
    local c; for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2> /dev/null)" = "$NQN" ] || continue
        echo "---- nvme ana-log /dev/${c##*/} ($(cat "$c/address"))"; nvme ana-log "/dev/${c##*/}"
    done
    echo "---- dmesg (nvme)"; dmesg | grep -i nvme | tail -n 20
    tail -n 25 "$W"/gw-*.log
}
is_state() { [ "$(path_state "$1")" = "$2" ]; }

# ---------------------------------------------------------------------------------------
say "G/paths: the kernel host connects to both gateways"
ok=OK; t0=$EPOCHREALTIME
echo "native multipath: $(cat /sys/module/nvme_core/parameters/multipath 2> /dev/null)"
start_gateway gw-a && start_gateway gw-b || { result G/paths FAIL "a gateway did not start"; exit 1; }
for port in 4420 4421; do
    nvme connect -t rdma -a "$IP" -s "$port" -n "$NQN" -q "$HOSTNQN" -i 2 \
        --reconnect-delay=1 --ctrl-loss-tmo=600 || { ok=FAIL; dmesg | tail -n 30; tail -n 30 "$W"/gw-*.log; }
done
# the kernel reads the ANA log at connect; gw-a takes its home group within a renewal
wait_for 60 is_state 4420 optimized || ok=FAIL
wait_for 60 is_state 4421 non-optimized || ok=FAIL
nvme list-subsys | tee "$W/list-subsys.txt"
nvme list
DEV=""     # the multipath head: /sys/class/nvme-subsystem/nvme-subsysN/nvmeMn1
for b in /sys/class/nvme-subsystem/*; do
    [ "$(cat "$b/subsysnqn" 2> /dev/null)" = "$NQN" ] || continue
    for n in "$b"/nvme*n1; do [ -e "$n" ] && DEV=/dev/${n##*/}; done
done
npaths=0
for c in /sys/class/nvme/nvme*; do [ "$(cat "$c/subsysnqn" 2> /dev/null)" = "$NQN" ] && npaths=$((npaths + 1)); done
[ "$npaths" = 2 ] || { echo "expected two paths, list-subsys shows $npaths"; ok=FAIL; }
[ -b "${DEV:-/nonexistent}" ] || { echo "no multipath block device"; ok=FAIL; }
result G/paths "$ok" "one subsystem, $npaths paths (4420 $(path_state 4420), 4421 $(path_state 4421)), $DEV, $(since "$t0") s"
[ "$ok" = OK ] || { show_state; exit 1; }

# ---------------------------------------------------------------------------------------
say "G/failover: fio verify on $DEV while gw-a is killed and started again"
ok=OK
fio --name=failover --filename="$DEV" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
    --size=64M --iodepth=8 --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=16 \
    --time_based --runtime="${GW_FIO_SECONDS:-150}" --verify_backlog=1024 \
    --eta=never --output="$W/fio.txt" &
FIO=$!
sleep 5
kill -0 "$FIO" 2> /dev/null || { cat "$W/fio.txt"; result G/failover FAIL "fio ended early"; exit 1; }
tk=$EPOCHREALTIME
kill -KILL "${PID[gw-a]}"; wait "${PID[gw-a]}" 2> /dev/null; unset 'PID[gw-a]'
echo "gw-a SIGKILLed"
if wait_for 120 is_state 4421 optimized; then
    took_over=$(since "$tk"); echo "gw-b optimized for group 1 after $took_over s"
else took_over=never; ok=FAIL; fi
sleep 3
tr=$EPOCHREALTIME
start_gateway gw-a || ok=FAIL
echo "gw-a ready again after $(since "$tr") s"
if wait_for 180 is_state 4420 optimized && wait_for 60 is_state 4421 non-optimized; then
    failback=$(since "$tr"); echo "failback: gw-a optimized again $failback s after its restart"
    kill -0 "$FIO" 2> /dev/null && failback="$failback (fio still running)"
else failback=never; ok=FAIL; show_state; fi
nvme list-subsys
wait "$FIO"; frc=$?
grep -E "WRITE:|READ:|err=|verify" "$W/fio.txt"
[ "$frc" = 0 ] && grep -q "err= 0" "$W/fio.txt" || { echo "fio rc=$frc"; cat "$W/fio.txt"; ok=FAIL; }
written=$(awk '/WRITE:/{for(i=1;i<=NF;i++) if ($i ~ /^io=/) print $i}' "$W/fio.txt")
grep -i "traceback" "$W"/gw-*.log && ok=FAIL
dmesg | grep -i "nvme" | tail -n 12
result G/failover "$ok" "fio verify err=0 ($written), kill->gw-b optimized ${took_over} s, restart->failback ${failback} s"

summary "gateways.sh summary"
exit $fail

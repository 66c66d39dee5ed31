#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/tcp.sh, from the project root): blockfabric
# against the Linux kernel's NVMe/TCP stack (issue 18), both ways, over the guest's own
# address (no RDMA device involved).
#   A. the kernel host (nvme-cli, nvme-tcp) against blockfabric-target (a tcp listener):
#      discover, connect -i 3, dd and fio verify (data checked on our backing file), nvme
#      list, disconnect; again with --hdr-digest --data-digest.
#   B. blockfabric's host (-t tcp) against the kernel's nvmet-tcp on a brd ramdisk:
#      discover, identify, a verify workload through the host library (checked on /dev/ram0),
#      with and without digests, and fio verify through the FUSE mount.
# Prints one "RESULT" line per case (what ran, bytes verified); exit status 0 when all passed.
# TCP_PARTS=AB (the default) runs both parts, TCP_PARTS=B only B; the first argument
# overrides it (`lab/run tests/lab/tcp.sh B`).  A failed B case
# prints the kernel's nvme lines from dmesg: nvmet-tcp says there why it dropped a connection.
set -u
TCP_PARTS=${1:-${TCP_PARTS:-AB}}
[ -f tests/lab/tcp.sh ] || { echo "tcp.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
PORT=4420
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000007cb
NQN_OURS=nqn.2026-12.io.blockfabric:tcp
NQN_KERNEL=nqn.2026-12.io.rdma-lab:kernel-tcp-ram0
TGT_PID=

result_failed() {  # after a FAIL line (tests/lab/nvme-lib.sh's result)
    case $1 in B/*) echo "---- dmesg | grep -i nvme ----"; dmesg | grep -i nvme | tail -n 25 ;; esac
}

cleanup() {
    nvme disconnect-all > /dev/null 2>&1
    "$BIN/blockfabric" umount "$W/mnt" > /dev/null 2>&1
    stop_target
    kernel_target_down > /dev/null 2>&1
    rm -rf "$W"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------------
# A. kernel nvme-tcp host -> blockfabric-target
# ---------------------------------------------------------------------------------------
start_target() {
    target_yaml "$NQN_OURS" "{transport: tcp, address: $IP, port: $PORT}" > "$W/target.yaml"
    launch_target "$W/target.yaml"
}

kernel_host_case() {  # kernel_host_case NAME [nvme connect digest flags]
    local name=$1 t0 dev1 dev2 bytes=0 ok=OK ctrl
    shift
    say "A/$name: kernel nvme-tcp host -> blockfabric-target, -i 3 $*"
    t0=$(now)
    nvme discover -t tcp -a "$IP" -s "$PORT" -q "$HOSTNQN" | tee "$W/discover.txt" || ok=FAIL
    grep -q "trtype: *tcp" "$W/discover.txt" && grep -q "subnqn: *$NQN_OURS" "$W/discover.txt" \
        || { echo "discovery lacks a tcp entry for $NQN_OURS"; ok=FAIL; }
    nvme connect -t tcp -a "$IP" -s "$PORT" -n "$NQN_OURS" -q "$HOSTNQN" -i 3 "$@" || ok=FAIL
    POLL_MAX=100 poll ns_dev "$NQN_OURS" 2 > /dev/null || echo "no block devices"
    nvme list
    dev1=$(ns_dev "$NQN_OURS" 1) && dev2=$(ns_dev "$NQN_OURS" 2) || {
        echo "---- target log ----"; tail -n 30 "$W/target.log"; dmesg | grep -i nvme | tail
        result "A/$name" FAIL "no /dev/nvmeXnY"; return 1; }
    ctrl=$(ctrl_dev "$NQN_OURS")
    echo "controller $ctrl: transport=$(cat /sys/class/nvme/${ctrl#/dev/}/transport)" \
         "address=$(cat /sys/class/nvme/${ctrl#/dev/}/address)" \
         "queues=$(io_queues "$ctrl")"
    if dd_verify "$dev1"; then bytes=$((bytes + (8 << 20))); else ok=FAIL; fi
    if fio_verify "$dev2" 3 18 --bsrange=4k-256k --offset_increment=9M --iodepth=16; then
        bytes=$((bytes + (24 << 20)))
        echo "fio: 24 MiB written by 3 jobs with crc32c headers and verified"
    else ok=FAIL; fi
    nvme disconnect -n "$NQN_OURS" || ok=FAIL
    poll eval '! ctrl_dev "$NQN_OURS" > /dev/null' || { echo "controller still present"; ok=FAIL; }
    grep -i "warning\|error\|traceback" "$W/target.log" | tail -n 5
    grep -q Traceback "$W/target.log" && ok=FAIL
    result "A/$name" "$ok" "kernel host, -i 3 $*: $bytes bytes verified, $(since "$t0") s"
}

# ---------------------------------------------------------------------------------------
# B. blockfabric host (-t tcp) -> kernel nvmet-tcp
# ---------------------------------------------------------------------------------------
KPORT=4421
kernel_target_up() { nvmet_up 2 tcp "$KPORT" "$NQN_KERNEL" 1; }
kernel_target_down() { nvmet_down 2 "$NQN_KERNEL"; }

our_host_case() {  # our_host_case NAME [--digests]
    local name=$1 t0 ok=OK out bytes digest=()
    shift
    [ "${1:-}" = --digests ] && digest=(-g -G)
    say "B/$name: blockfabric host (-t tcp ${digest[*]}) -> kernel nvmet-tcp on /dev/ram0"
    t0=$(now)
    local common=(-t tcp "${digest[@]}" -a "$IP" -s "$KPORT" -q "$HOSTNQN")
    timeout 60 "$BIN/blockfabric" discover "${common[@]}" | tee "$W/bdiscover.txt" || ok=FAIL
    grep -q "$NQN_KERNEL" "$W/bdiscover.txt" || { echo "discovery lacks $NQN_KERNEL"; ok=FAIL; }
    timeout 60 "$BIN/blockfabric" identify "${common[@]}" -n "$NQN_KERNEL" > /dev/null || ok=FAIL
    out=$(timeout 120 "$PY" tests/lab/interop_host.py --traddr "$IP" --trsvcid "$KPORT" \
          --nqn "$NQN_KERNEL" --hostnqn "$HOSTNQN" --queues 3 --transport tcp "$@" \
          --check-device /dev/ram0) || ok=FAIL
    echo "$out"
    bytes=$(echo "$out" | sed -n 's/^verified: \([0-9]*\) bytes read back.*/\1/p')
    result "B/$name" "$ok" "our host, library verify: ${bytes:-0} bytes verified, $(since "$t0") s"
}

our_mount_case() {
    local t0 ok=OK
    t0=$(now)
    say "B/mount: blockfabric mount -t tcp of the kernel target, fio verify through $W/mnt/n1"
    mount_fio_verify "$W/mnt" -t tcp -a "$IP" -s "$KPORT" -q "$HOSTNQN" -n "$NQN_KERNEL" || ok=FAIL
    result "B/mount" "$ok" "our host, FUSE + fio verify over NVMe/TCP, $(since "$t0") s"
}

modprobe -a nvme-tcp || { echo "no nvme-tcp module in this kernel"; exit 1; }
if [[ $TCP_PARTS == *A* ]]; then
    start_target || { result A/target FAIL "blockfabric-target did not start"; exit 1; }
    kernel_host_case plain
    kernel_host_case digests --hdr-digest --data-digest
    stop_target || result A/target-exit FAIL "the target did not exit 0 after SIGTERM"
fi
if [[ $TCP_PARTS != *B* ]]; then :
elif kernel_target_up; then
    our_host_case host-library
    our_host_case host-library-digests --digests
    our_mount_case
else
    result B/kernel-target FAIL "nvmet-tcp configfs set-up failed"
fi

summary "tcp summary"
exit $fail

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
PY=${PY:-$PWD/.venv/bin/python}
BIN=$(dirname "$PY")
IP=${LAB_IP:-10.99.0.1}
PORT=4420
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
W=$(mktemp -d /tmp/tcp.XXXXXX)
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000007cb
NQN_OURS=nqn.2026-12.io.blockfabric:tcp
NQN_KERNEL=nqn.2026-12.io.rdma-lab:kernel-tcp-ram0
CFS=/sys/kernel/config/nvmet
TGT_PID=
fail=0
results=()

result() {  # result CASE OK|FAIL TEXT
    local line; line=$(printf 'RESULT %-28s %-4s %s' "$1" "$2" "$3")
    echo "$line"; results+=("$line"); [ "$2" = OK ] || fail=1
    case "$1:$2" in B/*:FAIL) echo "---- dmesg | grep -i nvme ----"; dmesg | grep -i nvme | tail -n 25 ;; esac
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
    mkdir -p "$W/vols"
    cat > "$W/target.yaml" <<YAML
listeners:
  - {transport: tcp, address: $IP, port: $PORT}
subsystems:
  - nqn: $NQN_OURS
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: file, path: $W/vols/file1.img, size: 64MiB, block_size: 512}
      - {nsid: 2, backend: ramdisk, size: 32MiB, block_size: 4096}
control_socket: $W/target.sock
YAML
    "$BIN/blockfabric-target" run -C "$W/target.yaml" -v > "$W/target.log" 2>&1 &
    TGT_PID=$!
    poll grep -q "ready:" "$W/target.log" || { cat "$W/target.log"; return 1; }
    grep "ready:\|listening" "$W/target.log"
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
    if fio --name=verify --filename="$dev2" --direct=1 --ioengine=libaio --rw=randwrite \
           --bs=4k --bsrange=4k-256k --size=8M --numjobs=3 --offset_increment=9M \
           --iodepth=16 --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=18 \
           --output="$W/fio.txt" --group_reporting; then
        bytes=$((bytes + (24 << 20))); grep -E "WRITE:|READ:|err=" "$W/fio.txt"
        echo "fio: 24 MiB written by 3 jobs with crc32c headers and verified"
    else cat "$W/fio.txt"; ok=FAIL; fi
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
kernel_target_up() {
    modprobe -a nvmet nvmet-tcp brd || return 1
    rmmod brd 2>/dev/null; modprobe brd rd_nr=1 rd_size=$((64 * 1024)) || return 1
    mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
    mkdir "$CFS/subsystems/$NQN_KERNEL"
    echo 1 > "$CFS/subsystems/$NQN_KERNEL/attr_allow_any_host"
    mkdir "$CFS/subsystems/$NQN_KERNEL/namespaces/1"
    echo -n /dev/ram0 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/device_path"
    echo 1 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/enable"
    mkdir "$CFS/ports/2"
    echo tcp > "$CFS/ports/2/addr_trtype"; echo ipv4 > "$CFS/ports/2/addr_adrfam"
    echo "$IP" > "$CFS/ports/2/addr_traddr"; echo "$KPORT" > "$CFS/ports/2/addr_trsvcid"
    ln -s "$CFS/subsystems/$NQN_KERNEL" "$CFS/ports/2/subsystems/$NQN_KERNEL"
}
kernel_target_down() {
    [ -d "$CFS/ports/2" ] || return 0
    rm -f "$CFS/ports/2/subsystems/$NQN_KERNEL"; rmdir "$CFS/ports/2"
    echo 0 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/enable"
    rmdir "$CFS/subsystems/$NQN_KERNEL/namespaces/1" "$CFS/subsystems/$NQN_KERNEL"
}

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
    local t0 ok=OK mnt=$W/mnt
    t0=$(now); mkdir -p "$mnt"
    say "B/mount: blockfabric mount -t tcp of the kernel target, fio verify through $mnt/n1"
    if ! "$BIN/blockfabric" mount -t tcp -a "$IP" -s "$KPORT" -q "$HOSTNQN" \
            -n "$NQN_KERNEL" "$mnt"; then
        result "B/mount" FAIL "blockfabric mount -t tcp failed"; return
    fi
    head -n 4 "$mnt/.status"
    if fio --name=fuse-verify --filename="$mnt/n1" --ioengine=psync --rw=randwrite --bs=64k \
           --size=16M --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=11 \
           --verify_state_save=0 --output="$W/fio-fuse.txt"; then
        grep -E "WRITE:|READ:|err=" "$W/fio-fuse.txt"
    else cat "$W/fio-fuse.txt"; ok=FAIL; fi
    if cmp <(dd if="$mnt/n1" bs=1M count=16 status=none) \
           <(dd if=/dev/ram0 bs=1M count=16 iflag=direct status=none); then
        echo "the 16 MiB fio wrote through the mount are on the kernel target's /dev/ram0"
    else echo "mount and /dev/ram0 differ"; ok=FAIL; fi
    "$BIN/blockfabric" umount "$mnt" || ok=FAIL
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

echo; echo "===== summary"
printf '%s\n' "${results[@]}"
exit $fail

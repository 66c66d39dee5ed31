#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/interop.sh, from the project root): blockfabric
# against the Linux kernel's NVMe-oF RDMA stack on rxe0, both ways.
#   A. the kernel host (nvme-cli, nvme-rdma) against blockfabric-target (verbs listener):
#      discover, connect, dd/fio verify, data checked on our backing file, flush, blkdiscard,
#      disconnect; again with -i 2, and a 4 KiB in-capsule write.
#   B. blockfabric's host (verbs provider) against the kernel's nvmet-rdma on a brd ramdisk:
#      discover, identify, connect, a verify workload through the host library (checked on
#      /dev/ram0), and fio verify through the FUSE mount.
# Prints one "RESULT" line per case (what ran, bytes verified); exit status 0 when all passed.
set -u
[ -f tests/lab/interop.sh ] || { echo "interop.sh: run from the project root" >&2; exit 2; }
PY=${PY:-$PWD/.venv/bin/python}
BIN=$(dirname "$PY")
IP=${LAB_IP:-10.99.0.1}
PORT=4420
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
W=$(mktemp -d /tmp/interop.XXXXXX)
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-00000000a11b
NQN_OURS=nqn.2026-12.io.blockfabric:interop
NQN_KERNEL=nqn.2026-12.io.rdma-lab:kernel-ram0
TGT_PID=
fail=0
results=()

say() { echo; echo "===== $*"; }
now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.1f", b-a}'; }
result() {  # result CASE OK|FAIL TEXT
    local line; line=$(printf 'RESULT %-28s %-4s %s' "$1" "$2" "$3")
    echo "$line"; results+=("$line"); [ "$2" = OK ] || fail=1
}
# poll CMD... until it succeeds, at most $POLL_MAX tries 0.1 s apart (never a fixed sleep)
poll() { local i; for ((i = 0; i < ${POLL_MAX:-300}; i++)); do "$@" && return 0; sleep 0.1; done; return 1; }

cleanup() {
    nvme disconnect-all > /dev/null 2>&1
    stop_target
    kernel_target_down > /dev/null 2>&1
    rm -rf "$W"
}
trap cleanup EXIT

trace_on() {
    mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing
    echo > /sys/kernel/tracing/trace
    echo 1 > /sys/kernel/tracing/events/nvme/enable
}
trace_dump() {  # the kernel host's view of what it sent and what came back
    echo "---- kernel nvme trace (last ${1:-60} events) ----"
    grep -v '^#' /sys/kernel/tracing/trace | tail -n "${1:-60}" | sed 's/^ *//'
    echo "---- dmesg (nvme) ----"; dmesg | grep -i nvme | tail -n 20
}

# ---------------------------------------------------------------------------------------
# A. kernel host -> blockfabric-target
# ---------------------------------------------------------------------------------------
start_target() {
    mkdir -p "$W/vols"
    cat > "$W/target.yaml" <<YAML
listeners:
  - {transport: rdma, provider: verbs, address: $IP, port: $PORT}
subsystems:
  - nqn: $NQN_OURS
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: file, path: $W/vols/file1.img, size: 64MiB, block_size: 512}
      - {nsid: 2, backend: ramdisk, size: 32MiB, block_size: 4096}
control_socket: $W/target.sock
YAML
    # the target with a probe that logs each command whose data came in-capsule
    "$PY" tests/lab/interop_target.py run -C "$W/target.yaml" -v > "$W/target.log" 2>&1 &
    TGT_PID=$!
    if ! poll grep -q "ready:" "$W/target.log"; then
        echo "target did not become ready:"; cat "$W/target.log"; return 1
    fi
    grep "ready:\|listening" "$W/target.log"
}
stop_target() {
    [ -n "$TGT_PID" ] || return 0
    kill -TERM "$TGT_PID" 2>/dev/null
    poll eval '! kill -0 $TGT_PID 2>/dev/null' || kill -KILL "$TGT_PID" 2>/dev/null
    wait "$TGT_PID" 2>/dev/null; local rc=$?
    TGT_PID=
    echo "target exited rc=$rc"; tail -n 5 "$W/target.log"
    return $rc
}
ctrl_dev() {  # the /dev/nvmeX of the controller connected to NQN $1
    local c
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && { echo "/dev/${c##*/}"; return 0; }
    done
    return 1
}
ns_dev() {  # ns_dev NQN NSID -> /dev/nvmeXnY once the block device exists
    local c n
    c=$(ctrl_dev "$1") || return 1
    for n in /sys/block/${c#/dev/}n* /sys/block/nvme*c*n*; do
        [ -e "$n/nsid" ] || continue
        [ "$(cat "$n/nsid")" = "$2" ] || continue
        case "$(cat "$n/device/subsysnqn" 2>/dev/null)" in "$1") echo "/dev/${n##*/}"; return 0;; esac
    done
    return 1
}

kernel_host_case() {  # kernel_host_case NAME NR_IO_QUEUES
    local name=$1 nrq=$2 t0 dev1 dev2 bytes=0 ok=OK
    say "A/$name: kernel nvme-rdma host -> blockfabric-target (verbs), nr-io-queues=$nrq"
    t0=$(now)
    nvme discover -t rdma -a "$IP" -s "$PORT" -q "$HOSTNQN" | tee "$W/discover.txt" || ok=FAIL
    grep -q "subnqn: *$NQN_OURS" "$W/discover.txt" || { echo "discovery lacks $NQN_OURS"; ok=FAIL; }
    nvme connect -t rdma -a "$IP" -s "$PORT" -n "$NQN_OURS" -q "$HOSTNQN" -i "$nrq" \
        || { ok=FAIL; trace_dump; }
    POLL_MAX=100 poll ns_dev "$NQN_OURS" 2 > /dev/null || { echo "no block devices"; trace_dump; }
    nvme list
    dev1=$(ns_dev "$NQN_OURS" 1) && dev2=$(ns_dev "$NQN_OURS" 2) || {
        echo "---- target log ----"; tail -n 30 "$W/target.log"
        result "A/$name" FAIL "no /dev/nvmeXnY"; return 1; }
    local ctrl; ctrl=$(ctrl_dev "$NQN_OURS")
    echo "controller $ctrl: transport=$(cat /sys/class/nvme/${ctrl#/dev/}/transport)" \
         "queues=$(ls -d /sys/block/${dev1#/dev/}/mq/* | wc -l) $dev1=$(blockdev --getsize64 "$dev1") B" \
         "$dev2=$(blockdev --getsize64 "$dev2") B"

    # dd: 8 MiB of random data through nsid 1 (file backend), read back, then on our file
    head -c $((8 << 20)) /dev/urandom > "$W/pattern"
    dd if="$W/pattern" of="$dev1" bs=1M oflag=direct status=none || ok=FAIL
    nvme flush "$dev1" || ok=FAIL
    dd if="$dev1" of="$W/readback" bs=1M count=8 iflag=direct status=none || ok=FAIL
    if cmp "$W/pattern" "$W/readback" && cmp -n $((8 << 20)) "$W/pattern" "$W/vols/file1.img"; then
        bytes=$((bytes + (8 << 20))); echo "dd: 8 MiB written, read back, and found on the backing file"
    else echo "dd: DATA MISMATCH"; ok=FAIL; fi

    # fio verify through nsid 2 (ramdisk): several jobs on distinct regions, crc32c
    if fio --name=verify --filename="$dev2" --direct=1 --ioengine=libaio --rw=randwrite \
           --bs=4k --bsrange=4k-128k --size=8M --numjobs=2 --offset_increment=12M \
           --iodepth=8 --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=9 \
           --output="$W/fio.txt" --group_reporting; then
        bytes=$((bytes + (16 << 20))); grep -E "WRITE:|READ:|err=" "$W/fio.txt"
        echo "fio: 16 MiB written with crc32c headers and verified"
    else cat "$W/fio.txt"; ok=FAIL; fi

    # blkdiscard (Dataset Management, deallocate) on the first MiB of each namespace:
    # reads zeroes afterwards, on the host and (nsid 1) on our backing file
    if blkdiscard -o 0 -l $((1 << 20)) "$dev1" && blkdiscard -o 0 -l $((1 << 20)) "$dev2" \
       && cmp -n $((1 << 20)) /dev/zero "$dev1" && cmp -n $((1 << 20)) /dev/zero "$dev2" \
       && cmp -n $((1 << 20)) /dev/zero "$W/vols/file1.img"; then
        echo "blkdiscard: first MiB of each namespace deallocated, reads zeroes (and on the file)"
    else echo "blkdiscard: FAILED"; ok=FAIL; trace_dump 30; tail -n 20 "$W/target.log"; fi

    if [ "$name" = incapsule ]; then incapsule_write "$dev1" || ok=FAIL; bytes=$((bytes + 4096)); fi

    nvme disconnect -n "$NQN_OURS" || ok=FAIL
    poll eval '! ctrl_dev "$NQN_OURS" > /dev/null' || { echo "controller still present"; ok=FAIL; }
    grep -i "error\|traceback" "$W/target.log" | tail -n 5
    result "A/$name" "$ok" "kernel host, -i $nrq: $bytes bytes verified, $(since "$t0") s"
}

incapsule_write() {  # one 4 KiB direct write at byte 1 MiB of nsid 1: in-capsule data
    local dev=$1 before after
    head -c 4096 /dev/urandom > "$W/page"
    before=$(grep -c "probe: .*opcode 0x01: 4096 bytes of in-capsule" "$W/target.log")
    dd if="$W/page" of="$dev" bs=4k seek=256 count=1 oflag=direct status=none || return 1
    after=$(grep -c "probe: .*opcode 0x01: 4096 bytes of in-capsule" "$W/target.log")
    grep "probe: .*opcode 0x01: 4096 bytes" "$W/target.log" | tail -n 1
    [ "$after" -gt "$before" ] || { echo "the 4 KiB write did not arrive in-capsule"; return 1; }
    cmp -i $((256 * 4096)):0 -n 4096 "$W/vols/file1.img" "$W/page" || return 1
    echo "in-capsule 4 KiB write: arrived in the capsule, and is on the backing file"
}

# ---------------------------------------------------------------------------------------
# B. blockfabric host -> kernel nvmet-rdma
# ---------------------------------------------------------------------------------------
CFS=/sys/kernel/config/nvmet
kernel_target_up() {
    modprobe -a nvmet nvmet-rdma brd || return 1
    rmmod brd 2>/dev/null; modprobe brd rd_nr=1 rd_size=$((64 * 1024)) || return 1
    mkdir "$CFS/subsystems/$NQN_KERNEL"
    echo 1 > "$CFS/subsystems/$NQN_KERNEL/attr_allow_any_host"
    mkdir "$CFS/subsystems/$NQN_KERNEL/namespaces/1"
    echo -n /dev/ram0 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/device_path"
    echo 1 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/enable"
    mkdir "$CFS/ports/1"
    echo rdma > "$CFS/ports/1/addr_trtype"; echo ipv4 > "$CFS/ports/1/addr_adrfam"
    echo "$IP" > "$CFS/ports/1/addr_traddr"; echo "$PORT" > "$CFS/ports/1/addr_trsvcid"
    ln -s "$CFS/subsystems/$NQN_KERNEL" "$CFS/ports/1/subsystems/$NQN_KERNEL"
}
kernel_target_down() {
    [ -d "$CFS/ports/1" ] || return 0
    rm -f "$CFS/ports/1/subsystems/$NQN_KERNEL"; rmdir "$CFS/ports/1"
    echo 0 > "$CFS/subsystems/$NQN_KERNEL/namespaces/1/enable"
    rmdir "$CFS/subsystems/$NQN_KERNEL/namespaces/1" "$CFS/subsystems/$NQN_KERNEL"
}

our_host_case() {
    local t0 ok=OK bytes=0 out
    say "B: blockfabric host (verbs) -> kernel nvmet-rdma on /dev/ram0"
    t0=$(now)
    kernel_target_up || { result B/kernel-target FAIL "nvmet configfs set-up failed"; return; }
    local common=(-a "$IP" -s "$PORT" -q "$HOSTNQN" --provider verbs)
    "$BIN/blockfabric" discover "${common[@]}" | tee "$W/bdiscover.txt" || ok=FAIL
    grep -q "$NQN_KERNEL" "$W/bdiscover.txt" || { echo "discovery lacks $NQN_KERNEL"; ok=FAIL; }
    "$BIN/blockfabric" identify "${common[@]}" -n "$NQN_KERNEL" || ok=FAIL
    "$BIN/blockfabric" connect "${common[@]}" -n "$NQN_KERNEL" -i 2 || ok=FAIL
    out=$("$PY" tests/lab/interop_host.py --traddr "$IP" --nqn "$NQN_KERNEL" --hostnqn "$HOSTNQN" \
          --check-device /dev/ram0) || ok=FAIL
    echo "$out"
    bytes=$(echo "$out" | sed -n 's/^verified: \([0-9]*\) bytes read back.*/\1/p')
    result "B/host-library" "$ok" "our host, library verify: ${bytes:-0} bytes verified, $(since "$t0") s"
    our_mount_case
}

our_mount_case() {  # fio verify through the FUSE file of a blockfabric mount
    local t0 ok=OK mnt=$W/mnt
    t0=$(now); mkdir -p "$mnt"
    say "B/mount: blockfabric mount (verbs) of the kernel target, fio verify through $mnt/n1"
    if ! "$BIN/blockfabric" mount -a "$IP" -s "$PORT" -q "$HOSTNQN" --provider verbs \
            -n "$NQN_KERNEL" "$mnt"; then
        result "B/mount" FAIL "blockfabric mount failed"; return
    fi
    ls -l "$mnt"; head -n 20 "$mnt/.status"
    if fio --name=fuse-verify --filename="$mnt/n1" --ioengine=psync --rw=randwrite --bs=64k \
           --size=16M --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=11 \
           --verify_state_save=0 --output="$W/fio-fuse.txt"; then
        grep -E "WRITE:|READ:|err=" "$W/fio-fuse.txt"
    else cat "$W/fio-fuse.txt"; ok=FAIL; fi
    # what fio wrote is on the kernel target's ramdisk, byte for byte
    # (O_DIRECT: the page cache of /dev/ram0 does not see what nvmet wrote)
    if cmp <(dd if="$mnt/n1" bs=1M count=16 status=none) \
           <(dd if=/dev/ram0 bs=1M count=16 iflag=direct status=none); then
        echo "the 16 MiB fio wrote through the mount are on the kernel target's /dev/ram0"
    else echo "mount and /dev/ram0 differ"; ok=FAIL; fi
    "$BIN/blockfabric" umount "$mnt" || ok=FAIL
    result "B/mount" "$ok" "our host, FUSE + fio verify: $([ $ok = OK ] && echo $((16 << 20)) || echo 0) bytes verified, $(since "$t0") s"
}

modprobe -a nvme-rdma > /dev/null 2>&1 || { echo "cannot load nvme-rdma"; exit 1; }
trace_on
echo "##### interop: $(uname -r), $(rdma link show 2>/dev/null | head -1)"
if start_target; then
    kernel_host_case single 1 && kernel_host_case multiqueue 2 && kernel_host_case incapsule 2
    stop_target || fail=1
else
    result A/target FAIL "blockfabric-target did not start"
fi
our_host_case
echo; echo "##### interop summary"
printf '%s\n' "${results[@]}"
exit $fail

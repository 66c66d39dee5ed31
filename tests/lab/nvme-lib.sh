# Shell helpers the lab's scripts share (tests/lab/interop.sh, tcp.sh, resv.sh, pollgroups.sh,
# gateways.sh, systemd.sh), sourced from the project root inside the guest.  The target
# helpers use the caller's W (its scratch directory), BIN (where blockfabric-target is) and
# TGT_PID; result() adds to the caller's results and fail, which sourcing this starts empty.
# Sourcing it also sets what they all use: PY (the checkout's venv unless the caller set it),
# BIN (its bin/), IP (the lab's address, rxe0's netdev) and W, a new scratch directory named
# after the script.
fail=0
results=()
PY=${PY:-$PWD/.venv/bin/python}
BIN=$(dirname "$PY")
IP=${LAB_IP:-10.99.0.1}
export PYTHONDONTWRITEBYTECODE=1   # the root fs is read-only under a tmpfs overlay
W=$(mktemp -d "/tmp/$(basename "$0" .sh).XXXXXX")
say() { echo; echo "===== $*"; }
now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.1f", b-a}'; }
# poll CMD... until it succeeds, at most $POLL_MAX tries 0.1 s apart (never a fixed sleep)
poll() { local i; for ((i = 0; i < ${POLL_MAX:-300}; i++)); do "$@" && return 0; sleep 0.1; done; return 1; }
# wait_for SECONDS CMD...: until CMD succeeds, 0.1 s apart, at most SECONDS (a deadline, not
# a count: each try costs far more than 0.1 s in a TCG guest on a loaded machine)
wait_for() {
    local end=$((${EPOCHREALTIME//[.,]/} + $1 * 1000000)); shift     # in microseconds
    until "$@"; do [ "${EPOCHREALTIME//[.,]/}" -lt "$end" ] || return 1; sleep 0.1; done
}
# result CASE OK|FAIL|SKIP TEXT...: one "RESULT" line (TEXT's words joined by spaces), kept
# for summary; anything but OK or SKIP (cannot run here, e.g. on this kernel) fails the run.
# $RESULT_WIDTH pads CASE (default 28).  A caller's result_failed CASE, if it defines one,
# runs after a FAIL line (to print what explains it).
result() {
    local name=$1 status=$2 line; shift 2
    line=$(printf "RESULT %-${RESULT_WIDTH:-28}s %-4s %s" "$name" "$status" "$*")
    echo "$line"; results+=("$line")
    case $status in OK|SKIP) return 0;; esac
    fail=1
    if declare -F result_failed > /dev/null; then result_failed "$name"; fi
    return 0
}
# fio_verify DEV JOBS SEED [FIO-ARGS...]: JOBS fio jobs of 8 MiB crc32c-verified random writes
# (4 KiB to 128 KiB, QD 8, 12 MiB apart; FIO-ARGS come last and override) through DEV,
# O_DIRECT; output in $W/fio.txt, its totals printed (all of it on failure).  Status 0 when
# fio wrote and verified all of it.
fio_verify() {
    local dev=$1 jobs=$2 seed=$3; shift 3
    if fio --name=verify --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite \
           --bs=4k --bsrange=4k-128k --size=8M --numjobs="$jobs" --offset_increment=12M \
           --iodepth=8 --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed="$seed" \
           --output="$W/fio.txt" --group_reporting "$@"; then
        grep -E "WRITE:|READ:|err=" "$W/fio.txt"; return 0
    fi
    cat "$W/fio.txt"; return 1
}
# the kernel's NVMe target (nvmet) through configfs, for our hosts to connect to
CFS=/sys/kernel/config/nvmet
# nvmet_up PORTID TRTYPE TRSVCID NQN RAMDISKS: RAMDISKS brd ramdisks of 64 MiB; /dev/ram0 is
# nsid 1 of NQN (any host), on nvmet port PORTID, $IP:TRSVCID over TRTYPE (rdma or tcp)
nvmet_up() {
    local port=$CFS/ports/$1 sub=$CFS/subsystems/$4
    modprobe -a nvmet "nvmet-$2" brd || return 1
    rmmod brd 2>/dev/null; modprobe brd rd_nr="$5" rd_size=$((64 * 1024)) || return 1
    mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
    mkdir "$sub"
    echo 1 > "$sub/attr_allow_any_host"
    mkdir "$sub/namespaces/1"
    echo -n /dev/ram0 > "$sub/namespaces/1/device_path"
    echo 1 > "$sub/namespaces/1/enable"
    mkdir "$port"
    echo "$2" > "$port/addr_trtype"; echo ipv4 > "$port/addr_adrfam"
    echo "$IP" > "$port/addr_traddr"; echo "$3" > "$port/addr_trsvcid"
    ln -s "$sub" "$port/subsystems/$4"
}
nvmet_down() {  # nvmet_down PORTID NQN: undo nvmet_up
    local port=$CFS/ports/$1 sub=$CFS/subsystems/$2
    [ -d "$port" ] || return 0
    rm -f "$port/subsystems/$2"; rmdir "$port"
    echo 0 > "$sub/namespaces/1/enable"
    rmdir "$sub/namespaces/1" "$sub"
}
# mount_fio_verify MNT MOUNT-ARGS...: blockfabric mount MOUNT-ARGS MNT of a kernel target's
# /dev/ram0 (nvmet_up), 16 MiB of fio crc32c-verified writes through MNT/n1, found byte for
# byte on /dev/ram0, umount.  Status 0 when all of it held.
mount_fio_verify() {
    local mnt=$1 rc=0; shift
    mkdir -p "$mnt"
    "$BIN/blockfabric" mount "$@" "$mnt" || { echo "blockfabric mount $* failed"; return 1; }
    ls -l "$mnt"; head -n 20 "$mnt/.status"
    if fio --name=fuse-verify --filename="$mnt/n1" --ioengine=psync --rw=randwrite --bs=64k \
           --size=16M --verify=crc32c --verify_fatal=1 --do_verify=1 --randseed=11 \
           --verify_state_save=0 --output="$W/fio-fuse.txt"; then
        grep -E "WRITE:|READ:|err=" "$W/fio-fuse.txt"
    else cat "$W/fio-fuse.txt"; rc=1; fi
    # (O_DIRECT: the page cache of /dev/ram0 does not see what nvmet wrote)
    if cmp <(dd if="$mnt/n1" bs=1M count=16 status=none) \
           <(dd if=/dev/ram0 bs=1M count=16 iflag=direct status=none); then
        echo "the 16 MiB fio wrote through the mount are on the kernel target's /dev/ram0"
    else echo "mount and /dev/ram0 differ"; rc=1; fi
    "$BIN/blockfabric" umount "$mnt" || rc=1
    return $rc
}
summary() { echo; echo "##### $*"; printf '%s\n' "${results[@]}"; }  # summary TITLE
# target_yaml NQN LISTENER [MORE]: the lab's usual target configuration on stdout: the one
# listener (a flow mapping), subsystem NQN open to any host with nsid 1, a 64 MiB file volume
# $W/vols/file1.img of 512 B blocks (dd_verify checks it), and nsid 2, a 32 MiB ramdisk of
# 4 KiB blocks; then MORE (further subsystems' YAML) and the control socket $W/target.sock
target_yaml() {
    cat <<YAML
listeners:
  - $2
subsystems:
  - nqn: $1
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: file, path: $W/vols/file1.img, size: 64MiB, block_size: 512}
      - {nsid: 2, backend: ramdisk, size: 32MiB, block_size: 4096}
${3:-}
control_socket: $W/target.sock
YAML
}
# launch_target CONFIG [PROGRAM...]: PROGRAM (default $BIN/blockfabric-target) run -C CONFIG
# -v in the background, its output added to $W/target.log, TGT_PID its pid; waits until this
# start logs "ready:" (a restart appends to the log), prints its ready and listening lines.
# Status 1, this start's log printed, when it exits or does not get ready in time.
launch_target() {
    local conf=$1 from; shift
    [ $# -gt 0 ] || set -- "$BIN/blockfabric-target"
    mkdir -p "$W/vols"
    from=$(($(stat -c %s "$W/target.log" 2> /dev/null || echo 0) + 1))   # this start's lines
    "$@" run -C "$conf" -v >> "$W/target.log" 2>&1 &
    TGT_PID=$!
    if ! poll eval 'target_ready || ! kill -0 "$TGT_PID" 2> /dev/null' || ! target_ready; then
        echo "target did not become ready:"; tail -c "+$from" "$W/target.log"
        stop_target > /dev/null; return 1
    fi
    tail -c "+$from" "$W/target.log" | grep "ready:\|listening"
}
target_ready() { tail -c "+$from" "$W/target.log" | grep -q "ready:"; }  # (launch_target's from)
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
    for n in /sys/block/${c#/dev/}n* /sys/block/nvme*n*; do
        [ -e "$n/nsid" ] || continue
        [ "$(cat "$n/nsid")" = "$2" ] || continue
        [ -b "/dev/${n##*/}" ] || continue     # a multipath head's paths (nvmeXcYnZ) have none
        case "$(cat "$n/device/subsysnqn" 2>/dev/null)" in "$1") echo "/dev/${n##*/}"; return 0;; esac
    done
    return 1
}
# io_queues /dev/nvmeX: the controller's I/O queues (its queue_count less the admin queue).
# Not the mq/ of its /dev/nvmeXnY: under native multipathing (the target says CMIC bit 1, as
# nvmet does) that disk is the bio-based head, which has none.
io_queues() { echo $(( $(cat "/sys/class/nvme/${1#/dev/}/queue_count") - 1 )); }
# dd_verify DEV: 8 MiB of random data through DEV (direct), flushed, read back, and found at
# the start of the caller's backing file $W/vols/file1.img; status 0 only when all of it matched
dd_verify() {
    head -c $((8 << 20)) /dev/urandom > "$W/pattern"
    dd if="$W/pattern" of="$1" bs=1M oflag=direct status=none || return 1
    nvme flush "$1" || return 1
    dd if="$1" of="$W/readback" bs=1M count=8 iflag=direct status=none || return 1
    if cmp "$W/pattern" "$W/readback" && cmp -n $((8 << 20)) "$W/pattern" "$W/vols/file1.img"; then
        echo "dd: 8 MiB written, read back, and found on the backing file"; return 0
    fi
    echo "dd: DATA MISMATCH"; return 1
}

# Shell helpers the lab's NVMe interop scripts share (tests/lab/interop.sh, tests/lab/tcp.sh),
# sourced from the project root inside the guest.  stop_target uses the caller's TGT_PID and W.
say() { echo; echo "===== $*"; }
now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.1f", b-a}'; }
# poll CMD... until it succeeds, at most $POLL_MAX tries 0.1 s apart (never a fixed sleep)
poll() { local i; for ((i = 0; i < ${POLL_MAX:-300}; i++)); do "$@" && return 0; sleep 0.1; done; return 1; }
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

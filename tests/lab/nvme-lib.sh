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
    for n in /sys/block/${c#/dev/}n* /sys/block/nvme*c*n*; do
        [ -e "$n/nsid" ] || continue
        [ "$(cat "$n/nsid")" = "$2" ] || continue
        case "$(cat "$n/device/subsysnqn" 2>/dev/null)" in "$1") echo "/dev/${n##*/}"; return 0;; esac
    done
    return 1
}

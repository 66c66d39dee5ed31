#!/bin/bash
# Runs INSIDE the lab guest (make lab-resv; or LAB_HOME=/var/lib/rdma-lab-612 lab/run
# tests/lab/resv.sh from the project root, after LAB_HOME=/var/lib/rdma-lab-612
# LAB_KPKG=linux-image-6.12-amd64 lab/setup): the Linux kernel's NVMe host, through
# nvme-cli's resv-* commands on each host's /dev/nvmeXnY, against blockfabric-target's
# reservations (issue 17; docs/reservations.md says what must happen, and every case
# below asserts it).
#
# Three host identities (host NQN + host ID) share namespace 1 of one subsystem:
#   host 1 (key 0xa) takes the reservations, host 2 (key 0xb) is the other registrant,
#   host 3 never registers.
# One kernel plays the three hosts, so two things that separate machines would not need:
#   - each host connects to its own listener of our target (ports 4420, 4421, 4422):
#     nvme-cli 2.3 answers "already connected" to a second `nvme connect` to the same
#     subsystem, transport, address and port, whatever its --hostnqn (libnvme matches
#     those four only; --duplicate-connect does not get past that check);
#   - nvme_core is loaded with multipath=N, so that each controller has its own
#     /dev/nvmeXnY.  With multipathing the three controllers would share one head
#     /dev/nvmeXnY that picks a path itself, and a command would go out as whichever
#     host that path belongs to.  The script checks that every disk's controller is the
#     host it is used for.
# Cases (one RESULT line each; exit status 0 when all passed):
#   resv/register   hosts 1 and 2 register; resv-report -o json through all three hosts
#                   shows gen 2, no reservation, both registrants with their host IDs/keys
#   resv/type-1..6  host 1 acquires each of the six types; the report shows the type and
#                   the holder(s) (every registrant under 5 and 6); 4 KiB O_DIRECT reads
#                   and writes of the three hosts succeed or fail with EBADE (the block
#                   layer's errno for Reservation Conflict) exactly as the type table of
#                   docs/reservations.md says; host 2's Acquire conflicts (succeeds under
#                   5 and 6, where it is a holder); host 1 releases and the report is empty
#   resv/conflict   NVMe status through nvme-cli: host 2's write under Write Exclusive is
#                   RESERVATION_CONFLICT, its read succeeds; host 3's Acquire, host 1's
#                   Release with the wrong type conflict; host 2's Release (not the holder)
#                   succeeds without effect
#   resv/notify     host 2's notification log (resv-notif-log) holds "reservation released"
#                   from the releases of types 3-6
#   resv/preempt    host 2 preempts and aborts host 1 (Exclusive Access): host 1's reads
#                   and writes conflict, gen goes up, host 1's log says "registration
#                   preempted"
#   resv/ptpl       CPTPL 3 on the file volume: the state survives a SIGKILL and restart of
#                   the target (the kernel reconnects its three controllers)
#   resv/clear      host 1 registers again, host 2 clears: no registrants, no reservation,
#                   every host writes, host 1's log says "reservation preempted"
# RESV_TRANSPORT=tcp runs it over NVMe/TCP (the kernel's nvme-tcp; no RDMA device needed).
set -u
[ -f tests/lab/resv.sh ] || { echo "resv.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
T=${RESV_TRANSPORT:-rdma}           # rdma (verbs on rxe0) or tcp (the kernel's nvme-tcp)
NQN=nqn.2026-12.io.blockfabric:resv
HOSTS=(1 2 3)
HNQN=() HID=() PORT=() DEV=()
for h in "${HOSTS[@]}"; do
    HID[$h]=5e1f0000-0000-4000-8000-0000000e000$h
    HNQN[$h]=nqn.2014-08.org.nvmexpress:uuid:${HID[$h]}
    PORT[$h]=$((4419 + h))
done
KEY=([1]=0xa [2]=0xb)
TGT_PID=
RESULT_WIDTH=14
# check WHAT CMD...: run CMD; on failure say what was expected and mark the case failed
check() { local what=$1; shift; "$@" && return 0; echo "FAILED: $what"; ok=FAIL; return 1; }

cleanup() {
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    stop_target
    rm -rf "$W"
}
trap cleanup EXIT

start_target() {  # each start adds to $W/target.log (resv/ptpl restarts it)
    local h
    {
        echo "listeners:"
        for h in "${HOSTS[@]}"; do
            if [ "$T" = tcp ]; then echo "  - {transport: tcp, address: $IP, port: ${PORT[$h]}}"
            else echo "  - {transport: rdma, provider: verbs, address: $IP, port: ${PORT[$h]}}"; fi
        done
        cat <<YAML
subsystems:
  - nqn: $NQN
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: file, path: $W/vols/shared.img, size: 64MiB, block_size: 4096}
YAML
    } > "$W/target.yaml"
    launch_target "$W/target.yaml"
}
disk_of() {  # disk_of N -> /dev/nvmeXnY of namespace 1 whose controller is host N's
    local b
    for b in /sys/block/nvme*n*; do
        [ "$(cat "$b/device/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
        [ "$(cat "$b/device/hostnqn" 2>/dev/null)" = "${HNQN[$1]}" ] || continue
        [ "$(cat "$b/nsid" 2>/dev/null)" = 1 ] || continue
        [ -b "/dev/${b##*/}" ] && { echo "/dev/${b##*/}"; return 0; }
    done
    return 1
}
# io N read|write -> ok | conflict | other(...): one 4 KiB O_DIRECT read or write at 1 MiB
# through host N's disk.  The block layer turns Reservation Conflict (and nothing else) into
# EBADE, "Invalid exchange".
io() {
    local out rc
    if [ "$2" = write ]; then
        out=$(dd if="$W/page" of="${DEV[$1]}" bs=4096 count=1 seek=256 oflag=direct \
              conv=notrunc status=none 2>&1); rc=$?
    else
        out=$(dd if="${DEV[$1]}" of=/dev/null bs=4096 count=1 skip=256 iflag=direct \
              status=none 2>&1); rc=$?
    fi
    if [ $rc = 0 ]; then echo ok
    elif [[ $out == *"Invalid exchange"* ]]; then echo conflict
    else echo "other(rc=$rc: $out)"; fi
}
# expect_io "H1R H1W H2R H2W H3R H3W" (ok|conflict each): every host's read and write
expect_io() {
    local want=($1) got=() h op
    for h in "${HOSTS[@]}"; do for op in read write; do got+=("$(io "$h" $op)"); done; done
    echo "io (host1 r/w, host2 r/w, host3 r/w): ${got[*]}"
    [ "${got[*]}" = "${want[*]}" ] || { echo "FAILED: io, wanted ${want[*]}"; ok=FAIL; }
}
# expect_report N GEN RTYPE PTPLS [HOST:RCSTS ...]: nvme resv-report --eds -o json through
# host N's disk shows that generation, type, PTPL state and exactly those registrants (host
# ID as the Connect sent it, its key, holder bit; cntlid 0xffff as nvmet)
expect_report() {
    local n=$1 gen=$2 rtype=$3 ptpls=$4 js want=() e; shift 4
    for e in "$@"; do want+=("${HID[${e%%:*}]}:${KEY[${e%%:*}]}:${e##*:}"); done
    js=$(nvme resv-report "${DEV[$n]}" --eds -o json) || { echo "FAILED: resv-report"; ok=FAIL; return 1; }
    echo "$js" > "$W/report.json"
    "$PY" - "$W/report.json" "$gen" "$rtype" "$ptpls" "${want[@]}" <<'PY' || ok=FAIL
import json, sys
d = json.load(open(sys.argv[1]))
gen, rtype, ptpls = (int(x) for x in sys.argv[2:5])
want = sorted((h.replace("-", ""), int(k, 0), int(r))
              for h, k, r in (w.split(":") for w in sys.argv[5:]))
regs = d.get("regctlext", [])
got = sorted((e["hostid"], e["rkey"], e["rcsts"]) for e in regs)
ok = (d.get("gen"), d.get("rtype"), d.get("regctl"), d.get("ptpls")) == \
    (gen, rtype, len(want), ptpls) and got == want and all(e["cntlid"] == 0xFFFF for e in regs)
print(f"report: gen {d.get('gen')} rtype {d.get('rtype')} regctl {d.get('regctl')} "
      f"ptpls {d.get('ptpls')} (hostid, rkey, rcsts): {got}"
      + ("" if ok else f"\nFAILED: report, wanted gen {gen} rtype {rtype} ptpls {ptpls} {want}"))
sys.exit(0 if ok else 1)
PY
}
# status N CMD ARGS...: run nvme CMD on host N's disk -> ok, conflict (NVMe status
# Reservation Conflict, as nvme-cli prints it), or other(...)
status() {
    local n=$1 cmd=$2 out rc; shift 2
    out=$(nvme "$cmd" "${DEV[$n]}" "$@" 2>&1 > /dev/null); rc=$?
    [ -n "$out" ] && echo "  nvme-cli: $out" >&2
    if [ $rc = 0 ]; then echo ok
    elif [[ ${out,,} == *"reservation conflict"* || ${out,,} == *"reservation_conflict"* ]]; then
        echo conflict
    else echo "other(rc=$rc: $out)"; fi
}
expect_status() {  # expect_status WANT N CMD ARGS...
    local want=$1 got; shift
    got=$(status "$@")
    echo "host $1: nvme $2 ${*:3}: $got"
    [ "$got" = "$want" ] || { echo "FAILED: wanted $want"; ok=FAIL; }
}
notif_type() {  # notif_type N -> the type of the next entry of host N's notification log
    nvme resv-notif-log "${DEV[$1]}" -o json > "$W/log.json" || return 1
    cat "$W/log.json" >&2
    "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["rn_log_type"])' "$W/log.json"
}
expect_notif() {  # expect_notif N TYPE WHAT: host N's next notification is of that type
    local got
    got=$(notif_type "$1")
    echo "host $1's next notification: type $got"
    [ "$got" = "$2" ] || { echo "FAILED: wanted $2 ($3)"; ok=FAIL; }
}

say "setup: blockfabric-target on $IP ($T), ports ${PORT[*]}, three kernel host identities"
nvme version
# One /dev/nvmeXnY per controller (see the header): nvme_core without multipathing
modprobe -r -q nvme_rdma nvme_tcp nvme_fabrics nvme nvme_core 2>/dev/null
modprobe nvme_core multipath=N && modprobe "nvme-$T" \
    || { echo "cannot load nvme_core/nvme-$T"; exit 1; }
mp=$(cat /sys/module/nvme_core/parameters/multipath)
[ "$mp" = N ] || { echo "nvme_core multipath=$mp: cannot tell the hosts' paths apart"; exit 1; }
start_target || exit 1
head -c 4096 /dev/urandom > "$W/page"
for h in "${HOSTS[@]}"; do
    # --reconnect-delay 2: resv/ptpl restarts the target, and the kernel's default waits 10 s
    nvme connect -t "$T" -a "$IP" -s "${PORT[$h]}" -n "$NQN" -q "${HNQN[$h]}" -I "${HID[$h]}" \
        --reconnect-delay=2 || { echo "nvme connect as host $h failed"; exit 1; }
done
for h in "${HOSTS[@]}"; do
    POLL_MAX=900 poll disk_of "$h" > /dev/null || {
        echo "no disk for host $h; block devices: $(ls /sys/block)"
        for c in /sys/class/nvme/nvme*; do echo "${c##*/}: $(cat "$c/state") $(cat "$c/hostnqn")"; done
        dmesg | grep nvme | tail -n 20; exit 1; }
    DEV[$h]=$(disk_of "$h")
    c=$(readlink -f "/sys/block/${DEV[$h]#/dev/}/device"); c=${c##*/}
    echo "host $h: ${DEV[$h]} on controller $c (cntlid $(cat /sys/class/nvme/$c/cntlid)," \
         "port $(cat /sys/class/nvme/$c/address)), hostnqn $(cat /sys/class/nvme/$c/hostnqn)"
done
[ "$(printf '%s\n' "${DEV[@]}" | sort -u | wc -l)" = 3 ] || { echo "the hosts share a disk"; exit 1; }
nvme id-ctrl "${DEV[1]}" | grep -E "^(oncs|ctratt) "
nvme id-ns "${DEV[1]}" | grep -E "^(rescap|nmic) "

say "resv/register"
ok=OK
expect_io "ok ok ok ok ok ok"
check "host 1 registers" nvme resv-register "${DEV[1]}" --nrkey=${KEY[1]} --rrega=0
check "host 2 registers" nvme resv-register "${DEV[2]}" --nrkey=${KEY[2]} --rrega=0
for h in "${HOSTS[@]}"; do expect_report "$h" 2 0 0 1:0 2:0; done
result resv/register $ok "two registrants (host IDs, keys), gen 2, the same report through the three hosts"

# the type table of docs/reservations.md: holder host 1, registrant host 2, host 3 not registered
IO_OF=([1]="ok ok ok conflict ok conflict"
       [2]="ok ok conflict conflict conflict conflict"
       [3]="ok ok ok ok ok conflict"
       [4]="ok ok ok ok conflict conflict"
       [5]="ok ok ok ok ok conflict"
       [6]="ok ok ok ok conflict conflict")
NAMES=([1]="Write Exclusive" [2]="Exclusive Access" [3]="Write Exclusive, Registrants Only"
       [4]="Exclusive Access, Registrants Only" [5]="Write Exclusive, All Registrants"
       [6]="Exclusive Access, All Registrants")
for t in 1 2 3 4 5 6; do
    say "resv/type-$t: ${NAMES[$t]}"
    ok=OK
    check "host 1 acquires type $t" nvme resv-acquire "${DEV[1]}" --crkey=${KEY[1]} --rtype=$t --racqa=0
    if [ $t -ge 5 ]; then holders="1:1 2:1"; h2acq=ok; else holders="1:1 2:0"; h2acq=conflict; fi
    expect_report 2 2 $t 0 $holders
    expect_report 3 2 $t 0 $holders
    expect_io "${IO_OF[$t]}"
    # another registrant's Acquire of the same type: a conflict, except where it is a holder
    expect_status $h2acq 2 resv-acquire --crkey=${KEY[2]} --rtype=$t --racqa=0
    check "host 1 releases type $t" nvme resv-release "${DEV[1]}" --crkey=${KEY[1]} --rtype=$t --rrela=0
    expect_report 1 2 0 0 1:0 2:0
    expect_io "ok ok ok ok ok ok"
    result resv/type-$t $ok "${NAMES[$t]}: report, I/O of holder, registrant, non-registrant, acquire, release"
done

say "resv/conflict: the NVMe status through nvme-cli, Write Exclusive held by host 1"
ok=OK
check "host 1 acquires Write Exclusive" nvme resv-acquire "${DEV[1]}" --crkey=${KEY[1]} --rtype=1 --racqa=0
expect_status conflict 2 io-passthru --opcode=0x01 --namespace-id=1 --data-len=4096 \
    --cdw10=256 --cdw12=0 --write --input-file="$W/page"
expect_status ok 2 io-passthru --opcode=0x02 --namespace-id=1 --data-len=4096 \
    --cdw10=256 --cdw12=0 --read
expect_status ok 1 io-passthru --opcode=0x01 --namespace-id=1 --data-len=4096 \
    --cdw10=256 --cdw12=0 --write --input-file="$W/page"
expect_status conflict 3 resv-acquire --crkey=0 --rtype=1 --racqa=0    # not registered
expect_status conflict 2 resv-register --crkey=0xdead --rrega=1        # wrong key
expect_status conflict 1 resv-release --crkey=${KEY[1]} --rtype=2 --rrela=0  # wrong type
expect_status ok 2 resv-release --crkey=${KEY[2]} --rtype=1 --rrela=0  # not the holder
expect_report 2 2 1 0 1:1 2:0
result resv/conflict $ok "host 2's write is RESERVATION_CONFLICT, its read succeeds; acquire, register, release conflicts"

say "resv/notify"
ok=OK
expect_notif 2 2 "reservation released"
result resv/notify $ok "host 2's notification log: reservation released (types 3-6 released by host 1)"

say "resv/preempt: host 2 preempts and aborts host 1"
ok=OK
check "host 2 preempts and aborts" nvme resv-acquire "${DEV[2]}" --crkey=${KEY[2]} \
    --prkey=${KEY[1]} --rtype=2 --racqa=2
expect_report 1 3 2 0 2:1
expect_io "conflict conflict ok ok conflict conflict"
expect_status conflict 1 resv-acquire --crkey=${KEY[1]} --rtype=2 --racqa=0  # no longer registered
expect_notif 1 1 "registration preempted"
result resv/preempt $ok "preempt and abort fences host 1 (reads and writes), gen 3, its log says preempted"

say "resv/ptpl: persist through a SIGKILL and restart of the target"
ok=OK
check "host 2 sets PTPL" nvme resv-register "${DEV[2]}" --nrkey=${KEY[2]} --rrega=0 --cptpl=3
expect_report 2 4 2 1 2:1
t0=$(now)
kill -KILL "$TGT_PID"; wait "$TGT_PID" 2>/dev/null; TGT_PID=
start_target || ok=FAIL
live() { local h c; for h in "${HOSTS[@]}"; do
    c=$(readlink -f "/sys/block/${DEV[$h]#/dev/}/device"); [ "$(cat "$c/state")" = live ] || return 1
done; }
POLL_MAX=900 poll live || { echo "FAILED: the controllers did not reconnect"; ok=FAIL; }
echo "the three controllers live again after $(since "$t0") s"
for h in "${HOSTS[@]}"; do expect_report "$h" 4 2 1 2:1; done
expect_io "conflict conflict ok ok conflict conflict"
result resv/ptpl $ok "the reservation and registrations survive SIGKILL and restart of the target"

say "resv/clear"
ok=OK
check "host 1 registers again" nvme resv-register "${DEV[1]}" --nrkey=${KEY[1]} --rrega=0
expect_report 3 5 2 1 1:0 2:1
expect_io "conflict conflict ok ok conflict conflict"
check "host 2 clears" nvme resv-release "${DEV[2]}" --crkey=${KEY[2]} --rrela=1
for h in "${HOSTS[@]}"; do expect_report "$h" 6 0 1; done
expect_io "ok ok ok ok ok ok"
expect_notif 1 3 "reservation preempted"
result resv/clear $ok "clear: no registrants, no reservation, gen 6, every host writes, host 1 told"

echo; echo "---- the kernel's log of it (nvme lines of dmesg) ----"
dmesg | grep -E "new ctrl|shared namespace|error recovery|reconnected"
echo "$(dmesg | grep -c "reservation conflict error") \"reservation conflict error\" lines of the block layer, the first:"
dmesg | grep -m 2 -B 1 "reservation conflict error"
summary "resv summary ($(uname -r), $T)"
grep -i "traceback" "$W/target.log" && fail=1
exit $fail

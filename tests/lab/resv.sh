#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/resv.sh, from the project root; a 6.12 guest:
# LAB_HOME=/var/lib/rdma-lab-612 LAB_KPKG=linux-image-6.12-amd64 lab/setup): the Linux
# kernel's NVMe host, through nvme-cli's resv-* commands, against blockfabric-target's
# reservations (issue 17; docs/reservations.md).
#
# Two host identities (host NQN + host ID) connect to one subsystem, so the kernel makes two
# controllers, /dev/nvmeX (host 1) and /dev/nvmeY (host 2), and every command goes through
# the controller of the host it is for (the controller device with --namespace-id, not the
# multipath head, which would pick a path itself).  Cases:
#   resv/register     both hosts register; gen counts; Report (EDS) through either host
#   resv/conflict     host 1 holds Write Exclusive: host 2 reads, its write is refused
#                     with Reservation Conflict (0x83); host 1 writes
#   resv/preempt      host 2 preempts and aborts host 1 (Exclusive Access): host 1's write
#                     and read are refused; host 1's notification log says "registration
#                     preempted"
#   resv/ptpl         PTPL on a file volume: the state survives a SIGKILL and restart of
#                     the target (the kernel host reconnects by itself)
# RESV_TRANSPORT=tcp runs it over NVMe/TCP (the kernel's nvme-tcp; no RDMA device needed).
# Prints one "RESULT" line per case; exit status 0 when all passed.
# NOT YET RUN in the lab: written with the rest of issue 17, for the lead to run.
set -u
[ -f tests/lab/resv.sh ] || { echo "resv.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
PY=${PY:-$PWD/.venv/bin/python}
BIN=$(dirname "$PY")
IP=${LAB_IP:-10.99.0.1}
PORT=4420
T=${RESV_TRANSPORT:-rdma}           # rdma (verbs on rxe0) or tcp (the kernel's nvme-tcp)
export PYTHONDONTWRITEBYTECODE=1
W=$(mktemp -d /tmp/resv.XXXXXX)
NQN=nqn.2026-12.io.blockfabric:resv
H1=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000e0001
I1=5e1f0000-0000-4000-8000-0000000e0001
H2=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000e0002
I2=5e1f0000-0000-4000-8000-0000000e0002
TGT_PID=
fail=0
results=()

result() {
    local line; line=$(printf 'RESULT %-16s %-4s %s' "$1" "$2" "$3")
    echo "$line"; results+=("$line"); [ "$2" = OK ] || fail=1
}

cleanup() {
    nvme disconnect -n "$NQN" > /dev/null 2>&1
    stop_target
    rm -rf "$W"
}
trap cleanup EXIT

start_target() {
    mkdir -p "$W/vols"
    cat > "$W/target.yaml" <<YAML
listeners:
  - $([ "$T" = tcp ] && echo "{transport: tcp, address: $IP, port: $PORT}" \
                      || echo "{transport: rdma, provider: verbs, address: $IP, port: $PORT}")
subsystems:
  - nqn: $NQN
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: file, path: $W/vols/shared.img, size: 64MiB}
YAML
    "$BIN/blockfabric-target" run -C "$W/target.yaml" -v >> "$W/target.log" 2>&1 &
    TGT_PID=$!
    poll grep -q "ready:" "$W/target.log" || { echo "target not ready:"; cat "$W/target.log"; return 1; }
}
ctrl_of() {  # ctrl_of HOSTNQN -> /dev/nvmeX of our subsystem connected as that host
    local c
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
        [ "$(cat "$c/hostnqn" 2>/dev/null)" = "$1" ] && { echo "/dev/${c##*/}"; return 0; }
    done
    return 1
}
# io DEV read|write: one 4 KiB command at LBA 0 through that controller; prints the status
io() {
    local dev=$1 out rc
    if [ "$2" = write ]; then
        head -c 4096 /dev/urandom > "$W/page"
        out=$(nvme io-passthru "$dev" --opcode=0x01 --namespace-id=1 --data-len=4096 \
              --cdw10=0 --cdw12=0 --write --input-file="$W/page" 2>&1); rc=$?
    else
        out=$(nvme io-passthru "$dev" --opcode=0x02 --namespace-id=1 --data-len=4096 \
              --cdw10=0 --cdw12=0 --read 2>&1 > /dev/null); rc=$?
    fi
    if [ $rc = 0 ]; then echo ok
    elif echo "$out" | grep -qi "reservation conflict\|0x83\|0x4083"; then echo conflict
    else echo "other($rc): $out"; fi
}
report() {  # report DEV -> the JSON of resv-report (EDS), on stdout
    nvme resv-report "$1" --namespace-id=1 --eds -o json 2>/dev/null \
        || nvme resv-report "$1" --namespace-id=1 --cdw11=1 -o json
}
field() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {}, d))" "$1"; }

say "setup: blockfabric-target on $IP:$PORT ($T), two kernel host identities"
nvme version
# nvme connect needs /dev/nvme-fabrics, which only the transport's module makes
modprobe -a "nvme-$T" > /dev/null 2>&1 || { echo "cannot load nvme-$T"; exit 1; }
start_target || exit 1
nvme connect -t "$T" -a "$IP" -s "$PORT" -n "$NQN" -q "$H1" -I "$I1" || exit 1
# nvme-cli 2.3 takes a second controller to the same address for the one already there
# ("already connected") whatever its host NQN: --duplicate-connect
nvme connect -t "$T" -a "$IP" -s "$PORT" -n "$NQN" -q "$H2" -I "$I2" --duplicate-connect || exit 1
POLL_MAX=100 poll ctrl_of "$H2" > /dev/null || { echo "no second controller"; exit 1; }
C1=$(ctrl_of "$H1"); C2=$(ctrl_of "$H2")
echo "host 1: $C1, host 2: $C2"
nvme id-ctrl "$C1" | grep -E "^(oncs|ctratt)"
nvme id-ns "$C1" --namespace-id=1 | grep -E "^(rescap|nmic)"

say "resv/register"
ok=OK
nvme resv-register "$C1" --namespace-id=1 --nrkey=0xa --rrega=0 || ok=FAIL
nvme resv-register "$C2" --namespace-id=1 --nrkey=0xb --rrega=0 || ok=FAIL
r1=$(report "$C1"); r2=$(report "$C2"); echo "$r1"
[ "$(echo "$r1" | field 'gen')" = 2 ] || ok=FAIL
[ "$(echo "$r1" | field 'regctl')" = 2 ] && [ "$r1" = "$r2" ] || ok=FAIL
result resv/register $ok "two registrants, gen 2, the same report through both hosts"

say "resv/conflict"
ok=OK
nvme resv-acquire "$C1" --namespace-id=1 --crkey=0xa --rtype=1 --racqa=0 || ok=FAIL
[ "$(echo "$(report "$C2")" | field 'rtype')" = 1 ] || ok=FAIL
w2=$(io "$C2" write); r2=$(io "$C2" read); w1=$(io "$C1" write)
echo "host 2 write: $w2, host 2 read: $r2, host 1 write: $w1"
[ "$w2" = conflict ] && [ "$r2" = ok ] && [ "$w1" = ok ] || ok=FAIL
nvme resv-acquire "$C2" --namespace-id=1 --crkey=0xb --rtype=1 --racqa=0 2>&1 \
    | tee "$W/acq.txt"; grep -qi "conflict" "$W/acq.txt" || ok=FAIL
result resv/conflict $ok "Write Exclusive: second host NQN reads, its write and acquire conflict"

say "resv/preempt"
ok=OK
nvme resv-acquire "$C2" --namespace-id=1 --crkey=0xb --prkey=0xa --rtype=2 --racqa=2 || ok=FAIL
w1=$(io "$C1" write); r1=$(io "$C1" read); w2=$(io "$C2" write)
echo "host 1 write: $w1, host 1 read: $r1, host 2 write: $w2"
[ "$w1" = conflict ] && [ "$r1" = conflict ] && [ "$w2" = ok ] || ok=FAIL
rep=$(report "$C2"); echo "$rep"
[ "$(echo "$rep" | field 'regctl')" = 1 ] && [ "$(echo "$rep" | field 'rtype')" = 2 ] || ok=FAIL
nvme resv-notif-log "$C1" -o json 2>/dev/null | tee "$W/log.json" \
    || nvme get-log "$C1" --log-id=0x80 --log-len=64 | tee "$W/log.json"
grep -q '"type" *: *1\|"rn_type" *: *1\|^0000: .. .. .. .. .. .. .. .. 01' "$W/log.json" || ok=FAIL
nvme resv-release "$C2" --namespace-id=1 --crkey=0xb --rtype=2 --rrela=0 || ok=FAIL
result resv/preempt $ok "preempt and abort fences host 1 (reads and writes), its log says preempted"

say "resv/ptpl"
ok=OK
nvme resv-register "$C2" --namespace-id=1 --crkey=0xb --nrkey=0xb --rrega=0 --cptpl=3 || ok=FAIL
nvme resv-acquire "$C2" --namespace-id=1 --crkey=0xb --rtype=1 --racqa=0 || ok=FAIL
before=$(report "$C2")
kill -KILL "$TGT_PID"; wait "$TGT_PID" 2>/dev/null; TGT_PID=
start_target || ok=FAIL
POLL_MAX=200 poll eval '[ "$(cat /sys/class/nvme/${C2#/dev/}/state)" = live ]' || ok=FAIL
after=$(report "$C2"); echo "$after"
[ "$before" = "$after" ] && [ "$(echo "$after" | field 'ptpls')" = 1 ] || ok=FAIL
[ "$(io "$C1" write)" = conflict ] || ok=FAIL
result resv/ptpl $ok "the reservation survives SIGKILL and restart of the target"

nvme resv-release "$C2" --namespace-id=1 --crkey=0xb --rrela=1 > /dev/null 2>&1
echo; printf '%s\n' "${results[@]}"
grep -i "traceback" "$W/target.log" && fail=1
exit $fail

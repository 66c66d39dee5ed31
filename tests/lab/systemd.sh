#!/bin/bash
# Runs INSIDE the lab guest booted with systemd as PID 1 (make lab-systemd: LAB_INIT=systemd,
# LAB_PREBOOT=tests/lab/systemd-preboot.sh, which ran `make install` and enabled
# blockfabric-mount@vol0 before the boot).  The installed units under the real systemd:
#   boot     the mount at boot with the target down: the boot is not held, the unit retries
#   sandbox  a file volume outside /var/lib/blockfabric is refused (read-only) without the
#            documented ReadWritePaths= drop-in, and served with it
#   start    systemctl start: active only once READY=1 was sent (the port accepts by then)
#   mount    the boot-time mount appears once the target is up; data through it checked
#   reload   systemctl reload (adds a verbs listener on rxe0) while a host does verified I/O
#   verbs    the kernel's nvme connect -t rdma against the service on rxe0
#   journal  lines in the journal with their fields (PRIORITY=4 for a denied host)
#   watchdog SIGSTOP: the watchdog (shortened by a drop-in) restarts the daemon
#   sigkill  Restart=on-failure after SIGKILL; the host reconnects and goes on verifying
#   host     the host's final pass over every block it wrote
#   stop     systemctl stop with hosts connected: drain, exit 0
#   unmount  systemctl stop of the boot-time mount with the target gone: unmounted, in time
#   security systemd-analyze security blockfabric-target.service
#   uninstall make uninstall: everything installed goes, the configuration and volumes stay
# Prints one RESULT line per case with what it saw; exit status 0 when all passed.
set -u
[ -f tests/lab/systemd.sh ] || { echo "systemd.sh: run from the project root" >&2; exit 2; }
PY=/opt/blockfabric/bin/python    # what make install put there (tests/lab/nvme-lib.sh keeps it)
U=blockfabric-target.service
M=blockfabric-mount@vol0.service
VOLS=/srv/bf-vols                 # an operator-chosen directory, outside /var/lib/blockfabric
DROPIN=/etc/systemd/system/$U.d
NQN_FILE=nqn.2026-12.io.blockfabric:lab-file
NQN_RAM=nqn.2026-12.io.blockfabric:lab-ram
NQN_KERN=nqn.2026-12.io.blockfabric:lab-kernel
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000005d0001
DENIED=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000005d0bad
HOST_PID=
. tests/lab/nvme-lib.sh     # IP, W, say, since, wait_for, result (RESULT lines), summary
RESULT_WIDTH=10
show() { systemctl show -p ActiveState,SubState,NRestarts,MainPID,Result "$@" | paste -sd' '; }
prop() { systemctl show -P "$2" "$1"; }
jlines() { journalctl -q -u "$1" -o cat --no-pager; }          # this boot's lines of a unit
jcount() { jlines "$1" | grep -c -- "$2"; }
restarted() {  # active again, with a main process other than $1
    local main; main=$(prop $U MainPID)
    [ "$(prop $U ActiveState)" = active ] && [ "$main" != "$1" ] && [ "$main" != 0 ]
}
port_open() { (exec 3<> "/dev/tcp/$1/$2") 2> /dev/null; }
hstat() { "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' \
              "$W/host.json" "$1" 2> /dev/null; }
host_grew() { [ "$(hstat 'd["verified_bytes"]')" -gt "$1" ] 2> /dev/null; }
cleanup() {
    [ -n "$HOST_PID" ] && kill "$HOST_PID" 2> /dev/null
    nvme disconnect-all > /dev/null 2>&1
}
trap cleanup EXIT

config() {  # config with_verbs(0|1): the target's configuration
    cat <<YAML
listeners:
  - {name: lo, provider: soft, address: 127.0.0.1, port: 4420}
$([ "$1" = 1 ] && echo "  - {name: rxe, provider: verbs, address: $IP, port: 4420}")
subsystems:
  - nqn: $NQN_FILE
    hosts: [$HOSTNQN]
    listeners: [lo]
    namespaces:
      - {nsid: 1, backend: file, path: $VOLS/vol1.img, size: 64MiB}
  - nqn: $NQN_RAM
    allow_any_host: true
    listeners: [lo]
    namespaces:
      - {nsid: 1, backend: ramdisk, size: 16MiB}
$([ "$1" = 1 ] && cat <<YAML2
  - nqn: $NQN_KERN
    allow_any_host: true
    listeners: [rxe]
    namespaces:
      - {nsid: 1, backend: file, path: $VOLS/kern.img, size: 32MiB, block_size: 512}
YAML2
)
YAML
}

# ---------------------------------------------------------------------------------- install
say "install: what make install put in place (before the boot)"
ls -l /usr/local/bin/blockfabric-target /usr/local/bin/blockfabric
grep -H "^ExecStart=\|^DeviceAllow=" /etc/systemd/system/$U
ok=OK
[ "$(readlink /usr/local/bin/blockfabric-target)" = /opt/blockfabric/bin/blockfabric-target ] \
    || ok=FAIL
(cd / && "$PY" -c 'import blockfabric.target, pyverbs, sys; print(sys.prefix, "imports pyverbs")') \
    || ok=FAIL
cmp -s configs/target.yaml /etc/blockfabric/target.yaml \
    || { echo "no default target.yaml"; ok=FAIL; }
result install $ok "links -> /opt/blockfabric/bin, units in /etc/systemd/system," \
    "default target.yaml"

# ------------------------------------------------------------------------------------- boot
say "boot: blockfabric-mount@vol0 enabled, the target down"
systemd-analyze | head -n 1
echo "lab.target:       $(show lab.target)"
echo "remote-fs.target: $(show remote-fs.target)"
echo "$M: $(show $M)"
echo "$U: $(show $U)"
systemctl list-jobs --no-legend | head -n 5
jlines $M | tail -n 4
ok=OK
[ "$(prop lab.target ActiveState)" = active ] || ok=FAIL
[ "$(prop remote-fs.target ActiveState)" = active ] || ok=FAIL
[ "$(prop $U ActiveState)" = inactive ] || ok=FAIL
case "$(prop $M ActiveState)" in active) ok=FAIL ;; esac   # the target is down: it cannot be
! mountpoint -q /mnt/vol0 || ok=FAIL
# Not held: remote-fs.target was reached before the mount's first attempt had even failed.
fs_up=$(prop remote-fs.target ActiveEnterTimestampMonotonic)
first_fail=$(journalctl -q -u $M -o json --no-pager | (cd / && "$PY" -c '
import json, sys
for line in sys.stdin:
    entry = json.loads(line)
    message = str(entry.get("MESSAGE"))
    if "Main process exited" in message or "Failed with result" in message:
        print(entry["__MONOTONIC_TIMESTAMP"]); break
else:
    print(0)'))
echo "remote-fs.target active at ${fs_up} us;" \
     "the mount's first attempt failed at ${first_fail} us (0: not yet)"
if [ "$first_fail" != 0 ] && [ "$fs_up" -ge "$first_fail" ]; then
    echo "remote-fs.target waited for the mount"; ok=FAIL
fi
result boot $ok "lab.target and remote-fs.target reached, not held by $M" \
    "($(prop $M ActiveState)/$(prop $M SubState), NRestarts=$(prop $M NRestarts))"

# ---------------------------------------------------------------------------------- sandbox
say "sandbox: a file volume in $VOLS, first without the ReadWritePaths= drop-in"
mkdir -p $VOLS
config 0 > /etc/blockfabric/target.yaml
systemctl start --no-block $U
ok=OK
refused() { jlines $U | grep -q "Read-only file system.*$VOLS/vol1.img"; }
if wait_for 150 refused; then
    jlines $U | grep -m 1 "Read-only file system"
else
    echo "no read-only refusal in the journal:"; jlines $U | tail -n 10; ok=FAIL
fi
echo "$U: $(show $U)"
systemctl stop $U; systemctl reset-failed $U 2> /dev/null
[ ! -e $VOLS/vol1.img ] || { echo "the volume was created despite the sandbox"; ok=FAIL; }
# the documented drop-in (docs/operations.md), and the lab's shorter watchdog (a drop-in too:
# the shipped WatchdogSec=30 stays; 10 s leaves the reactor's 5 s pings room under TCG)
mkdir -p $DROPIN
printf '[Unit]\nRequiresMountsFor=%s\n[Service]\nReadWritePaths=%s\n' $VOLS $VOLS \
    > $DROPIN/volumes.conf
printf '[Service]\nWatchdogSec=10\n' > $DROPIN/lab-watchdog.conf
systemctl daemon-reload
systemctl cat $U | grep -A3 "^# $DROPIN"
result sandbox $ok "without ReadWritePaths=$VOLS the file volume is refused (read-only);" \
    "drop-ins added"

# ------------------------------------------------------------------------------------ start
say "start: systemctl start, states seen while it starts"
ok=OK
t0=$EPOCHREALTIME
systemctl start --no-block $U
seen=""; early=0
while :; do
    st="$(prop $U ActiveState)/$(prop $U SubState)"
    case "$seen" in *"$st"*) ;; *) seen="$seen $st"; echo "$(since "$t0") s: $st" ;; esac
    if [ "${st%/*}" = active ]; then port_open 127.0.0.1 4420 || early=1; break; fi
    [ "${st%/*}" = failed ] && break
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{exit !(b-a>120)}' && break
    sleep 0.1
done
echo "$U: $(show $U)"
# READY=1 follows the "ready:" line; systemd logs "Started" only when it got READY=1
journalctl -q -o short-monotonic --no-pager _SYSTEMD_UNIT=$U + UNIT=$U \
    | grep "ready:\|Started\|listening" | tail -n 4
order=$(jlines $U | grep "ready:\|Started" | tail -n 2 | cut -c1-7 | paste -sd,)
[ "$(prop $U ActiveState)" = active ] || ok=FAIL
case "$seen" in *activating/start*) ;; *) echo "never seen activating"; ok=FAIL ;; esac
[ $early = 0 ] || { echo "active while the port did not accept"; ok=FAIL; }
[ "$order" = "INFO bl,Started" ] || { echo "journal order: $order"; ok=FAIL; }
result start $ok "seen:$seen in $(since "$t0") s; port accepted when active;" \
    "journal: ready: before Started"
MAIN0=$(prop $U MainPID)

# ------------------------------------------------------------------------------------ mount
say "mount: the boot-time mount comes up by itself once the target is up"
ok=OK
t0=$EPOCHREALTIME
wait_for 60 eval '[ "$(prop $M ActiveState)" = active ]' || ok=FAIL
echo "$M: $(show $M) after $(since "$t0") s"
jlines $M | grep -i "mounted\|refused" | tail -n 3
if mountpoint -q /mnt/vol0 && ls -l /mnt/vol0; then
    head -c $((4 << 20)) /dev/urandom > $W/pattern
    dd if=$W/pattern of=/mnt/vol0/n1 bs=1M oflag=direct conv=notrunc status=none || ok=FAIL
    dd if=/mnt/vol0/n1 of=$W/back bs=1M count=4 iflag=direct status=none || ok=FAIL
    cmp $W/pattern $W/back && echo "4 MiB written through /mnt/vol0/n1 and read back" || ok=FAIL
else ok=FAIL; fi
result mount $ok "$M $(prop $M ActiveState) after $(prop $M NRestarts) restart(s);" \
    "4194304 bytes verified through /mnt/vol0/n1"

# ----------------------------------------------------------------------------------- reload
say "reload: a host verifies I/O on $NQN_FILE while systemctl reload adds the verbs listener"
ok=OK
"$PY" tests/lab/systemd_host.py --nqn $NQN_FILE --hostnqn $HOSTNQN --stats $W/host.json \
    > $W/host.log 2>&1 &
HOST_PID=$!
wait_for 60 host_grew 40960 || { echo "the host does not get going:"; cat $W/host.log; ok=FAIL; }
before=$(hstat 'd["verified_bytes"]')
config 1 > /etc/blockfabric/target.yaml
n=$(jcount $U "reloaded ")
t0=$EPOCHREALTIME
systemctl reload $U || ok=FAIL
wait_for 60 eval '[ "$(jcount $U "reloaded ")" -gt $n ]' || { echo "no 'reloaded' line"; ok=FAIL; }
jlines $U | grep "SIGHUP\|reloaded \|reload rejected\|listening on" | tail -n 4
wait_for 30 host_grew "$(hstat 'd["verified_bytes"]')" || ok=FAIL
after=$(hstat 'd["verified_bytes"]')
echo "$U: $(show $U)"
echo "host: $(cat $W/host.json)"
blockfabric-target status | head -n 4
[ "$(prop $U MainPID)" = "$MAIN0" ] && [ "$(prop $U NRestarts)" = 0 ] || ok=FAIL
[ "$(hstat 'd["mismatches"]+d["errors"]')" = 0 ] || ok=FAIL
blockfabric-target status | grep -q "$IP:4420" || ok=FAIL
result reload $ok "same MainPID $MAIN0, NRestarts=0; host verified $before -> $after bytes," \
    "0 errors; verbs listener up"

# ------------------------------------------------------------------------------------ verbs
say "verbs: the kernel's nvme connect -t rdma to the service on rxe0"
ok=OK
modprobe nvme-rdma || ok=FAIL
nvme connect -t rdma -a $IP -s 4420 -n $NQN_KERN -q $HOSTNQN -i 1 || ok=FAIL
dev=
find_dev() {
    local n
    for n in /sys/block/nvme*n*; do
        [ "$(cat "$n/device/subsysnqn" 2> /dev/null)" = "$NQN_KERN" ] && [ -b "/dev/${n##*/}" ] \
            && { dev=/dev/${n##*/}; return 0; }   # (not a multipath head's path: no /dev node)
    done; return 1
}
wait_for 30 find_dev || ok=FAIL
bytes=0
if [ -n "$dev" ]; then
    echo "$dev: $(blockdev --getsize64 "$dev") bytes," \
         "transport $(cat /sys/block/${dev#/dev/}/device/transport)"
    head -c $((8 << 20)) /dev/urandom > $W/kpattern
    dd if=$W/kpattern of="$dev" bs=1M oflag=direct status=none || ok=FAIL
    nvme flush "$dev" -n 1 > /dev/null || ok=FAIL
    dd if="$dev" of=$W/kback bs=1M count=8 iflag=direct status=none || ok=FAIL
    if cmp $W/kpattern $W/kback && cmp -n $((8 << 20)) $W/kpattern $VOLS/kern.img; then
        bytes=$((8 << 20)); echo "8 MiB through $dev: read back, and on $VOLS/kern.img"
    else ok=FAIL; fi
fi
nvme disconnect -n $NQN_KERN || ok=FAIL
jlines $U | grep "verbs" | tail -n 3
result verbs $ok "kernel nvme-rdma host on rxe0 -> the service (verbs provider):" \
    "$bytes bytes verified"

# ---------------------------------------------------------------------------------- journal
say "journal: the fields of the target's lines"
ok=OK
blockfabric connect -a 127.0.0.1 -n $NQN_FILE -q $DENIED --provider soft > $W/denied.txt 2>&1 \
    && { echo "a host not on the list connected"; ok=FAIL; }
tail -n 1 $W/denied.txt
warned() { journalctl -q -u $U -p warning -o cat --no-pager | grep -q "denied: hostnqn=$DENIED"; }
wait_for 20 warned || ok=FAIL
journalctl -q -u $U -p warning -o json --no-pager | "$PY" -c '
import json, sys
for line in sys.stdin:
    entry = json.loads(line)
    if sys.argv[1] in str(entry.get("MESSAGE")):
        for key in ("PRIORITY", "SYSLOG_IDENTIFIER", "_SYSTEMD_UNIT", "_PID", "MESSAGE"):
            print(f"{key}={entry.get(key)}")
        break' "$DENIED" | tee $W/fields
grep -q "PRIORITY=4" $W/fields && grep -q "_SYSTEMD_UNIT=$U" $W/fields || ok=FAIL
jlines $U | grep -m 1 "hostnqn=$HOSTNQN" || ok=FAIL
result journal $ok "access denied logged at PRIORITY=4 with hostnqn= subnqn= qid= peer=;" \
    "controller lines carry hostnqn="

# --------------------------------------------------------------------------------- watchdog
say "watchdog: SIGSTOP the daemon (WatchdogSec=10 from the lab drop-in)"
ok=OK
pid=$(prop $U MainPID); r0=$(prop $U NRestarts); v0=$(hstat 'd["verified_bytes"]')
t0=$EPOCHREALTIME
kill -STOP "$pid"
wait_for 60 eval 'jlines $U | grep -q "Watchdog timeout"' || ok=FAIL
jlines $U | grep -m 1 "Watchdog timeout"
wait_for 60 restarted "$pid" || ok=FAIL
echo "$U: $(show $U) after $(since "$t0") s"
wait_for 60 host_grew "$v0" || { echo "the host did not resume"; ok=FAIL; }
[ "$(prop $U NRestarts)" = $((r0 + 1)) ] || ok=FAIL
result watchdog $ok "pid $pid stopped -> watchdog timeout -> pid $(prop $U MainPID)," \
    "NRestarts=$(prop $U NRestarts); host verifying again"

# ---------------------------------------------------------------------------------- sigkill
say "sigkill: Restart=on-failure after SIGKILL, the host reconnects"
ok=OK
pid=$(prop $U MainPID); r0=$(prop $U NRestarts); rc0=$(hstat 'd["recovery"]["reconnects"]')
v0=$(hstat 'd["verified_bytes"]')
t0=$EPOCHREALTIME
systemctl kill -s SIGKILL --kill-who=main $U
wait_for 60 restarted "$pid" || ok=FAIL
jlines $U | grep "status=9/KILL\|Scheduled restart" | tail -n 2
echo "$U: $(show $U) after $(since "$t0") s"
wait_for 60 eval '[ "$(hstat "d[\"recovery\"][\"reconnects\"]")" -gt "$rc0" ]' || ok=FAIL
wait_for 60 host_grew "$v0" || ok=FAIL
echo "host: $(cat $W/host.json)"
[ "$(prop $U NRestarts)" = $((r0 + 1)) ] || ok=FAIL
result sigkill $ok "pid $pid killed -> pid $(prop $U MainPID), NRestarts=$(prop $U NRestarts);" \
    "host reconnects $rc0 -> $(hstat 'd["recovery"]["reconnects"]')"

# ------------------------------------------------------------------------------------- host
say "host: stop the host; its final pass reads back every block it wrote"
ok=OK
kill -TERM "$HOST_PID"; wait "$HOST_PID"; hrc=$?; HOST_PID=
tail -n 2 $W/host.log
[ $hrc = 0 ] || ok=FAIL
result host $ok "rc=$hrc: $(hstat 'd["verified_bytes"]') bytes verified while running," \
    "$(hstat 'd["final_verified_bytes"]') in the final pass," \
    "mismatches $(hstat 'd["mismatches"]'), errors $(hstat 'd["errors"]')"

# ------------------------------------------------------------------------------------- stop
say "stop: systemctl stop with the boot-time mount connected"
ok=OK
# The boot-time mount, idle since its own case, reconnected by itself after the two restarts
# (its controller is listed, untouched), still serves, and is there to be drained.
wait_for 60 eval 'blockfabric-target status | grep -q -- "-> $NQN_RAM"' \
    || { echo "the mount's controller is not back: $M $(show $M)"; jlines $M | tail -n 12
         ok=FAIL; }
blockfabric-target status | grep -A1 -- "-> $NQN_RAM"
dd if=/mnt/vol0/n1 of=/dev/null bs=64k count=16 iflag=direct status=none \
    && echo "1 MiB read through /mnt/vol0/n1 after the restarts" || ok=FAIL
pid=$(prop $U MainPID)
t0=$EPOCHREALTIME
systemctl stop $U || ok=FAIL
took=$(since "$t0")
systemctl show -p ActiveState,Result,ExecMainCode,ExecMainStatus $U | paste -sd' '
jlines $U | grep "SIGTERM\|draining\|stopped\|Deactivated\|Stopped" | tail -n 5
[ "$(prop $U ActiveState)" = inactive ] && [ "$(prop $U Result)" = success ] || ok=FAIL
# exit status 0 (a death by SIGTERM would be 15, and also counts as Result=success)
[ "$(prop $U ExecMainStatus)" = 0 ] || ok=FAIL
drained=$(jlines $U | grep "draining: listeners closed" | tail -n 1)
echo "$drained" | grep -q " [1-9][0-9]* controller(s)" || { echo "nothing was connected"; ok=FAIL; }
jlines $U | tail -n 8 | grep -q "INFO blockfabric.target: stopped" || ok=FAIL
result stop $ok "pid $pid drained (${drained##*, }) and exited 0 in $took s" \
    "(ExecMainStatus=$(prop $U ExecMainStatus), Result=$(prop $U Result))"

# ---------------------------------------------------------------------------------- unmount
say "unmount: systemctl stop $M, with the target gone"
ok=OK
t0=$EPOCHREALTIME
systemctl stop $M || ok=FAIL
took=$(since "$t0")
echo "$M: $(show $M)"
jlines $M | grep -i "unmounted\|Deactivated\|Stopped\|fusermount" | tail -n 3
! mountpoint -q /mnt/vol0 || { echo "/mnt/vol0 is still mounted"; ok=FAIL; }
[ "$(prop $M ActiveState)" = inactive ] || ok=FAIL
awk -v t="$took" 'BEGIN{exit !(t < 30)}' || ok=FAIL       # within TimeoutStopSec, not killed
result unmount $ok "unmounted in $took s with the target down" \
    "($(prop $M ActiveState), Result=$(prop $M Result))"

# --------------------------------------------------------------------------------- security
say "security: systemd-analyze security $U"
systemd-analyze security --no-pager $U > $W/security.txt 2>&1
grep -v "^✓" $W/security.txt          # what is still exposed (the full table: LAB_OUT)
[ -n "${LAB_OUT_GUEST:-}" ] && cp $W/security.txt "$LAB_OUT_GUEST/security.txt"
level=$(sed -n 's/.*Overall exposure level for .*: \([0-9.]*\).*/\1/p' $W/security.txt)
ok=OK; awk -v l="${level:-99}" 'BEGIN{exit !(l <= 2.4)}' || ok=FAIL
result security $ok "overall exposure level ${level:-?}" \
    "(2.4 with the unit as shipped: a loosened sandbox fails here)"

# -------------------------------------------------------------------------------- uninstall
say "uninstall: make uninstall"
ok=OK
# (the venv is make lab-systemd's, mounted read-only: unmounted here, so that what
# make uninstall removes is the empty directory, as it would remove the venv)
umount /opt/blockfabric
make --no-print-directory uninstall || ok=FAIL
for f in /usr/local/bin/blockfabric-target /usr/local/bin/blockfabric /opt/blockfabric \
         /etc/systemd/system/$U /etc/systemd/system/blockfabric-mount@.service \
         /etc/systemd/system/remote-fs.target.wants/$M; do
    [ -e "$f" ] || [ -L "$f" ] && { echo "left behind: $f"; ok=FAIL; }
done
echo "$U LoadState=$(prop $U LoadState), $M LoadState=$(prop $M LoadState)"
[ "$(prop $U LoadState)" = not-found ] || ok=FAIL
ls /etc/blockfabric $VOLS
[ -e /etc/blockfabric/target.yaml ] && [ -e $VOLS/vol1.img ] \
    || { echo "configuration or volume removed"; ok=FAIL; }
result uninstall $ok "programs, links, units and the enabled mount removed;" \
    "/etc/blockfabric and the volumes kept"

summary "systemd summary"
rm -rf "$W"
exit $fail

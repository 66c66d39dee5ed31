#!/bin/bash
# Runs INSIDE the lab guest (lab/run tests/lab/interop.sh, from the project root): blockfabric
# against the Linux kernel's NVMe-oF RDMA stack on rxe0, both ways.
#   A. the kernel host (nvme-cli, nvme-rdma) against blockfabric-target (verbs listener):
#      discover, connect, dd/fio verify, data checked on our backing file, flush, blkdiscard,
#      disconnect; again with -i 2, and a 4 KiB in-capsule write.
#   B. blockfabric's host (verbs provider) against the kernel's nvmet-rdma on a brd ramdisk:
#      discover, identify, connect, a verify workload through the host library (checked on
#      /dev/ram0), and fio verify through the FUSE mount.
#   A/auth-*, B/auth-*: NVMe in-band authentication (DH-HMAC-CHAP) both ways, with secrets
#      made by the kernel side's own tool (nvme gen-dhchap-key): the NULL group, ffdhe2048
#      with a controller secret (bidirectional), and wrong secrets, which must be refused
#      while the target stays up.  They need a kernel built with CONFIG_NVME_HOST_AUTH (6.1:
#      CONFIG_NVME_AUTH) and CONFIG_NVME_TARGET_AUTH; Debian's 6.1 has neither, its 6.12
#      both (LAB_HOME=/var/lib/rdma-lab-612 LAB_KPKG=linux-image-6.12-amd64 lab/setup), and
#      on a kernel without them they print SKIP, which does not fail the run.
# Prints one "RESULT" line per case (what ran, bytes verified); exit status 0 when all passed.
set -u
[ -f tests/lab/interop.sh ] || { echo "interop.sh: run from the project root" >&2; exit 2; }
. tests/lab/nvme-lib.sh
PORT=4420
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-00000000a11b
NQN_OURS=nqn.2026-12.io.blockfabric:interop
NQN_KERNEL=nqn.2026-12.io.rdma-lab:kernel-ram0
# DH-HMAC-CHAP: a subsystem of ours and one of the kernel's that make their hosts authenticate
NQN_AUTH=nqn.2026-12.io.blockfabric:interop-auth
NQN_KAUTH=nqn.2026-12.io.rdma-lab:kernel-auth-ram1
HOST_AUTH=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000a0001   # NULL group
HOST_BIDI=nqn.2014-08.org.nvmexpress:uuid:5e1f0000-0000-4000-8000-0000000a0002   # ffdhe2048
TGT_PID=

cleanup() {
    nvme disconnect-all > /dev/null 2>&1
    stop_target
    kernel_auth_target_down > /dev/null 2>&1
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
    target_yaml "$NQN_OURS" "{transport: rdma, provider: verbs, address: $IP, port: $PORT}" \
        "$(auth_subsystem_yaml)" > "$W/target.yaml"
    # the target with a probe that logs each command whose data came in-capsule
    launch_target "$W/target.yaml" "$PY" tests/lab/interop_target.py
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
         "queues=$(io_queues "$ctrl") $dev1=$(blockdev --getsize64 "$dev1") B" \
         "$dev2=$(blockdev --getsize64 "$dev2") B"

    # dd: 8 MiB of random data through nsid 1 (file backend), read back, then on our file
    if dd_verify "$dev1"; then bytes=$((bytes + (8 << 20))); else ok=FAIL; fi

    # fio verify through nsid 2 (ramdisk): several jobs on distinct regions, crc32c
    if fio_verify "$dev2" 2 9; then
        bytes=$((bytes + (16 << 20))); echo "fio: 16 MiB written with crc32c headers and verified"
    else ok=FAIL; fi

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
# A/auth: the kernel host authenticates to blockfabric-target with DH-HMAC-CHAP
# ---------------------------------------------------------------------------------------
kconfig() {  # kconfig SYMBOL: is it y or m in the running kernel's config (lab/setup's copy)?
    grep -q "^$1=[ym]" "${LAB_HOME:-/var/lib/rdma-lab}/kernel/$(uname -r)/boot/config-$(uname -r)" \
        2> /dev/null
}
auth_setup() {  # what this kernel can do, and the secrets, made by nvme-cli as a user would
    local cfg="${LAB_HOME:-/var/lib/rdma-lab}/kernel/$(uname -r)/boot/config-$(uname -r)"
    KHOST_AUTH=0; KTARGET_AUTH=0
    if [ ! -r "$cfg" ]; then
        AUTH_WHY="no kernel config at $cfg"
    else
        # 6.1-6.6: CONFIG_NVME_AUTH is the host's; from 6.7 CONFIG_NVME_HOST_AUTH is
        if grep -q "CONFIG_NVME_HOST_AUTH" "$cfg"; then kconfig CONFIG_NVME_HOST_AUTH && KHOST_AUTH=1
        else kconfig CONFIG_NVME_AUTH && KHOST_AUTH=1; fi
        kconfig CONFIG_NVME_TARGET_AUTH && KTARGET_AUTH=1
        AUTH_WHY="kernel $(uname -r) built without"
    fi
    # DHHC-1:<transform>:... with the transform hash 01/02/03 and 32/48/64-byte keys
    KEY_AUTH=$(nvme gen-dhchap-key -m 1 -l 32 -n "$HOST_AUTH")
    KEY_AUTH_WRONG=$(nvme gen-dhchap-key -m 1 -l 32 -n "$HOST_AUTH")
    KEY_BIDI=$(nvme gen-dhchap-key -m 2 -l 48 -n "$HOST_BIDI")
    KEY_CTRL=$(nvme gen-dhchap-key -m 3 -l 64 -n "$NQN_AUTH")
    KEY_CTRL_WRONG=$(nvme gen-dhchap-key -m 3 -l 64 -n "$NQN_AUTH")
    echo "kernel $(uname -r): host authentication $([ $KHOST_AUTH = 1 ] && echo yes || echo no)," \
         "target authentication $([ $KTARGET_AUTH = 1 ] && echo yes || echo no);" \
         "secrets from nvme gen-dhchap-key: ${KEY_AUTH:0:10}... ${KEY_BIDI:0:10}... ${KEY_CTRL:0:10}..."
}
auth_subsystem_yaml() {  # a subsystem of ours whose two hosts must authenticate
    cat <<YAML
  - nqn: $NQN_AUTH
    hosts:
      - {nqn: $HOST_AUTH, dhchap_secret: "$KEY_AUTH"}
      - nqn: $HOST_BIDI
        dhchap_secret: "$KEY_BIDI"
        dhchap_ctrl_secret: "$KEY_CTRL"
        dhchap_hash: hmac(sha384)
        dhchap_dhgroup: ffdhe2048
    namespaces:
      - {nsid: 1, backend: ramdisk, size: 32MiB, block_size: 4096}
YAML
}

kernel_auth_case() {  # NAME HOSTNQN WANT TEXT [nvme connect args]; WANT: auth, auth-bidi (the
    # controller authenticated too), refused (our target logs the failure) or refused-silent
    local name=$1 hostnqn=$2 want=$3 text=$4 t0 ok=OK dev ctrl before after nq rc bytes=0
    shift 4
    say "A/$name: kernel host -> blockfabric-target with DH-HMAC-CHAP: $text"
    if [ "$KHOST_AUTH" != 1 ]; then
        result "A/$name" SKIP "$AUTH_WHY CONFIG_NVME_HOST_AUTH/CONFIG_NVME_AUTH"; return 0
    fi
    t0=$(now)
    before=$(grep -c "host authenticated" "$W/target.log")
    local fails_before; fails_before=$(grep -c "authentication failed" "$W/target.log")
    timeout 60 nvme connect -t rdma -a "$IP" -s "$PORT" -n "$NQN_AUTH" -q "$hostnqn" -i 2 "$@"
    rc=$?
    if [ "$want" = refused ] || [ "$want" = refused-silent ]; then
        # the connect must fail, leave no controller behind, and our target must go on serving
        [ $rc != 0 ] || { echo "nvme connect succeeded with a wrong secret"; ok=FAIL; }
        if ctrl_dev "$NQN_AUTH" > /dev/null; then
            echo "a controller of $NQN_AUTH exists"; ok=FAIL; nvme disconnect -n "$NQN_AUTH"
        fi
        dmesg | grep -i "nvme" | tail -n 4
        # (without a secret the kernel host gives up before sending anything: nothing to log)
        if [ "$want" = refused ]; then
            POLL_MAX=50 poll eval \
                '[ $(grep -c "authentication failed" "$W/target.log") -gt $fails_before ]' \
                || { echo "our target logged no authentication failure"; ok=FAIL; }
            grep "authentication failed" "$W/target.log" | tail -n 1
        fi
        kill -0 "$TGT_PID" 2> /dev/null || { echo "blockfabric-target died"; ok=FAIL; }
        nvme discover -t rdma -a "$IP" -s "$PORT" -q "$HOSTNQN" > "$W/discover2.txt" \
            && grep -q "subnqn: *$NQN_OURS" "$W/discover2.txt" \
            || { echo "our target does not answer discovery afterwards"; ok=FAIL; }
        result "A/$name" "$ok" "kernel host, $text: nvme connect rc=$rc, target up, $(since "$t0") s"
        return 0
    fi
    [ $rc = 0 ] || { ok=FAIL; trace_dump 30; tail -n 20 "$W/target.log"; }
    POLL_MAX=100 poll ns_dev "$NQN_AUTH" 1 > /dev/null || echo "no block device"
    dev=$(ns_dev "$NQN_AUTH" 1) || { result "A/$name" FAIL "no /dev/nvmeXnY"; return 1; }
    ctrl=$(ctrl_dev "$NQN_AUTH")
    nq=$(io_queues "$ctrl")
    local sys=/sys/class/nvme/${ctrl#/dev/}
    echo "controller $ctrl: $nq I/O queue(s); in sysfs dhchap_secret" \
         "$(cut -c1-10 "$sys/dhchap_secret" 2>/dev/null)... dhchap_ctrl_secret" \
         "$(cut -c1-10 "$sys/dhchap_ctrl_secret" 2>/dev/null)..."
    # each queue (admin + I/O) authenticated on its own, as our target logged it
    after=$(grep -c "host authenticated" "$W/target.log")
    grep "host authenticated" "$W/target.log" | tail -n $((after - before))
    [ $((after - before)) = $((nq + 1)) ] \
        || { echo "$((after - before)) queue(s) authenticated, expected $((nq + 1))"; ok=FAIL; }
    if [ "$want" = auth-bidi ]; then
        [ "$(grep "host authenticated" "$W/target.log" | tail -n $((after - before)) \
             | grep -c "authenticated the controller too")" = $((nq + 1)) ] \
            || { echo "not every queue authenticated the controller"; ok=FAIL; }
    fi
    if fio_verify "$dev" 2 13; then bytes=$((16 << 20)); else ok=FAIL; fi
    nvme disconnect -n "$NQN_AUTH" || ok=FAIL
    poll eval '! ctrl_dev "$NQN_AUTH" > /dev/null' || { echo "controller still present"; ok=FAIL; }
    result "A/$name" "$ok" \
        "kernel host, $text: $((nq + 1)) queues authenticated, $bytes bytes verified, $(since "$t0") s"
}

kernel_auth_cases() {
    kernel_auth_case auth-null "$HOST_AUTH" auth "hmac(sha256), NULL group" -S "$KEY_AUTH"
    kernel_auth_case auth-wrong-secret "$HOST_AUTH" refused "wrong host secret" \
        -S "$KEY_AUTH_WRONG"
    kernel_auth_case auth-no-secret "$HOST_AUTH" refused-silent "no secret given"
    kernel_auth_case auth-ffdhe2048-bidi "$HOST_BIDI" auth-bidi \
        "hmac(sha384), ffdhe2048, controller authenticated" -S "$KEY_BIDI" -C "$KEY_CTRL"
    kernel_auth_case auth-wrong-ctrl-secret "$HOST_BIDI" refused \
        "the host refuses a controller with another secret" -S "$KEY_BIDI" -C "$KEY_CTRL_WRONG"
}

# ---------------------------------------------------------------------------------------
# B. blockfabric host -> kernel nvmet-rdma
# ---------------------------------------------------------------------------------------
kernel_target_up() { nvmet_up 1 rdma "$PORT" "$NQN_KERNEL" 2; }    # /dev/ram1: B/auth
kernel_target_down() { nvmet_down 1 "$NQN_KERNEL"; }

our_host_case() {
    local t0 ok=OK bytes=0 out
    say "B: blockfabric host (verbs) -> kernel nvmet-rdma on /dev/ram0"
    t0=$(now)
    kernel_target_up || { result B/kernel-target FAIL "nvmet configfs set-up failed"; return; }
    local common=(-a "$IP" -s "$PORT" -q "$HOSTNQN" --provider verbs)
    timeout 60 "$BIN/blockfabric" discover "${common[@]}" | tee "$W/bdiscover.txt" || ok=FAIL
    grep -q "$NQN_KERNEL" "$W/bdiscover.txt" || { echo "discovery lacks $NQN_KERNEL"; ok=FAIL; }
    timeout 60 "$BIN/blockfabric" identify "${common[@]}" -n "$NQN_KERNEL" || ok=FAIL
    timeout 60 "$BIN/blockfabric" connect "${common[@]}" -n "$NQN_KERNEL" -i 2 || ok=FAIL
    out=$(timeout 120 "$PY" tests/lab/interop_host.py --traddr "$IP" --nqn "$NQN_KERNEL" \
          --hostnqn "$HOSTNQN" --check-device /dev/ram0) || ok=FAIL
    echo "$out"
    bytes=$(echo "$out" | sed -n 's/^verified: \([0-9]*\) bytes read back.*/\1/p')
    result "B/host-library" "$ok" "our host, library verify: ${bytes:-0} bytes verified, $(since "$t0") s"
    our_mount_case
}

our_mount_case() {  # fio verify through the FUSE file of a blockfabric mount
    local t0 ok=OK
    t0=$(now)
    say "B/mount: blockfabric mount (verbs) of the kernel target, fio verify through $W/mnt/n1"
    mount_fio_verify "$W/mnt" -a "$IP" -s "$PORT" -q "$HOSTNQN" --provider verbs \
        -n "$NQN_KERNEL" || ok=FAIL
    result "B/mount" "$ok" "our host, FUSE + fio verify: $([ $ok = OK ] && echo $((16 << 20)) || echo 0) bytes verified, $(since "$t0") s"
}

# ---------------------------------------------------------------------------------------
# B/auth: blockfabric's host authenticates to the kernel's nvmet (configfs hosts/<nqn>/dhchap_*)
# ---------------------------------------------------------------------------------------
kernel_auth_target_up() {  # NQN_KAUTH on /dev/ram1, HOST_AUTH and HOST_BIDI allowed, on port 1
    local h
    [ -d "$CFS/ports/1" ] || return 1
    for h in "$HOST_AUTH" "$HOST_BIDI"; do mkdir -p "$CFS/hosts/$h" || return 1; done
    kernel_auth_host "$HOST_AUTH" "$KEY_AUTH" "" "hmac(sha256)" null || return 1
    kernel_auth_host "$HOST_BIDI" "$KEY_BIDI" "$KEY_CTRL" "hmac(sha384)" ffdhe2048 || return 1
    mkdir "$CFS/subsystems/$NQN_KAUTH" || return 1
    echo 0 > "$CFS/subsystems/$NQN_KAUTH/attr_allow_any_host"
    for h in "$HOST_AUTH" "$HOST_BIDI"; do
        ln -s "$CFS/hosts/$h" "$CFS/subsystems/$NQN_KAUTH/allowed_hosts/$h" || return 1
    done
    mkdir "$CFS/subsystems/$NQN_KAUTH/namespaces/1"
    echo -n /dev/ram1 > "$CFS/subsystems/$NQN_KAUTH/namespaces/1/device_path"
    echo 1 > "$CFS/subsystems/$NQN_KAUTH/namespaces/1/enable" || return 1
    ln -s "$CFS/subsystems/$NQN_KAUTH" "$CFS/ports/1/subsystems/$NQN_KAUTH"
}
kernel_auth_host() {  # kernel_auth_host NQN KEY CTRL_KEY HASH DHGROUP: nvmet's view of a host
    local d=$CFS/hosts/$1
    echo -n "$2" > "$d/dhchap_key" && echo -n "$3" > "$d/dhchap_ctrl_key" \
        && echo -n "$4" > "$d/dhchap_hash" && echo -n "$5" > "$d/dhchap_dhgroup" || return 1
    echo "nvmet host ${1##*:}: dhchap_hash $(cat "$d/dhchap_hash"), dhchap_dhgroup" \
         "$(cat "$d/dhchap_dhgroup"), dhchap_key ${2:0:10}..., dhchap_ctrl_key ${3:0:10}..."
}
kernel_auth_target_down() {
    local h
    [ -d "$CFS/subsystems/$NQN_KAUTH" ] || return 0
    rm -f "$CFS/ports/1/subsystems/$NQN_KAUTH"
    echo 0 > "$CFS/subsystems/$NQN_KAUTH/namespaces/1/enable"
    rmdir "$CFS/subsystems/$NQN_KAUTH/namespaces/1"
    for h in "$HOST_AUTH" "$HOST_BIDI"; do
        rm -f "$CFS/subsystems/$NQN_KAUTH/allowed_hosts/$h"; rmdir "$CFS/hosts/$h"
    done
    rmdir "$CFS/subsystems/$NQN_KAUTH"
}

our_auth_case() {  # NAME HOSTNQN WANT TEXT [args]; WANT: auth or auth-bidi (args for
    # interop_host.py), refused (args for blockfabric connect)
    local name=$1 hostnqn=$2 want=$3 text=$4 t0 ok=OK out rc bytes
    shift 4
    say "B/$name: blockfabric host (verbs) -> kernel nvmet with DH-HMAC-CHAP: $text"
    if [ "$KTARGET_AUTH" != 1 ]; then
        result "B/$name" SKIP "$AUTH_WHY CONFIG_NVME_TARGET_AUTH"; return 0
    fi
    t0=$(now)
    dmesg -C
    if [ "$want" = refused ]; then
        # the CLI: a clear error and a non-zero exit, and the kernel says why it refused
        out=$(timeout 60 "$BIN/blockfabric" connect -a "$IP" -s "$PORT" -q "$hostnqn" \
              --provider verbs -n "$NQN_KAUTH" "$@" 2>&1); rc=$?
        echo "$out" | tail -n 3
        dmesg | grep -i "nvmet" | tail -n 3
        [ $rc != 0 ] || { echo "blockfabric connect succeeded with a wrong secret"; ok=FAIL; }
        echo "$out" | grep -qi "authentic" || { echo "the error does not say authentication"; ok=FAIL; }
        result "B/$name" "$ok" "our host, $text: blockfabric connect rc=$rc, $(since "$t0") s"
        return 0
    fi
    out=$(timeout 120 "$PY" tests/lab/interop_host.py --traddr "$IP" --nqn "$NQN_KAUTH" \
          --hostnqn "$hostnqn" --check-device /dev/ram1 "$@") || ok=FAIL
    echo "$out"
    dmesg | grep -i "nvmet" | tail -n 6
    echo "$out" | grep -q "^authenticated: 3 queue" || { echo "not every queue authenticated"; ok=FAIL; }
    if [ "$want" = auth-bidi ]; then
        echo "$out" | grep -q "controller authenticated" \
            || { echo "controller not authenticated"; ok=FAIL; }
    fi
    bytes=$(echo "$out" | sed -n 's/^verified: \([0-9]*\) bytes on.*/\1/p')
    result "B/$name" "$ok" "our host, $text: ${bytes:-0} bytes verified on /dev/ram1, $(since "$t0") s"
}

our_auth_cases() {
    if [ "$KTARGET_AUTH" = 1 ] && ! kernel_auth_target_up; then
        result B/auth-target FAIL "nvmet configfs set-up with dhchap_key failed"; return
    fi
    our_auth_case auth-null "$HOST_AUTH" auth "hmac(sha256), NULL group" \
        --dhchap-secret "$KEY_AUTH"
    our_auth_case auth-wrong-secret "$HOST_AUTH" refused "wrong host secret" -S "$KEY_AUTH_WRONG"
    our_auth_case auth-ffdhe2048-bidi "$HOST_BIDI" auth-bidi \
        "hmac(sha384), ffdhe2048, controller authenticated" \
        --dhchap-secret "$KEY_BIDI" --dhchap-ctrl-secret "$KEY_CTRL"
    our_auth_case auth-wrong-ctrl-secret "$HOST_BIDI" refused \
        "our host refuses a controller with another secret" -S "$KEY_BIDI" -C "$KEY_CTRL_WRONG"
}

modprobe -a nvme-rdma > /dev/null 2>&1 || { echo "cannot load nvme-rdma"; exit 1; }
trace_on
echo "##### interop: $(uname -r), $(rdma link show 2>/dev/null | head -1)"
auth_setup
if start_target; then
    kernel_host_case single 1 && kernel_host_case multiqueue 2 && kernel_host_case incapsule 2
    kernel_auth_cases
    stop_target || fail=1
else
    result A/target FAIL "blockfabric-target did not start"
fi
our_host_case
our_auth_cases
summary "interop summary"
exit $fail

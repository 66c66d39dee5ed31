#!/bin/bash
# ceph-up.sh - throwaway single-node Ceph (1 mon + 1 osd, no mgr) on 127.0.0.1
# for the RBD tests (tests/ceph/conftest.py).  Debian 12, Ceph Pacific 16.2.x packages
# (the Makefile's DEB_PKGS installs them):
#   ceph-mon ceph-osd ceph-common python3-rbd python3-rados
# About 1.4 s on memstore.  Pitfalls it handles: no mgr (so health is kept OK and every
# `ceph` call is wrapped in timeout), paxos propose interval 0.1 (7.5 s -> 1.4 s), size-1
# pools, low disk warnings off, client timeouts set (librados ignores connect(timeout=)).
#
# usage: ceph-up.sh [DIR]        (DIR must not exist or be empty; default: mktemp -d)
# env:   CEPH_OBJECTSTORE=memstore|bluestore   (default memstore)
#        CEPH_MON_PORT=<port>                  (default: a free random port)
#        CEPH_POOL=rbd CEPH_IMAGE=img CEPH_IMAGE_SIZE=1G  (CEPH_IMAGE= empty: no image)
#        CEPH_STORE_BYTES=4294967296           (memstore RAM cap / bluestore sparse file size)
#        CEPH_UP_TIMEOUT=60                    (overall budget, seconds)
#        CEPH_CMD_TIMEOUT=20                   (each `ceph` command; the lab's TCG guest
#                                               needs more: its Python CLI starts slowly)
#        CEPH_AUTH=none|cephx                  (default none; cephx: keys for mon., osd.0 and
#                                               client.admin, whose keyring DIR/keyring the
#                                               conf names for every client)
# prints "export CEPH_CONF=..." lines on stdout (also written to DIR/env);
# everything else goes to stderr.  Exit status != 0 => cluster not usable
# (daemons already started are stopped again unless CEPH_KEEP_ON_FAIL=1).
set -euo pipefail

STORE=${CEPH_OBJECTSTORE:-memstore}
POOL=${CEPH_POOL:-rbd}
IMAGE=${CEPH_IMAGE-img}
IMAGE_SIZE=${CEPH_IMAGE_SIZE:-1G}
STORE_BYTES=${CEPH_STORE_BYTES:-4294967296}
BUDGET=${CEPH_UP_TIMEOUT:-60}
HERE=$(cd "$(dirname "$0")" && pwd)

now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $(( t / 1000 )); }
T0=$(now_ms)
log() { local e=$(( $(now_ms) - T0 )); printf '[ceph-up %3d.%03ds] %s\n' $((e/1000)) $((e%1000)) "$*" >&2; }
left() { local l=$(( BUDGET - ($(now_ms) - T0) / 1000 )); [ "$l" -gt 1 ] && echo "$l" || echo 1; }

DIR=${1:-$(mktemp -d "${TMPDIR:-/tmp}/ceph.XXXXXX")}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
[ -z "$(ls -A "$DIR")" ] || { echo "ceph-up: $DIR is not empty" >&2; exit 2; }
mkdir -p "$DIR"/{mon,osd,run,log}

fail() {
  log "FAILED: $*"
  tail -n 20 "$DIR"/log/*.log >&2 2>/dev/null || true
  if [ "${CEPH_KEEP_ON_FAIL:-0}" != 1 ]; then "$HERE/ceph-down.sh" "$DIR" >&2 || true; fi
  exit 1
}
trap 'fail "error at line $LINENO"' ERR

# --- port: free TCP port on loopback (msgr2 only) -----------------------
# Below the ephemeral range (ip_local_port_range): there no client socket gets its source
# port and no bind(0) of a test lands, so nothing takes the port between this check and the
# monitor's bind (a port in that range once failed: "bind unable to bind ... Address already
# in use", taken by another test's connection).  Any socket on it, not only a listener,
# makes it busy.
if [ -n "${CEPH_MON_PORT:-}" ]; then
  PORT=$CEPH_MON_PORT
else
  read -r EPHEMERAL_LOW _ < /proc/sys/net/ipv4/ip_local_port_range
  if [ "$EPHEMERAL_LOW" -gt 11024 ]; then
    FIRST=10000 SPAN=$(( EPHEMERAL_LOW - 10000 ))
  else
    FIRST=20000 SPAN=20000      # an unusual range: as before
  fi
  for _ in $(seq 50); do
    PORT=$(( FIRST + RANDOM % SPAN ))
    ss -Htan "sport = :$PORT" | grep -q . || break
  done
fi

FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)
CONF=$DIR/ceph.conf
AUTH=${CEPH_AUTH:-none}
KEYRING=/dev/null
case $AUTH in
  none) ;;
  cephx)
    # every key made here (no monitor needed): the monitor's mkfs imports DIR/keyring
    KEYRING=$DIR/keyring
    ceph-authtool --create-keyring "$KEYRING" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$KEYRING" --gen-key -n client.admin --cap mon 'allow *' \
      --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
    OSD_KEY=$(ceph-authtool --gen-print-key)
    ;;
  *) echo "ceph-up: CEPH_AUTH=$AUTH: none or cephx" >&2; exit 2 ;;
esac
cat > "$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$PORT]
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind msgr2 = true
auth cluster required = $AUTH
auth service required = $AUTH
auth client required = $AUTH
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
keyring = $KEYRING
# single OSD: replicate across OSDs (type 0), not hosts; size 1 pools
osd crush chooseleaf type = 0
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
# silence health checks that are meaningless for a throwaway cluster
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
mon warn on too few osds = false
mon data avail warn = 2
mon data avail crit = 1
# no ceph-mgr: otherwise HEALTH_WARN "no active mgr" 120 s after mkfs (then ERR)
mon mgr mkfs grace = 31536000
mon mgr inactive grace = 31536000
# keep it light
debug ms = 0
log to stderr = false
err to stderr = true
log flush on exit = false

[mon]
# daemons only: clients (the target, rbd, the tests) sharing one name would collide
admin socket = $DIR/run/\$name.asok
mon data = $DIR/mon/\$name
keyring = $DIR/mon/\$name/keyring
mon cluster log file = $DIR/log/cluster.log
# OSD may be the only one and will not be marked out
mon osd min in ratio = 0
# commit map changes every 0.1 s instead of 1 s: ~9 osdmap epochs during setup
paxos propose interval = 0.1
paxos min wait = 0.01

[osd]
admin socket = $DIR/run/\$name.asok
osd data = $DIR/osd/\$name
keyring = $DIR/osd/\$name/keyring
osd objectstore = $STORE
osd op num shards = 1
osd op num threads per shard = 2
# memstore
memstore device bytes = $STORE_BYTES
memstore page set = true
memstore page size = 4096
# bluestore on a sparse file (no block device needed)
bluestore block path = $DIR/osd/\$name/block.file
bluestore block create = true
bluestore block size = $STORE_BYTES
bluestore block db create = false
bluestore block wal create = false
bluestore cache autotune = false
bluestore cache size = 134217728
bluestore fsck on mount = false
bdev enable discard = false

[client]
rbd cache = false
client mount timeout = 15
rados mon op timeout = 30
rados osd op timeout = 30
EOF
export CEPH_CONF=$CONF
CMD_TIMEOUT=${CEPH_CMD_TIMEOUT:-20}
C() { timeout "$CMD_TIMEOUT" ceph --conf "$CONF" --connect-timeout "$((CMD_TIMEOUT - 5))" "$@"; }

# --- monitor -----------------------------------------------------------
log "fsid $FSID, mon 127.0.0.1:$PORT, store $STORE, dir $DIR"
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$PORT]" "$DIR/monmap" >/dev/null
timeout 30 ceph-mon --conf "$CONF" -i a --mkfs --monmap "$DIR/monmap" --keyring "$KEYRING" \
  >"$DIR/log/mon-mkfs.out" 2>&1 || fail "ceph-mon --mkfs (see $DIR/log/mon-mkfs.out)"
timeout 30 ceph-mon --conf "$CONF" -i a >"$DIR/log/mon.out" 2>&1 || fail "ceph-mon start"
log "mon started (pid $(cat "$DIR/run/mon.a.pid" 2>/dev/null))"

# --- OSD ---------------------------------------------------------------
mkdir -p "$DIR/osd/osd.0"
if [ "$AUTH" = cephx ]; then
  printf '{"cephx_secret": "%s"}' "$OSD_KEY" > "$DIR/osd-secret.json"
  OSD_ID=$(C osd new "$OSD_UUID" -i "$DIR/osd-secret.json")   # registers osd.0's key
  ceph-authtool --create-keyring "$DIR/osd/osd.0/keyring" -n osd.0 --add-key "$OSD_KEY" \
    >/dev/null
else
  OSD_ID=$(C osd new "$OSD_UUID")        # blocks until the mon answers (quorum of 1)
fi
[ "$OSD_ID" = 0 ] || fail "unexpected osd id '$OSD_ID'"
timeout 60 ceph-osd --conf "$CONF" -i 0 --mkfs --osd-uuid "$OSD_UUID" \
  >"$DIR/log/osd-mkfs.out" 2>&1 || fail "ceph-osd --mkfs (see $DIR/log/osd-mkfs.out)"
timeout 30 ceph-osd --conf "$CONF" -i 0 >"$DIR/log/osd.out" 2>&1 || fail "ceph-osd start"
log "osd started (pid $(cat "$DIR/run/osd.0.pid" 2>/dev/null)), waiting for up"
until C osd dump -f json 2>/dev/null | grep -q '"up":1'; do
  [ "$(left)" -gt 1 ] || fail "osd.0 did not come up"
  sleep 0.2
done
log "osd.0 up"

# --- pool + image ------------------------------------------------------
C osd pool create "$POOL" 8 8 replicated >/dev/null 2>&1
timeout "$(left)" rbd --conf "$CONF" pool init "$POOL"   # waits for PGs to go active
log "pool '$POOL' ready"
if [ -n "$IMAGE" ]; then
  timeout "$(left)" rbd --conf "$CONF" create --size "$IMAGE_SIZE" "$POOL/$IMAGE"
  log "image $POOL/$IMAGE ($IMAGE_SIZE) created"
fi

# --- health ------------------------------------------------------------
until H=$(C health 2>/dev/null) && [ "${H%% *}" = HEALTH_OK ]; do
  [ "$(left)" -gt 1 ] || fail "health: $H"
  sleep 0.2
done
log "$H"
trap - ERR
printf 'export CEPH_CONF=%s\nexport CEPH_DIR=%s\n' "$CONF" "$DIR" | tee "$DIR/env"

"""Failover of ANA groups between the gateways of a group, coordinated through Ceph itself.

RADOS objects in ``gateway.ceph.pool`` (prefix ``blockfabric.gateway.<group>``):

- ``.ana.<g>``: one per ANA group.  Its exclusive lock ``owner`` (cookie: the gateway name)
  with a duration of ``gateway.lease`` seconds *is* the ownership of group g: the owner
  renews it every ``renew_interval``; the xattr ``home`` names the gateway that lists g in
  its ``ana_groups``.
- ``.gw.<name>``: the lock ``alive`` on it, held and renewed the same way, says that gateway
  is up (others probe it: a lock they can take is a gateway that is not).
- ``.gateways``: omap name -> "cntlid_min-cntlid_max": a gateway whose range overlaps
  another's refuses to start.
- ``.notify``: every gateway watches it; a change of ownership is notified there, so the
  others look at once instead of at their next renewal.

Rules, per group g, at every step (each ``renew_interval``, or at once on a notify):

- owner, home is another gateway and that gateway is alive: hand back: report g as
  ``others`` (on the reactor, waited for) *then* unlock; the home takes it on the notify.
  No moment has two optimized owners: a gateway is optimized only while it holds the lock.
- owner otherwise: renew.  A renewal that fails because someone else holds the lock ends
  ownership; one that cannot reach Ceph does not, but the lease deadline (counted from
  before the renewal was sent, so earlier than the OSD's) ends it on the reactor.
- not owner: try the lock if g is a home group, or g's home is not alive (failover), or g
  has no home.  A dead owner's lock expires ``lease`` after its last renewal, so a survivor
  takes its groups within lease + renew_interval (+ one RADOS round trip).

All librados calls happen on this module's thread with librados' own timeouts; results go
to the reactor with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from blockfabric.errors import BlockfabricError
from blockfabric.target import config as cfg
from blockfabric.target.rbdvolume import caps_hint

if TYPE_CHECKING:
    from blockfabric.target.ana import Ana
    from blockfabric.target.namespace import Namespace
    from blockfabric.fabric.reactor import Reactor

log = logging.getLogger(__name__)

LOCK_OWNER = "owner"
LOCK_ALIVE = "alive"
LOCK_FLAG_RENEW = 0x1       # LIBRADOS_LOCK_FLAG_RENEW (MAY_RENEW)
#: Seconds before the OSD would expire it that an owner stops reporting a group optimized.
LEASE_MARGIN = 0.5


class GatewayError(BlockfabricError):
    """The gateway cannot join its group (Ceph unreachable, overlapping cntlid range)."""


def refuse_exclusive_lock(namespaces: Iterable[Namespace]) -> None:
    """A gateway group writes each image through several gateways at once: an image with
    the exclusive-lock feature would pass its lock back and forth on every write, and a
    SIGKILLed gateway's lock would block the survivors' writes until its watch times out
    (30 s), longer than any failover.  Refuse such an image, saying how to fix it."""
    for ns in namespaces:
        if getattr(ns.backend, "exclusive_lock", False):
            name = ns.conf.rbd.spec
            raise GatewayError(
                f"nsid {ns.nsid}: rbd image {name} has the exclusive-lock feature, which a "
                "gateway group cannot share (its gateways write the image concurrently; "
                f"docs/ceph.md): rbd feature disable {name} fast-diff object-map "
                "exclusive-lock")


class Coordinator:
    """The Ceph side of one gateway: a thread that holds, renews, takes and hands back the
    ANA group leases, and tells :class:`~blockfabric.target.ana.Ana` (on the reactor)."""

    def __init__(self, reactor: Reactor, ana: Ana, gw: cfg.Gateway) -> None:
        self.reactor = reactor      # reached from its thread by call_soon_threadsafe only
        self.ana = ana
        self.gw = gw
        self.prefix = f"blockfabric.gateway.{gw.group}"
        self.held: set[int] = set()
        self._homes: dict[int, str | None] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cluster: Any = None
        self._io: Any = None
        self._watch: Any = None
        self._rados: Any = None
        self._announce = False      # notify the others at the next step (after a reload)

    # -- objects ----------------------------------------------------------------------
    def group_obj(self, group: int) -> str:
        return f"{self.prefix}.ana.{group}"

    def alive_obj(self, name: str) -> str:
        return f"{self.prefix}.gw.{name}"

    # -- start and stop ----------------------------------------------------------------
    def connect(self) -> None:
        """Reach the cluster and register (at start, before the listeners open): raises
        GatewayError within ``ceph.connect_timeout``."""
        import rados
        self._rados = rados
        c = self.gw.ceph
        options = {"client_mount_timeout": str(c.connect_timeout),
                   "rados_mon_op_timeout": str(c.op_timeout),
                   "rados_osd_op_timeout": str(c.op_timeout)}
        if c.keyring:
            options["keyring"] = c.keyring
        try:
            self._cluster = rados.Rados(conffile=c.ceph_conf, name=c.client, conf=options)
            self._cluster.connect(timeout=c.connect_timeout)
            self._io = self._cluster.open_ioctx(c.pool)
            if c.namespace:
                self._io.set_namespace(c.namespace)
            self._register()
            for group in self.gw.ana_groups:
                self._io.set_xattr(self.group_obj(group), "home", self.gw.name.encode())
            self._io.write_full(f"{self.prefix}.notify", b"")
            self._watch = self._io.watch(f"{self.prefix}.notify", self._notified)
        except rados.Error as exc:
            self._shutdown_cluster()
            raise GatewayError(f"gateway {self.gw.name}: Ceph pool {c.pool} via "
                               f"{c.ceph_conf} as {c.client}: {exc}"
                               f"{caps_hint(getattr(exc, 'errno', None), c.pool, c.namespace)}"
                               ) from exc
        except GatewayError:
            self._shutdown_cluster()
            raise

    def _register(self, gw: cfg.Gateway | None = None) -> None:
        """Record ``gw``'s controller id range (default: this gateway's) in the group,
        refusing one that overlaps another gateway's."""
        rados, io, gw = self._rados, self._io, gw or self.gw
        obj = f"{self.prefix}.gateways"
        with rados.ReadOpCtx() as op:
            it, _ret = io.get_omap_vals(op, "", "", 1024)
            try:
                io.operate_read_op(op, obj)
                entries = [(k, v.decode()) for k, v in it]
            except rados.ObjectNotFound:
                entries = []
        for name, span in entries:
            lo, _, hi = span.partition("-")
            if name != gw.name and gw.overlaps((int(lo), int(hi))):
                raise GatewayError(
                    f"gateway {gw.name}: cntlid range {gw.cntlid_min}-{gw.cntlid_max} overlaps "
                    f"gateway {name}'s {span} in group {gw.group} (controller ids must be "
                    f"unique in the group; a retired gateway is removed with: rados -p "
                    f"{gw.ceph.pool} rmomapkey {obj} {name})")
        with rados.WriteOpCtx() as op:
            io.set_omap(op, (gw.name,), (f"{gw.cntlid_min}-{gw.cntlid_max}".encode(),))
            io.operate_write_op(op, obj)

    # -- reload -----------------------------------------------------------------------
    def prepare(self, new: cfg.Gateway, old: cfg.Gateway | None = None) -> None:
        """The part of a reload from ``old`` (default: the running one) to ``new`` that can
        fail (on the reactor, bounded by the op timeout): register a changed controller id
        range (refused if it overlaps another gateway's), and say in the cluster which
        groups are now this gateway's home (the ``home`` xattr; a dropped home group's is
        removed if it still names this gateway: whoever holds it keeps it until its new
        home asks).  Raises GatewayError."""
        rados, old = self._rados, old or self.gw
        try:
            if (new.cntlid_min, new.cntlid_max) != (old.cntlid_min, old.cntlid_max):
                self._register(new)
            for group in sorted(set(new.ana_groups) - set(old.ana_groups)):
                self._io.set_xattr(self.group_obj(group), "home", new.name.encode())
            for group in sorted(set(old.ana_groups) - set(new.ana_groups)):
                try:
                    if self._io.get_xattr(self.group_obj(group), "home") == new.name.encode():
                        self._io.rm_xattr(self.group_obj(group), "home")
                except (rados.ObjectNotFound, rados.NoData):
                    pass
        except rados.Error as exc:
            raise GatewayError(f"gateway {new.name}: Ceph pool {new.ceph.pool}: {exc}") from exc

    def rollback(self, new: cfg.Gateway) -> None:
        """A reload prepared for ``new`` was rejected after all: the range and the home
        groups as they were (best effort: the next reload or start rewrites them)."""
        try:
            self.prepare(self.gw, old=new)
        except GatewayError as exc:
            log.warning("gateway %s: restoring its registration: %s", self.gw.name, exc)

    def reconfigure(self, new: cfg.Gateway) -> None:
        """Commit a reload: the thread uses ``new`` from its next step, which comes now and
        tells the other gateways to look again (a home group moved: its holder hands it
        back to its new home on that notify)."""
        self.gw = new
        self._homes = {}
        self._announce = True
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Planned stop: give every held group up (so survivors take it at once, not after
        the lease), then disconnect.  Bounded by the op timeouts."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._shutdown_cluster()

    def _shutdown_cluster(self) -> None:
        if self._watch is not None:
            try:
                self._watch.close()
            except Exception as exc:  # teardown continues
                log.debug("gateway: closing the watch: %s", exc)
            self._watch = None
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None

    def _notified(self, *_args: Any) -> None:
        """Another gateway changed something: look now, and read the homes again (a
        reload may have moved one)."""
        self._homes = {}
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:
                log.warning("gateway %s: %s", self.gw.name, exc)
            # at a fixed rate (a slow step does not stretch the failover bound), or at once
            # on a notify
            due = max(due + self.gw.renew_interval, time.monotonic())
            if self._wake.wait(due - time.monotonic()):
                due = time.monotonic()
            self._wake.clear()
        self._release_all()

    def _step(self) -> None:
        rados = self._rados
        self._lock(self.alive_obj(self.gw.name), LOCK_ALIVE, renew=True)
        changed, self._announce = self._announce, False
        for group in sorted(self.ana.groups | self.held):
            if self._stop.is_set():
                return
            if group in self.held:
                if self._should_hand_back(group):
                    changed |= self._hand_back(group)
                    continue
                started = time.monotonic()
                try:
                    self._lock(self.group_obj(group), LOCK_OWNER, renew=True)
                except (rados.ObjectBusy, rados.ObjectExists) as exc:
                    self.held.discard(group)
                    self._post(group, False, why=f"lease taken by another gateway ({exc})")
                    continue
                except rados.Error as exc:
                    log.warning("gateway %s: renewing ANA group %d: %s (optimized until the "
                                "lease runs out)", self.gw.name, group, exc)
                    continue
                self._renewed(group, started)
            elif self._may_take(group):
                started = time.monotonic()
                try:
                    self._lock(self.group_obj(group), LOCK_OWNER, renew=False)
                except (rados.ObjectBusy, rados.ObjectExists):
                    continue
                self.held.add(group)
                self._post(group, True, started + self.gw.lease - LEASE_MARGIN,
                           why="home group" if group in self.gw.ana_groups
                           else "failover: its home gateway is down")
                changed = True
        if changed:
            self._notify()

    def _lock(self, obj: str, name: str, renew: bool, cookie: str | None = None,
              duration: int | None = None) -> None:
        self._io.lock_exclusive(obj, name, cookie or self.gw.name, desc="blockfabric gateway",
                                duration=duration or self.gw.lease,
                                flags=LOCK_FLAG_RENEW if renew else 0)

    def _home(self, group: int) -> str | None:
        homes = self._homes         # replaced (not cleared) by _notified on another thread
        home = homes.get(group)
        if home is None:
            try:
                home = self._io.get_xattr(self.group_obj(group), "home").decode() or None
            except self._rados.Error:
                home = None
            homes[group] = home
        return home

    def _alive(self, name: str) -> bool:
        """Whether gateway ``name`` holds its ``alive`` lock: probed by trying to take it
        for a second (and giving it straight back)."""
        rados, obj, cookie = self._rados, self.alive_obj(name), f"probe.{self.gw.name}"
        try:
            self._lock(obj, LOCK_ALIVE, renew=False, cookie=cookie, duration=1)
        except (rados.ObjectBusy, rados.ObjectExists):
            return True
        try:
            self._io.unlock(obj, LOCK_ALIVE, cookie)
        except rados.Error:
            pass
        return False

    def _may_take(self, group: int) -> bool:
        if group in self.gw.ana_groups:
            return True
        home = self._home(group)
        return home is None or home == self.gw.name or not self._alive(home)

    def _should_hand_back(self, group: int) -> bool:
        if group in self.gw.ana_groups:
            return False
        home = self._home(group)
        return home is not None and home != self.gw.name and self._alive(home)

    def _hand_back(self, group: int) -> bool:
        """Stop reporting ``group`` optimized (and wait for the reactor to have done it),
        then unlock: the home gateway takes it on the notify."""
        if not self._post(group, False, why="handed back to its home gateway", wait=True):
            return False
        self.held.discard(group)
        try:
            self._io.unlock(self.group_obj(group), LOCK_OWNER, self.gw.name)
        except self._rados.Error as exc:
            log.warning("gateway %s: unlocking ANA group %d: %s (it expires)", self.gw.name,
                        group, exc)
        return True

    def _release_all(self) -> None:
        """At a planned stop (the target has already reported every group ``others``, see
        Target.close): unlock, and tell the others to take them now."""
        if self._io is None:
            return
        for group in sorted(self.held):
            try:
                self._io.unlock(self.group_obj(group), LOCK_OWNER, self.gw.name)
            except self._rados.Error as exc:
                log.warning("gateway %s: unlocking ANA group %d: %s (it expires)",
                            self.gw.name, group, exc)
        self.held.clear()
        if True:
            try:
                self._io.unlock(self.alive_obj(self.gw.name), LOCK_ALIVE, self.gw.name)
            except self._rados.Error:
                pass
            self._notify(wait=True)

    def _renewed(self, group: int, started: float) -> None:
        deadline = started + self.gw.lease - LEASE_MARGIN
        self.reactor.call_soon_threadsafe(lambda: self.ana.renewed(group, deadline))

    def _post(self, group: int, owned: bool, deadline: float = 0.0, why: str = "",
              wait: bool = False) -> bool:
        done = threading.Event()

        def apply() -> None:
            self.ana.set_owned(group, owned, deadline, why)
            done.set()
        try:
            self.reactor.call_soon_threadsafe(apply)
        except Exception:   # the reactor is closed
            return False
        return done.wait(5.0) if wait else True

    def _notify(self, wait: bool = False) -> None:
        """Tell the other gateways to look now (off this thread: a notify waits for every
        watcher's answer, and a dead gateway's watch answers only when it times out)."""
        io = self._io

        def send() -> None:
            try:
                io.notify(f"{self.prefix}.notify", self.gw.name, 2000)
            except Exception as exc:
                log.debug("gateway notify: %s", exc)
        thread = threading.Thread(target=send, name="gateway-notify", daemon=True)
        thread.start()
        if wait:
            thread.join(2.5)

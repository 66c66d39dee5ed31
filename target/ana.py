"""Asymmetric Namespace Access on a gateway: which ANA groups this gateway owns, what that
makes every namespace's path state, the ANA log page, and the ANA change events.

Everything here runs on the reactor.  Ownership changes come from the Ceph coordinator
(:mod:`blockfabric.target.gateway`) through ``reactor.call_soon_threadsafe``; a lease that is
not renewed in time ends ownership here, on a reactor timer, whatever the coordinator thread
is doing (a Ceph call that hangs cannot keep a group optimized past its lease).

The per-I/O cost is one attribute read: each runtime namespace carries ``ana_status``, 0 when
this path may serve I/O, else the path-related status (ANA Inaccessible) to answer with.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Callable

from blockfabric.protocol import StatusCode
from blockfabric.protocol.identify import CMIC_ANA, CMIC_MULTI_CTRL, CMIC_MULTI_PORT
from blockfabric.protocol import logpages
from blockfabric.protocol.admin import AsyncNotice
from blockfabric.protocol.opcodes import LogPageId
from blockfabric.target import config as cfg

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Timer
    from blockfabric.target.controller import Controller
    from blockfabric.fabric.reactor import Reactor
    from blockfabric.target.namespace import Subsystem

log = logging.getLogger(__name__)

#: ANACAP: optimized, non-optimized, inaccessible, persistent loss and change reportable
#: (bits 0-4, nvmet's 0x1F).  Not bit 6 (ANAGRPID never changes while attached): a reload
#: may move a namespace to another ANA group, announced by an ANA change event (as nvmet
#: does when its ana_grpid changes).
ANACAP = 0x1F

_STATUS = {logpages.AnaState.INACCESSIBLE: StatusCode.ANA_INACCESSIBLE,
           logpages.AnaState.PERSISTENT_LOSS: StatusCode.ANA_PERSISTENT_LOSS,
           logpages.AnaState.CHANGE: StatusCode.ANA_TRANSITION}


class Ana:
    """This gateway's ANA state (one per target with a ``gateway`` section).
    ``subsystems``, ``controllers``: the target's (the live dicts: namespaces whose path
    state it sets, controllers it tells of a change)."""

    def __init__(self, reactor: Reactor, subsystems: dict[str, Subsystem],
                 controllers: dict[int, Controller], gw: cfg.Gateway) -> None:
        self.reactor = reactor
        self.subsystems = subsystems
        self.controllers = controllers
        self.gw = gw
        self.others = (logpages.AnaState.INACCESSIBLE if gw.others == "inaccessible"
                       else logpages.AnaState.NON_OPTIMIZED)
        self.chgcnt = 1
        #: group -> monotonic deadline of this gateway's lease (the groups it owns)
        self.owned: dict[int, float] = {}
        self.takeovers = 0          # groups taken (at start, failover, failback)
        self.releases = 0           # groups given up (hand-back, lost lease, shutdown)
        self.last_change: float | None = None
        #: Controllers told of an ANA change that have not read the ANA log since: no
        #: second event until they do (as the NVMe spec's event masking).
        self._told: weakref.WeakSet[Controller] = weakref.WeakSet()
        self._timer: Timer | None = None
        self.groups: frozenset[int] = frozenset(gw.ana_groups)
        #: called after every refresh: poll groups push the new state to their workers
        self.on_refresh: Callable[[], None] | None = None
        self.refresh()

    # -- state ------------------------------------------------------------------------
    def state(self, group: int) -> logpages.AnaState:
        return logpages.AnaState.OPTIMIZED if group in self.owned else self.others

    def refresh(self) -> None:
        """Recompute every namespace's group and path flag (at start, after a change of
        ownership, after a reload), and the set of groups the coordinator looks after."""
        groups = set(self.gw.ana_groups)
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                ns.ana_group = ns.conf.ana_group_id
                groups.add(ns.ana_group)
                ns.ana_status = _STATUS.get(self.state(ns.ana_group), 0)
        self.groups = frozenset(groups)
        if self.on_refresh is not None:
            self.on_refresh()

    def set_owned(self, group: int, owned: bool, deadline: float = 0.0,
                  why: str = "") -> None:
        """Take (optimized) or give up (``others``) ``group``; hosts hear of a change by
        an ANA change event."""
        if owned:
            fresh = group not in self.owned
            self.owned[group] = deadline
            if not fresh:
                return
            self.takeovers += 1
        else:
            if self.owned.pop(group, None) is None:
                return
            self.releases += 1
        self.changed(f"group={group} -> {self.state(group).name.lower()} ({why or '-'})")

    def changed(self, what: str) -> None:
        """The ANA log reads differently (an owner, ``others``, a namespace's group): a new
        change count, every path flag again, and an ANA change event to the hosts."""
        self.chgcnt += 1
        self.last_change = time.time()
        log.warning("ana: gateway=%s %s chgcnt=%d", self.gw.name, what, self.chgcnt)
        self.refresh()
        self._tell_hosts()

    def reconfigure(self, gw: cfg.Gateway) -> None:
        """A reload's new ``gateway`` section (what gateway.Coordinator.reconfigure does
        not: what this gateway reports for the groups it does not own)."""
        others = (logpages.AnaState.INACCESSIBLE if gw.others == "inaccessible"
                  else logpages.AnaState.NON_OPTIMIZED)
        self.gw = gw
        if others != self.others:
            self.others = others
            self.changed(f"others -> {gw.others} (reload)")
        else:
            self.refresh()

    def renewed(self, group: int, deadline: float) -> None:
        if group in self.owned:
            self.owned[group] = max(self.owned[group], deadline)

    def start(self) -> None:
        self._timer = self.reactor.call_later(0.25, self._check_leases)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_leases(self) -> None:
        now = time.monotonic()
        for group, deadline in list(self.owned.items()):
            if now >= deadline:
                self.set_owned(group, False, why="lease not renewed in time")
        self._timer = self.reactor.call_later(0.25, self._check_leases)

    # -- hosts ------------------------------------------------------------------------
    def _tell_hosts(self) -> None:
        for ctrl in list(self.controllers.values()):
            if ctrl.is_discovery or ctrl.dead or ctrl in self._told:
                continue
            self._told.add(ctrl)
            ctrl.notify(AsyncNotice.ANA_CHANGE, LogPageId.ANA)

    def log_page(self, ctrl: Controller, rgo: bool, retain: bool) -> bytes:
        """The ANA log page as ``ctrl`` sees it; reading it (without RAE) re-arms the
        ANA change event."""
        if not retain:
            self._told.discard(ctrl)
        members: dict[int, list[int]] = {}
        assert ctrl.subsystem is not None   # an ANA log page is read on an I/O controller
        for ns in ctrl.subsystem.namespaces.values():
            members.setdefault(ns.ana_group, []).append(ns.nsid)
        groups = [logpages.AnaGroupDescriptor(g, self.state(g), self.chgcnt, tuple(sorted(n)))
                  for g, n in sorted(members.items())]
        return logpages.pack_ana_log(self.chgcnt, groups, rgo)

    def identify(self) -> dict[str, int]:
        """Identify Controller fields for a member of a gateway group."""
        return {"cmic": CMIC_MULTI_PORT | CMIC_MULTI_CTRL | CMIC_ANA,
                "anatt": self.gw.anatt, "anacap": ANACAP,
                "anagrpmax": cfg.ANA_GROUP_MAX, "nanagrpid": cfg.ANA_GROUP_MAX,
                # the Linux host's ANA set-up requires 0 < MNAN <= NN
                "mnan": cfg.MAX_NSID}

    def snapshot(self) -> dict[str, object]:
        return {"name": self.gw.name, "group": self.gw.group,
                "cntlid_range": [self.gw.cntlid_min, self.gw.cntlid_max],
                "home_groups": sorted(self.gw.ana_groups), "chgcnt": self.chgcnt,
                "groups": {g: self.state(g).name.lower() for g in sorted(self.groups)},
                "takeovers": self.takeovers, "releases": self.releases,
                "last_change": self.last_change}

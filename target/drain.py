"""The orderly stop (SIGTERM): stop accepting, let the commands in flight finish while new
ones are held, flush every volume, disconnect every host, stop the reactor.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from blockfabric.fabric.reactor import Reactor
from blockfabric.sdnotify import sd_notify
from blockfabric.target.listeners import Listeners
from blockfabric.target.namespace import Namespace, Subsystem
from blockfabric.target.registry import ControllerRegistry
from blockfabric.target.services import Owner

log = logging.getLogger(__name__)

#: How long a drain waits for commands in flight.  Below the unit's TimeoutStopSec (30 s),
#: so a stop ends in exit 0.
DRAIN_TIMEOUT = 20.0
DRAIN_POLL = 0.005


def flush_subsystem(subsystem: Subsystem | None) -> None:
    """Flush every volume of ``subsystem`` (an error is logged, the others still flushed)."""
    if subsystem is None:
        return
    for ns in subsystem.namespaces.values():
        try:
            ns.backend.flush()
        except OSError as exc:
            log.error("flushing %s ns %d: %s", subsystem.nqn, ns.nsid, exc)


def count_inflight(subsystems: Iterable[Subsystem], closing: Iterable[Namespace]) -> int:
    """Commands executing on any namespace (held ones, and AERs, are not counted)."""
    nss = [ns for sub in subsystems for ns in sub.namespaces.values()]
    return sum(ns.stats.inflight for ns in [*nss, *closing])


def start_drain(*, reactor: Reactor, owner: Owner, listeners: Listeners,
          registry: ControllerRegistry, subsystems: dict[str, Subsystem],
          inflight: Callable[[], int], timeout: float = DRAIN_TIMEOUT,
          groups_left: Callable[[], int] = lambda: 0) -> None:
    """Stop accepting, let the commands in flight finish (new ones are held, not run:
    ``owner.draining``, which every controller reads), flush every volume, disconnect every
    host, and stop the reactor.  ``groups_left``: poll-group workers whose own drain has not
    finished (their commands are theirs to count).  Asked again while draining: stop at
    once."""
    if owner.draining:
        log.warning("stop requested again while draining: stopping now")
        reactor.stop()
        return
    owner.draining = True
    sd_notify("STOPPING=1")
    for entry in list(listeners.entries):
        listeners.close_one(entry)
    groups = groups_left()
    log.info("draining: listeners closed, %d command(s) in flight, %d controller(s)%s",
             inflight(), len(registry.controllers),
             f", {groups} poll group(s) draining" if groups else "")
    deadline = time.monotonic() + timeout

    def check() -> None:
        left, groups = inflight(), groups_left()
        if (left or groups) and time.monotonic() < deadline:
            reactor.call_later(DRAIN_POLL, check)
            return
        if left or groups:
            log.error("drain: %d command(s) still in flight%s after %.0f s; stopping anyway",
                      left, f" and {groups} poll group(s) not drained" if groups else "",
                      timeout)
        for sub in subsystems.values():
            flush_subsystem(sub)
        for ctrl in list(registry.controllers.values()):
            registry.destroy_controller(ctrl, "target stopping")
        log.info("drained: volumes flushed, hosts disconnected")
        reactor.stop()
    check()

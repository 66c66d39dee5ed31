"""Namespace changes on a running target: a namespace retired once its commands are done,
a resize between commands (new ones held meanwhile), and the hosts told by a Namespace
Attribute Changed event.  A reload (:mod:`.reloader`) and the RBD size watch
(:mod:`.rbdvolume`) both use them; everything here runs on the reactor.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from blockfabric.fabric.reactor import Reactor
from blockfabric.protocol.admin import AsyncNotice
from blockfabric.protocol.opcodes import LogPageId
from blockfabric.target import config as cfg
from blockfabric.target.namespace import Namespace, Subsystem

if TYPE_CHECKING:
    from blockfabric.target.controller import Controller

log = logging.getLogger(__name__)

#: How long a resize or removal waits for a namespace's I/O to finish, and how often it looks.
IDLE_TIMEOUT = 10.0
IDLE_POLL = 0.005


def close_namespace(ns: Namespace) -> None:
    """Flush (an error is logged) and close."""
    try:
        ns.backend.flush()
    except OSError as exc:
        log.error("flushing nsid=%d: %s", ns.nsid, exc)
    ns.close()


class NamespaceChanges:
    """Namespace changes of one target.  ``controllers``: the target's controllers by cntlid
    (the live dict: those to tell); :attr:`closing`: retired namespaces not closed yet."""

    def __init__(self, reactor: Reactor, controllers: dict[int, Controller]) -> None:
        self.reactor = reactor
        self.controllers = controllers
        self.closing: list[Namespace] = []

    def close(self) -> None:
        """Close the retired namespaces now (the target is stopping)."""
        for ns in self.closing:
            close_namespace(ns)
        self.closing.clear()

    def notify_ns_changed(self, sub: Subsystem, nsids: tuple[int, ...]) -> None:
        """Namespace Attribute Changed to every controller of ``sub`` (spec sheet 10)."""
        if not nsids:
            return
        for ctrl in list(self.controllers.values()):
            if ctrl.subsystem is sub and not ctrl.dead:
                ctrl.notify(AsyncNotice.NS_ATTR_CHANGED, LogPageId.CHANGED_NS, nsids)

    def retire(self, sub: Subsystem, ns: Namespace) -> None:
        """A namespace left the configuration: no new command finds it; close it once the
        commands already running on it are done."""
        sub.retired.add(ns.stats)
        self.closing.append(ns)
        self.when_idle(ns, lambda: (close_namespace(ns),  # type: ignore[func-returns-value]
                                    self.closing.remove(ns)),  # type: ignore[func-returns-value]
                       f"closing subnqn={sub.nqn} nsid={ns.nsid}")

    def resize(self, sub: Subsystem, ns: Namespace, conf: cfg.Namespace) -> None:
        """Hold new commands, wait for those running, resize, release, tell the hosts."""
        ns.paused = True

        def resize() -> None:
            old = ns.size
            try:
                ns.resize(conf)
            except OSError as exc:
                log.error("resize failed: subnqn=%s nsid=%d: %s", sub.nqn, ns.nsid, exc)
            else:
                log.info("namespace resized: subnqn=%s nsid=%d %d -> %d bytes", sub.nqn,
                         ns.nsid, old, ns.size)
            finally:
                ns.paused = False
                held, ns.held = ns.held, []
                for run in held:
                    run()
            self.notify_ns_changed(sub, (ns.nsid,))

        self.when_idle(ns, resize, f"resizing subnqn={sub.nqn} nsid={ns.nsid}")

    def when_idle(self, ns: Namespace, action: Callable[[], Any], what: str,
                  timeout: float = IDLE_TIMEOUT) -> None:
        """Run ``action`` on the reactor once ``ns`` has no command in flight.  A
        BufferError means a posted RDMA operation still holds the volume's memory: retry."""
        deadline = time.monotonic() + timeout

        def attempt() -> None:
            late = time.monotonic() >= deadline
            if ns.stats.inflight and not late:
                self.reactor.call_later(IDLE_POLL, attempt)
                return
            try:
                action()
            except BufferError:
                if late:
                    log.error("%s: the volume's memory is still in use after %.0f s", what,
                              timeout)
                    return
                self.reactor.call_later(IDLE_POLL, attempt)
        attempt()

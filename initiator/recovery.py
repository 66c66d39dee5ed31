"""Reconnecting a lost controller (nvme-cli's reconnect_delay and ctrl_loss_tmo semantics).

The states and their transitions are data (:data:`CTRL_TRANSITIONS`, in the style of
:mod:`blockfabric.protocol.controller`); :class:`Recovery` is the controller's part that
holds I/O commands lost with a queue, runs the reconnect loop on its own thread, and
re-issues what it held (or fails it with :class:`ControllerLost` once it gives up).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from blockfabric.initiator.errors import ControllerLost, NvmeError
from blockfabric.initiator.multipath import format_path

from blockfabric.protocol import (KeepAlive, StatusCode)


log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from blockfabric.initiator.io import HeldCommand
    from blockfabric.initiator.parts import ControllerParts
else:
    ControllerParts = object    # (the parts' description, for the type checker: parts.py)


class CtrlState(str, enum.Enum):
    """The host controller's life, as the Linux host's LIVE / CONNECTING / DELETING."""

    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass
class RecoveryStats:
    """What reconnecting did, for ``.status``, metrics and tests that must show I/O was held
    and re-issued across a fault rather than merely absent."""

    losses: int = 0             # times the controller was found dead
    attempts: int = 0           # reconnect attempts (each tries every path once)
    reconnects: int = 0         # successful reconnects
    failovers: int = 0          # reconnects that landed on a path other than the lost one
    held: int = 0               # commands held while reconnecting (new or in flight)
    retried: int = 0            # held commands re-issued after a reconnect
    failed: int = 0             # held commands failed after ctrl_loss_tmo
    path_errors: int = 0        # path-related statuses (SCT 3, ANA) re-routed (multipath)
    last_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class CtrlEvent(enum.Enum):
    """What happens to a controller, as :data:`CTRL_TRANSITIONS` takes it."""

    CONNECTED = "connected"         # the first connect finished
    RETRY_LATER = "retry later"     # a path's first connect failed: reconnect in background
    REFUSED = "refused"             # a path's first connect refused for good (DNR)
    LOST = "lost"                   # a queue, a send or the keep-alive: the target is gone
    RECONNECTED = "reconnected"     # a reconnect established every queue again
    GAVE_UP = "gave up"             # ctrl_loss_tmo ran out, or the target said DNR
    CLOSE = "close"                 # close() (also while reconnecting)


#: The controller's life, as the Linux host's (nvme_change_ctrl_state): (state, event) ->
#: the new state.  A pair not in the table changes nothing (a loss seen while already
#: reconnecting, a close of a closed controller).
CTRL_TRANSITIONS: dict[tuple[CtrlState, CtrlEvent], CtrlState] = {
    (CtrlState.CONNECTING, CtrlEvent.CONNECTED): CtrlState.LIVE,
    (CtrlState.CONNECTING, CtrlEvent.RETRY_LATER): CtrlState.RECONNECTING,
    (CtrlState.CONNECTING, CtrlEvent.REFUSED): CtrlState.FAILED,
    (CtrlState.LIVE, CtrlEvent.LOST): CtrlState.RECONNECTING,
    (CtrlState.RECONNECTING, CtrlEvent.RECONNECTED): CtrlState.LIVE,
    (CtrlState.RECONNECTING, CtrlEvent.GAVE_UP): CtrlState.FAILED,
    (CtrlState.CONNECTING, CtrlEvent.CLOSE): CtrlState.CLOSED,
    (CtrlState.LIVE, CtrlEvent.CLOSE): CtrlState.CLOSED,
    (CtrlState.RECONNECTING, CtrlEvent.CLOSE): CtrlState.CLOSED,
    (CtrlState.FAILED, CtrlEvent.CLOSE): CtrlState.CLOSED,
}


class Recovery(ControllerParts):
    """The controller's reconnecting: holding I/O lost with a queue, the reconnect loop,
    re-issuing or failing what was held, and the keep-alive that notices a silent loss."""

    def _move(self, event: CtrlEvent) -> bool:
        """Apply ``event`` (with ``_state_lock`` held): True if the state changed."""
        new = CTRL_TRANSITIONS.get((self.state, event))
        if new is None:
            return False
        self.state = new
        return True

    def _dispatch(self, req: HeldCommand) -> None:
        """Send ``req`` on an I/O queue, or hold it while the controller reconnects."""
        with self._state_lock:
            state = self.state
            if state == CtrlState.RECONNECTING:
                self._held.append(req)
                self.recovery.held += 1
                return
            req.gen = self._gen
        if state in (CtrlState.FAILED, CtrlState.CLOSED):
            self._lose([req], ControllerLost(f"controller {state.value}: "
                                             f"{self.recovery.last_reason}"))
            return
        try:
            req.send(self, self.io_queue())
        except ConnectionError as exc:
            self._hold(req, exc)

    def _lose(self, reqs: list, exc: BaseException) -> None:
        """Fail ``reqs`` for good with ``exc``, on the reactor thread while it runs (where
        every other completion of theirs runs, so that their users need no lock)."""
        if not reqs:
            return

        def fail() -> None:
            for req in reqs:
                try:
                    req.lost(exc)
                except Exception:  # one user's failure must not cost the others theirs
                    log.exception("failing a held command")
        try:
            self.reactor.call_sync(fail, timeout=10)
        except TimeoutError:
            fail()

    def _hold(self, req: HeldCommand, error: BaseException) -> None:
        """A command lost with its queue (``error``, a QueueDead or the ConnectionError
        of a send): keep it for the reconnect (or fail it, if reconnecting is over)."""
        reason = str(error)
        req.held += 1
        with self._state_lock:
            state = self.state
            stale = state == CtrlState.LIVE and req.gen != self._gen
            if state in (CtrlState.LIVE, CtrlState.RECONNECTING) and not stale:
                self._held.append(req)
                self.recovery.held += 1
                self._start_recovery(reason)
                return
        if stale:                       # lost with a queue of an earlier connection
            with self._state_lock:
                self.recovery.retried += 1
            self._dispatch(req)
            return
        lost = ControllerLost(f"controller {state.value}: {reason}")
        lost.__cause__ = error          # the queue's own error (an RdmaError's WC status)
        self._lose([req], lost)

    def _lost(self, reason: str) -> None:
        """Any sign the target is gone (keep-alive, a queue error): start reconnecting."""
        with self._state_lock:
            self._start_recovery(reason)

    def reconnect_in_background(self, reason: str) -> None:
        """A path whose first connect failed: keep trying it (reconnect_delay,
        ctrl_loss_tmo) as if it had been lost, while the other paths serve."""
        with self._state_lock:
            if not self._closed and self._move(CtrlEvent.RETRY_LATER):
                self._begin_reconnect(reason)

    def _tell_state(self) -> None:
        for listener in list(self.state_listeners):
            try:
                listener(self)  # type: ignore[arg-type]  # (self: the composed Controller)
            except Exception:
                log.exception("state listener %r failed", listener)

    def _start_recovery(self, reason: str) -> None:
        """With ``_state_lock`` held: a live controller was lost; reconnect it."""
        if self._closed or self._closing or not self._move(CtrlEvent.LOST):
            return
        self._begin_reconnect(reason)

    def _begin_reconnect(self, reason: str) -> None:
        """With ``_state_lock`` held, just moved to RECONNECTING: start the reconnect loop."""
        self.recovery.losses += 1
        self.recovery.last_reason = reason
        tmo = self.opts.ctrl_loss_tmo
        self._loss_deadline = None if tmo < 0 else time.monotonic() + tmo
        log.warning("%s:%s %s: controller lost (%s); reconnecting every %g s for %s",
                    *self.path, self.opts.subnqn, reason, self.opts.reconnect_delay,
                    "ever" if tmo < 0 else f"{tmo:g} s")
        self._recovery_thread = threading.Thread(target=self._recover, name="nvme-reconnect",
                                                 daemon=True)
        self._recovery_thread.start()

    def _teardown_queues(self, reason: str) -> None:
        """Fail and release every queue of the lost connection, on the reactor so that no
        completion of it runs once this returns."""
        queues = ([self.admin] if self.admin else []) + self.io_queues
        self.admin, self.io_queues = None, []
        if self._ka_timer is not None:
            self._ka_timer.cancel()

        def fail_all() -> None:
            for queue in queues:
                queue.fail(reason, expected=True)
        try:
            self.reactor.call_sync(fail_all, timeout=10)
        except TimeoutError:
            fail_all()
        for queue in queues:
            queue.close()

    def _recover(self) -> None:
        """The reconnect loop: every reconnect_delay, the full connect on each path in turn,
        until one works (re-issue what was held) or ctrl_loss_tmo runs out (fail it)."""
        self._teardown_queues(self.recovery.last_reason)
        lost = self.path_index
        while not self._closed:
            delay = self.opts.reconnect_delay
            if self._loss_deadline is not None:
                delay = min(delay, max(0.0, self._loss_deadline - time.monotonic()))
            self._wake.wait(delay)
            if self._closed:
                break
            if self._loss_deadline is not None and time.monotonic() >= self._loss_deadline:
                break
            self.recovery.attempts += 1
            for step in range(len(self.paths)):
                self.path_index = (lost + step) % len(self.paths)
                try:
                    self._establish()
                except NvmeError as exc:
                    self._teardown_queues(f"reconnect failed: {exc}")
                    if exc.dnr:
                        # The target says a retry cannot help (host no longer allowed,
                        # subsystem gone): stop now, as Linux's nvmf_should_reconnect does.
                        self.recovery.last_reason = str(exc)
                        self._give_up(f"reconnect refused for good ({exc})")
                        return
                    log.info("reconnect to %s:%s failed: %s", *self.path, exc)
                    continue
                except Exception as exc:  # any other failure: drop what was built, retry
                    log.info("reconnect to %s:%s failed: %s", *self.path, exc)
                    self._teardown_queues(f"reconnect failed: {exc}")
                    continue
                self._resume(lost)
                return
        self._give_up(f"ctrl_loss_tmo ({self.opts.ctrl_loss_tmo:g} s) expired")

    def _resume(self, lost: int) -> None:
        with self._state_lock:
            if self._closed:        # close() won the race: it fails what is held
                return
            self._move(CtrlEvent.RECONNECTED)
            self.recovery.reconnects += 1
            if self.path_index != lost:
                self.recovery.failovers += 1
            held, self._held = self._held, []
            self.recovery.retried += len(held)
        log.warning("%s:%s %s: reconnected (controller %d); re-issuing %d held commands",
                    *self.path, self.opts.subnqn, self.cntlid, len(held))
        for req in held:
            self._dispatch(req)
        self._tell_state()

    def _give_up(self, why: str) -> None:
        with self._state_lock:
            if self.state is CtrlState.RECONNECTING:
                self._move(CtrlEvent.CLOSE if self._closed else CtrlEvent.GAVE_UP)
            held, self._held = self._held, []
            self.recovery.failed += len(held)
            reason = self.recovery.last_reason
        if not self._closed:
            log.error("%s: %s: failing %d held commands", self.opts.subnqn, why, len(held))
        self._lose(held, ControllerLost(f"controller lost: {reason}"))
        self._tell_state()

    def recovery_stats(self) -> dict[str, Any]:
        """State, path and reconnect counters (see :class:`RecoveryStats`)."""
        with self._state_lock:
            out = self.recovery.as_dict()
            out.update(state=self.state.value, path=format_path(*self.path),
                       held_now=len(self._held))
        return out

    def _give_up_held(self) -> None:
        with self._state_lock:
            held, self._held = self._held, []
        self._lose(held, ControllerLost("controller closed"))

    # -- keep-alive ------------------------------------------------------------------
    def _schedule_keep_alive(self, kato_ms: int) -> None:
        """Send a Keep Alive every KATO/2; one unanswered for KATO means the target is gone
        (paused, partitioned) even though no queue has reported an error."""
        gen = self._gen
        self._ka_sent = None

        def send() -> None:
            if self._closed or gen != self._gen or self.admin is None:
                return
            if self.admin.dead_reason:
                # The queues died with nothing in flight (an idle host): no command will
                # fail to say so, so this tick starts the reconnect, as the Linux host does.
                self._lost(f"admin queue lost: {self.admin.dead_reason}")
                return
            now = time.monotonic()
            if self._ka_sent is not None:
                if now - self._ka_sent >= kato_ms / 1000:
                    self._lost(f"keep-alive unanswered for {kato_ms} ms")
                    return
            else:
                self._ka_sent = now
                try:
                    self.submit(self.admin, KeepAlive().to_sqe(), _ka_done)
                except (ConnectionError, TimeoutError) as exc:
                    self._lost(f"keep-alive not sent: {exc}")
                    return
            self._ka_timer = self.reactor.call_later(kato_ms / 2000, send)

        def _ka_done(cqe, _data, error) -> None:
            if gen != self._gen:
                return
            self._ka_sent = None
            if error or (cqe is not None and cqe.status != StatusCode.SUCCESS):
                self._lost(f"keep-alive failed: {error or cqe.status.name}")

        self.reactor.call_soon_threadsafe(
            lambda: setattr(self, "_ka_timer", self.reactor.call_later(kato_ms / 2000, send)))

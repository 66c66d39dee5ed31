"""The soft device ("soft0"): key tables, and the progress engine over an epoll of its sockets.

:meth:`SoftContext.progress` is the whole engine: it reads frames into registered memory,
answers requests, retires acknowledged work and fires timers.  Whatever goes wrong while
handling one connection (a bug included: the peer's bytes are validated before use) ends
that connection and nothing else: it never reaches another connection's handling, nor the
caller of ``CQ.poll`` whose call happened to run the engine.  It is driven either by a
daemon thread (``progress="thread"``) or by the CQ owner through :meth:`CQ.poll`
(``progress="poll"``), so a reactor can run the provider without thread hand-offs.

One pass per wake-up (poll mode): a reactor that owns CQs of this device registers it once
(a :class:`Group`, made by :meth:`SoftContext.group`): on each wake-up the group runs the
engine once, then calls the owner of every CQ that got completions in it, and nothing else.

Doorbell batching: a pass (the engine's, and a group's whole pass with its owners' posts) is
*corked* for the thread that runs it: frames queue on their QP, and at the end of the pass
each QP that has any sends them in one ``sendmsg`` (with the acknowledgement it owes, see
:mod:`blockfabric.rdma.soft.qp`).  Posts from other threads are not corked: they go out at
once.

Why one module of ~600 lines: the device's key tables, its engine and the reactor group
that drives it in poll mode are one piece of state read on every pass (the group's wait is
the engine's epoll, its pass corks the engine's sends).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from blockfabric.rdma.base import PASS_HOOKS, Context
from blockfabric.rdma.soft.cq import SoftCQ, drain_eventfd
from blockfabric.rdma.soft.memory import KeyAllocator, SoftMR, SoftPD

if TYPE_CHECKING:
    from blockfabric.rdma.soft.qp import SoftQP

log = logging.getLogger(__name__)
_get_ident = threading.get_ident
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_READ_EVENTS = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
SWEEP_INTERVAL = 0.05   # how often transport (ack) timeouts are checked
#: How long (s) an acknowledgement with nothing to ride on may wait for traffic to the peer
#: in a reactor's pass, as TCP's delayed ACK (the peer's next request usually comes first:
#: at QD1 a host's next command carries it, and the target is not woken for an ACK frame).
ACK_DELAY = 0.001
#: After a wake-up that found work, the reactor's busy-poll (Reactor.spin_us) also waits
#: for the next request for this long, with nothing outstanding: at QD1 the next FUSE
#: request (or capsule) comes a few microseconds after the reply, and catching it spinning
#: saves a sleep and a wake-up per I/O.  The reactor's adaptation stops it when requests
#: come further apart.
IDLE_SPIN_WINDOW = 0.0005


class Group:
    """The CQs of this device that one reactor services, and that reactor's registration:
    the device's epoll fd (its sockets) and an eventfd for completions that arrive from
    other threads.  :meth:`dispatch` is the pass."""

    __slots__ = ("ctx", "reactor", "ready", "active", "cqs", "active_at", "_efd", "_signalled",
                 "_ctx_fd", "acks", "_ack_timer", "_ack_at", "_waits", "_own_fd")

    def __init__(self, ctx: "SoftContext", reactor: Any) -> None:
        self.ctx = ctx
        self.reactor = reactor
        self.ready: list[SoftCQ] = []     # CQs with completions their owner has not seen
        self.active = False               # a pass runs (on the reactor thread)
        self.cqs = 0
        #: when a wait last found something (monotonic s): see IDLE_SPIN_WINDOW
        self.active_at = 0.0
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._signalled = False
        self._ctx_fd = ctx.fileno()
        self.acks: list["SoftQP"] = []    # QPs whose ACK waits for traffic (defer_ack)
        self._ack_timer: Any = None
        #: while this group does the reactor's waiting: when the deferred ACKs are due (0.0:
        #: none), which its wait keeps to instead of a reactor timer per deferral
        self._ack_at = 0.0
        # One epoll_wait per wake-up: the reactor waits in the device's epoll, which holds
        # the reactor's own (Reactor.set_waiter; see wait), rather than the other way round
        # (then every wake-up takes a second epoll_wait to learn which sockets are ready).
        # A reactor that has a waiter already (another device) nests as before, and so does
        # every group once a device has several (see SoftContext.group): in a device's epoll,
        # one reactor's readiness would wake the others, which cannot clear it, and spin.
        self._waits = False
        self._own_fd = -1
        set_waiter = getattr(reactor, "set_waiter", None)
        if not ctx.has_groups() and set_waiter is not None and \
                set_waiter(self.wait, ctx, self.wait, ctx.hook):
            try:
                self._own_fd = reactor.fileno()
                ctx.watch_fd(self._own_fd)
                self._waits = True
            except OSError:
                set_waiter(None)
        if not self._waits:
            reactor.add_reader(self._ctx_fd, self.dispatch)
        reactor.add_reader(self._efd, self.dispatch)
        add_poller = getattr(reactor, "add_poller", None)
        if add_poller is not None:
            add_poller(self.poll)

    def poll(self) -> bool | None:
        """The reactor's busy-poll: a pass if the engine has something (True), False if
        not yet, None when no work request waits for the peer."""
        ctx = self.ctx
        if ctx.closed or (not ctx.outstanding()
                          and time.monotonic() - self.active_at > IDLE_SPIN_WINDOW):
            return None
        if self.ready:
            self.dispatch()
            return True
        # one epoll_wait, whose events the pass then serves (not a peek, then a second wait
        # in progress(): a system call less on every answer a spin catches)
        try:
            events = ctx._ep.poll(0)
        except (OSError, ValueError):
            return False
        if not events:
            return False
        self.dispatch(events)
        return True

    def add(self, cq: SoftCQ) -> None:
        self.cqs += 1

    def remove(self, cq: SoftCQ) -> None:
        try:
            self.ready.remove(cq)
        except ValueError:
            pass
        self.cqs -= 1
        if self.cqs <= 0:
            self.ctx.drop_group(self)

    def wake(self) -> None:
        """Completions were listed outside this group's pass: have the reactor come."""
        if not self._signalled:
            self._signalled = True
            try:
                os.eventfd_write(self._efd, 1)
            except OSError:
                pass                        # closed: the group is gone

    def wait(self, timeout: float | None, serve: Any = None) -> Any:
        """The reactor's wait (on its thread, in its pass): up to ``timeout`` s (None: no
        bound) for the device's sockets or the reactor's own file descriptors (which the
        reactor moved into the device's epoll: Reactor.set_waiter), then a pass over the
        sockets that are ready, if any (a wake-up by a reactor's fd alone, a FUSE request,
        runs no engine).  Returns the reactor's ready events, or True when its own epoll
        may hold ready ones too (a file descriptor that could not move).

        With ``serve``, the reactor's whole pass, while this device's is the only pass hook
        (Reactor.set_waiter's runner): the pass opened for this thread (sends corked), the
        wait, ``serve(ready)`` (the reactor's callbacks, timers and calls; None: its own
        epoll's), then the pass closed (each QP that queued frames sends them in one
        sendmsg).  An error of the wait is logged there, as the reactor logs a waiter's."""
        ctx = self.ctx
        tid = _get_ident()
        opened = serve is not None and tid not in ctx.corks
        if opened:
            ctx.corks[tid] = []
        ready: bool | Sequence[tuple[int, int]]     # (True: the reactor's epoll may have more)
        try:
            try:
                if ctx.rnr_waiters:         # (the kick keeps the epoll ready meanwhile)
                    timeout = 0.0
                elif self._ack_at:          # deferred ACKs: wake up for them at the latest
                    left = self._ack_at - time.monotonic()
                    if timeout is None or left < timeout:
                        timeout = left if left > 0 else 0.0
                try:
                    # no lock: what another thread's progress handles first is reported
                    # again (level-triggered) or not at all
                    events = ctx._ep.poll(-1 if timeout is None else timeout)
                except InterruptedError:
                    events = None
                except (OSError, ValueError):   # the device closed under the wait
                    self._stop_waiting()
                    events = None
                if events:
                    self.active_at = time.monotonic()
                if events is None:
                    ready = True
                elif len(events) == 1:
                    fd = events[0][0]
                    if fd in ctx._fds or fd == ctx._kick:
                        self.dispatch(events)
                        ready = ()
                    else:
                        ready = True if fd == self._own_fd else events
                else:
                    ready = self._sort(events) if events else events
                if self._ack_at and time.monotonic() >= self._ack_at:
                    self._send_acks()
            except Exception:  # noqa: BLE001
                if serve is None:
                    raise                   # the reactor's _wait_pass logs it
                log.exception("%s: unhandled error in the device's wait", self.reactor.name)
                ready = True
            if serve is None:
                return ready
            serve(None if ready is True else ready)
            return None
        finally:
            if opened:
                ctx.end_pass(tid)

    def _sort(self, events: list) -> Any:
        """Several ready: the device's served in one engine pass, the reactor's returned
        (True instead when its nested epoll is ready too: the loop polls that; what was
        ready here is level-triggered and reported again at the next wait)."""
        ctx = self.ctx
        fds, kick, own = ctx._fds, ctx._kick, self._own_fd
        mine = []
        theirs = []
        nested = False
        for event in events:
            fd = event[0]
            if fd in fds or fd == kick:
                mine.append(event)
            elif fd == own:
                nested = True
            else:
                theirs.append(event)
        if mine:
            self.dispatch(mine)
        return True if nested else theirs

    def _stop_waiting(self) -> None:
        if self._waits:
            self._waits = False
            self.reactor.set_waiter(None)
            try:
                fd = self.reactor.fileno()
            except (OSError, ValueError):
                return      # closed: the kernel took it out of the device's epoll, and its
                            # number may be another file's now (a socket there: keep it)
            if fd == self._own_fd:
                self.ctx.unwatch_fd(fd)

    def nest(self) -> None:
        """Wait for the device nested in the reactor's epoll, as a reactor that has a waiter
        already does (reactor thread; see SoftContext.group)."""
        if self._waits:
            self._stop_waiting()        # out of the device's epoll first: no loop
            self.reactor.add_reader(self._ctx_fd, self.dispatch)
            if self._ack_at:            # the wait kept that time: a timer keeps it now
                self._ack_at = 0.0
                if self._ack_timer is None:
                    self._ack_timer = self.reactor.call_later(ACK_DELAY, self._send_acks)

    def defer(self, qp: "SoftQP") -> None:
        """``qp``'s acknowledgement waits for traffic, at most ACK_DELAY (reactor thread)."""
        if qp.ack_group is not self:
            qp.ack_group = self
            self.acks.append(qp)
        if self._waits:                 # the wait keeps the time: no timer per deferral
            if not self._ack_at:
                self._ack_at = time.monotonic() + ACK_DELAY
        elif self._ack_timer is None:
            self._ack_timer = self.reactor.call_later(ACK_DELAY, self._send_acks)

    def carried(self, qp: "SoftQP") -> None:
        """A request carried ``qp``'s acknowledgement: no timer for it (none at all, and no
        wake-up, once no other waits).  Only on the reactor's thread; from another, the
        timer finds nothing owed when it fires."""
        if _get_ident() != getattr(self.reactor, "ident", None):
            return
        qp.ack_group = None
        acks = self.acks
        try:
            acks.remove(qp)
        except ValueError:
            pass
        if not acks:
            self._ack_at = 0.0
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                self._ack_timer = None

    def _send_acks(self) -> None:
        """ACK_DELAY is over: every deferred acknowledgement no request carried goes out."""
        self._ack_timer = None
        self._ack_at = 0.0
        acks, self.acks = self.acks, []
        for qp in acks:
            qp.ack_group = None
            try:
                qp.send_owed_ack()
            except Exception as exc:  # noqa: BLE001  one connection's, and only its
                qp.fail(exc)

    def dispatch(self, events: list | None = None) -> None:
        """One pass: the engine once (corked; over ``events`` when the caller polled the
        device's epoll already), then the owner of every CQ that got completions, then every
        frame the pass produced goes out."""
        if self._signalled:
            self._signalled = False
            drain_eventfd(self._efd)
        ctx = self.ctx
        if ctx.closed:
            return
        tid = _get_ident()
        ctx.deferrers[tid] = self
        corks = ctx.corks
        outer = tid not in corks
        if outer:
            corks[tid] = []
        self.active = True
        try:
            ctx.progress(0, events)
            while True:
                ready = self.ready
                while ready:
                    self.ready = []
                    for cq in ready:
                        cq.listed = False
                        owner = cq.owner
                        if owner is not None:
                            owner()     # Endpoint.service: isolates its own faults
                    ready = self.ready
                if not outer:
                    break
                ctx.end_pass(tid)       # a failed send may complete work: look again
                if not self.ready:
                    break
                corks[tid] = []
        finally:
            self.active = False
            if outer:
                ctx.end_pass(tid)
        if self.ready:                  # listed from another thread as the pass ended
            self.wake()

    def close(self) -> None:
        reactor = self.reactor
        for tid, group in list(self.ctx.deferrers.items()):
            if group is self:
                del self.ctx.deferrers[tid]

        def unregister() -> None:
            if self._ack_timer is not None:
                self._ack_timer.cancel()
                self._ack_timer = None
            self._send_acks()
            remove_poller = getattr(reactor, "remove_poller", None)
            if remove_poller is not None:
                remove_poller(self.poll)
            if self._waits:
                self._stop_waiting()
            else:
                reactor.remove_reader(self._ctx_fd, self.dispatch)
            reactor.remove_reader(self._efd, self.dispatch)
            os.close(self._efd)
        thread = getattr(reactor, "thread", None)
        if thread is None or thread is threading.current_thread() or not thread.is_alive():
            try:
                unregister()
            except (OSError, ValueError):
                pass
        else:
            # out of the device's epoll now, not when the loop gets to it: a group made for
            # this reactor meanwhile must find the place free (and no epoll loop to nest into)
            self._stop_waiting()
            try:
                reactor.call_soon_threadsafe(unregister)
            except OSError:
                pass


class SoftContext(Context):
    def __init__(self, progress: str = "thread") -> None:
        if progress not in ("thread", "poll"):
            raise ValueError(f"progress must be 'thread' or 'poll', not {progress!r}")
        self.name = "soft0"
        self.poll_mode = progress == "poll"
        self.lkeys: dict[int, SoftMR] = {}
        self.rkeys: dict[int, SoftMR] = {}
        self._keys = KeyAllocator()
        self._qp_nums = 0x11
        self._ep = select.epoll()
        self._fds: dict[int, "SoftQP"] = {}
        self._qps: set["SoftQP"] = set()
        self.rnr_waiters: set["SoftQP"] = set()
        self._plock = threading.Lock()
        self._klock = threading.Lock()
        self._next_sweep = 0.0
        # readable while a timer is pending, so a poll-mode owner keeps calling progress()
        self._kick = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ep.register(self._kick, _IN)
        self._kicked = False
        self._thread: threading.Thread | None = None
        self._groups: dict[int, Group] = {}
        #: thread id -> the QPs with frames queued in that thread's pass (see end_pass)
        self.corks: dict[int, list] = {}
        #: thread id -> the reactor group whose pass runs there (its ACKs may wait, defer_ack)
        self.deferrers: dict[int, Group] = {}
        self._hook = (self.begin_pass, self.end_pass)
        #: this device's entry in PASS_HOOKS (a group's wait(timeout, serve) opens and
        #: closes it itself)
        self.hook = self._hook
        PASS_HOOKS.append(self._hook)
        self.closed = False

    # ------------------------------------------------------------------ resources
    def alloc_pd(self) -> SoftPD[SoftContext]:
        return SoftPD(self)

    def create_cq(self, depth: int = 256) -> SoftCQ:
        return SoftCQ(self, depth)

    def new_keys(self) -> tuple[int, int]:
        with self._klock:
            return self._keys.pair()

    def new_qp_num(self) -> int:
        with self._klock:
            self._qp_nums += 1
            return self._qp_nums & 0xFFFFFF

    def fileno(self) -> int:
        return self._ep.fileno()

    def group(self, reactor: Any) -> Group:
        """The group through which ``reactor`` services this device's CQs (made on first
        use; called on the reactor's thread)."""
        group = self._groups.get(id(reactor))
        if group is None or group.reactor is not reactor:
            for other in self._live_groups():           # a second reactor: none waits
                try:
                    other.reactor.call_soon_threadsafe(other.nest)
                except OSError:
                    pass                # that reactor is closing: it waits for nothing
            group = self._groups[id(reactor)] = Group(self, reactor)
        return group

    def _live_groups(self) -> list[Group]:
        """The groups whose reactor is not closed (one left with CQs attached when its
        reactor closed waits for nothing)."""
        return [g for g in self._groups.values() if not getattr(g.reactor, "closed", False)]

    def has_groups(self) -> bool:
        return bool(self._live_groups())

    def drop_group(self, group: Group) -> None:
        if self._groups.get(id(group.reactor)) is group:
            del self._groups[id(group.reactor)]
        group.close()

    def outstanding(self) -> bool:
        """Some QP waits for its peer (work requests posted and not yet answered)."""
        for qp in self._qps:
            if qp.waiting:
                return True
        return False

    def begin_pass(self, tid: int) -> bool:
        """Cork thread ``tid``'s sends until :meth:`end_pass` (False: a pass is open)."""
        if tid in self.corks:
            return False
        self.corks[tid] = []
        return True

    def end_pass(self, tid: int) -> None:
        """The pass of thread ``tid`` is over: every QP it queued frames on sends them
        (one sendmsg each), with the acknowledgement it owes."""
        dirty = self.corks.pop(tid, None)
        if not dirty:
            return
        for qp in dirty:
            try:
                qp.end_pass()
            except Exception as exc:  # noqa: BLE001  one connection's, and only its
                qp.fail(exc)

    def defer_ack(self, qp: "SoftQP") -> bool:
        """At the end of a pass, ``qp`` owes an acknowledgement and has nothing else for its
        peer: True if it may wait for traffic (a reactor's pass: its group sends it after
        ACK_DELAY, unless a request carried it first), False to send it now.  Only when its
        owner posted within ACK_DELAY: one whose requests come further apart would only
        pay a timer's wake-up for an ACK frame it sends anyway."""
        tid = _get_ident()
        group = self.deferrers.get(tid)
        # only on the thread that runs that reactor's loop now (its timers fire there)
        # ... and only for a QP whose completions that group serves: another reactor's pass
        # may run the engine over this QP's socket, and the timer must outlive the QP's use
        if group is None or ACK_DELAY <= 0 or getattr(group.reactor, "ident", None) != tid \
                or qp.recv_cq.group is not group or time.monotonic() - qp.posted > ACK_DELAY:
            return False
        group.defer(qp)
        return True

    def watch_fd(self, fd: int) -> None:
        self._ep.register(fd, _IN)

    def unwatch_fd(self, fd: int) -> None:
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ sockets
    def register(self, qp: "SoftQP") -> None:
        fd = qp.sock.fileno()  # type: ignore[union-attr]  # (from SoftQP.start: it has one)
        self._fds[fd] = qp
        self._qps.add(qp)
        self._ep.register(fd, _IN)
        if not self.poll_mode and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="soft0-progress", daemon=True)
            self._thread.start()

    def unregister(self, qp: "SoftQP", fd: int) -> None:
        self._qps.discard(qp)
        self.rnr_waiters.discard(qp)
        if self._fds.get(fd) is qp:
            del self._fds[fd]
            self.unwatch_fd(fd)

    def want_write(self, fd: int, on: bool) -> None:
        try:
            self._ep.modify(fd, _IN | _OUT if on else _IN)
        except (OSError, ValueError):
            pass

    def timer_pending(self) -> None:
        """A QP armed a timer: make sure someone calls progress() soon."""
        if self.poll_mode:
            os.eventfd_write(self._kick, 1)
            self._kicked = True     # after the write: progress() reads it only when set

    # ------------------------------------------------------------------ the engine
    def progress(self, timeout: float = 0.0, events: list | None = None) -> int:
        """Do all pending network work, waiting up to ``timeout`` s for some; return the
        number of ready sockets handled.  Re-entrant calls from other threads return 0.
        ``events``: what the caller's wait in this epoll returned (no second wait)."""
        if not self._plock.acquire(blocking=False):
            return 0
        tid = _get_ident()
        corks = self.corks
        outer = tid not in corks
        if outer:
            corks[tid] = []
        try:
            if self.rnr_waiters:
                timeout = min(timeout, self._fire_rnr(time.monotonic()))
            if events is None:
                try:
                    events = self._ep.poll(timeout)
                except InterruptedError:
                    events = []
            fds = self._fds
            for fd, ev in events:
                qp = fds.get(fd)
                if qp is None:
                    continue
                try:
                    if ev & _OUT:
                        qp.on_writable()
                    if ev & _READ_EVENTS:
                        qp.on_readable()
                except Exception as exc:  # noqa: BLE001  one connection's, and only its
                    qp.fail(exc)
            now = time.monotonic()
            if self.rnr_waiters:
                self._fire_rnr(now)
            elif self._kicked:      # (poll mode) a system call only when there is a kick
                self._kicked = False
                drain_eventfd(self._kick)
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_INTERVAL
                for qp in list(self._qps):
                    try:
                        qp.check_timeout(now)
                    except Exception as exc:  # noqa: BLE001
                        qp.fail(exc)
            return len(events)
        finally:
            self._plock.release()
            if outer:
                self.end_pass(tid)

    def _fire_rnr(self, now: float) -> float:
        """Replay QPs whose RNR timer expired; return seconds until the next one."""
        wait = SWEEP_INTERVAL
        for qp in list(self.rnr_waiters):
            left = qp.rnr_deadline - now
            if left <= 0:
                self.rnr_waiters.discard(qp)
                try:
                    qp.rnr_replay()
                except Exception as exc:  # noqa: BLE001
                    qp.fail(exc)
            else:
                wait = min(wait, left)
        return wait

    def _run(self) -> None:
        while not self.closed:
            try:
                self.progress(SWEEP_INTERVAL)
            except Exception:  # noqa: BLE001  (the engine must outlive one bad QP)
                log.exception("soft progress engine")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            PASS_HOOKS.remove(self._hook)
        except ValueError:
            pass
        for qp in list(self._qps):
            qp.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        for group in list(self._groups.values()):
            self.drop_group(group)
        self._ep.close()
        os.close(self._kick)

"""A small poll loop: file descriptors, timers and cross-thread calls, on one thread.

Per-I/O cost decides the speed of this system, and a thread hand-off under the GIL costs
tens of microseconds.  So each queue group is serviced by one loop that waits on the RDMA
completion queues and CM ids it owns, runs the command logic inline, and keeps its own
timers (keep-alive) — the way an SPDK reactor owns its pollers.  Other threads talk to a
loop only through :meth:`Reactor.call_soon_threadsafe`.

Why one module of ~670 lines: the loop, its timers, its cross-thread calls and its
adaptive busy-poll (with its depth and pressure guards) are one wait; the waiter hand-off
to a provider (set_waiter) is what makes a wake-up one system call, and it reads the
loop's private state.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import select
import threading
import time
from typing import Any, Callable, Sequence

from blockfabric.rdma.base import PASS_HOOKS as _pass_hooks

_yield = os.sched_yield          # each turn of a spin (Reactor._spin)

log = logging.getLogger(__name__)

#: what one wait found ready: (fd, events) pairs, as epoll.poll returns them
_Ready = Sequence[tuple[int, int]]


SPIN_ENV = "BLOCKFABRIC_REACTOR_SPIN_US"
#: The default busy-poll before sleeping, in microseconds (see Reactor.spin_us): the
#: longest a loop polls for what it expects next (an answer, the next request) before it
#: goes to sleep.  Chosen by measurement (docs/performance.md, "the spin, fixed"): on a
#: quiet 2-core VM the NVMe/TCP mount's 4 KiB QD1 reads went from 9.0k to 24.3k IOPS
#: (p99 255 -> 93 us; nbdfuse 18.1k, 113 us) and the soft provider's from 6.6k to 12.9k,
#: with less CPU per I/O (fewer wake-ups), and QD16 unchanged (the depth stops it); 50
#: and 200 us measured the same, 20 us was too short to catch the peer.  Each turn of a
#: spin yields the CPU, so a peer or an application woken on the spinner's CPU runs at
#: once.  0 turns it off (target ``spin_us``, ``--spin-us``, $BLOCKFABRIC_REACTOR_SPIN_US).
DEFAULT_SPIN_US = 100.0
#: The hard bound on the knob (a misconfigured loop must still sleep).
MAX_SPIN_US = 10_000.0
#: A spin that runs out is a near miss when the answer then came within this many times
#: ``spin_us`` of the start of the wait (the peer was slow to wake: it may spin too, and
#: then both answer in time); a far miss otherwise.  SPIN_FAR_MISSES far misses in a row
#: stop the spinning; then one wait in SPIN_PROBE_EVERY spins to look again.
SPIN_NEAR_FACTOR = 4.0
SPIN_FAR_MISSES = 2
SPIN_PROBE_EVERY = 64
#: No busy-poll while the machine is oversubscribed, where the kernel has no PSI (below):
#: a 1-minute load average above this many times the CPUs the process may use (checked
#: every SPIN_LOAD_EVERY s).  Then a spinning loop takes the CPU its peer and the
#: application need: with load average 22-29 on 2 cores, an 80 us spin took the mount's
#: QD1 reads from 2.2-5.3k IOPS to 1.0-3.6k.
SPIN_LOAD_FACTOR = 2.0
SPIN_LOAD_EVERY = 1.0
#: Nor while the CPUs are contended right now: Linux's pressure stall information
#: (/proc/pressure/cpu, "some avg10": the share of the last 10 s in which some runnable
#: task waited for a CPU) above this many percent ($BLOCKFABRIC_REACTOR_SPIN_LOAD, 0-100;
#: 100 turns this guard and the load average's off).  It follows load within seconds,
#: where the load average takes a minute, and it counts only tasks that waited.
SPIN_LOAD_ENV = "BLOCKFABRIC_REACTOR_SPIN_LOAD"
DEFAULT_SPIN_LOAD = 40.0
PSI_CPU = "/proc/pressure/cpu"
#: The spin follows the depth.  At depth the next completion comes without spinning, and a
#: spin only takes the CPU the peer needs (a spin of 100 us cost NVMe/TCP QD16 20 %): no
#: spin while the pollers' ``depth`` callables (add_poller) say more than SPIN_MAX_DEPTH
#: commands are outstanding, and none for the next SPIN_BUSY_WAITS waits after a receive
#: brought SPIN_BUSY_ARRIVALS or more at once (note_arrivals: a target, whose commands
#: are done within the pass, sees the depth only that way).
SPIN_MAX_DEPTH = 2
SPIN_BUSY_ARRIVALS = 2
SPIN_BUSY_WAITS = 256

_default_override: float | None = None


def parse_spin_us(value: Any) -> float:
    """A spin budget in microseconds: a number in [0, MAX_SPIN_US] (ValueError else)."""
    try:
        us = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number of microseconds") from None
    if not 0.0 <= us <= MAX_SPIN_US:
        raise ValueError(f"{value!r} microseconds is out of range 0-{MAX_SPIN_US:g}")
    return us


def set_default_spin(us: float | None) -> None:
    """What loops made from now on spin by default (the mount's and bench's --spin-us, the
    target's ``spin_us``); None: back to the environment or DEFAULT_SPIN_US."""
    global _default_override
    _default_override = None if us is None else parse_spin_us(us)


def _oversubscribed() -> bool:
    """The 1-minute load average is above SPIN_LOAD_FACTOR x the CPUs this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
        return os.getloadavg()[0] > SPIN_LOAD_FACTOR * cpus
    except OSError:
        return False


def cpu_pressure(path: str | None = None) -> float | None:
    """The CPU pressure "some avg10" in percent (None: no PSI here, or unreadable)."""
    try:
        with open(path or PSI_CPU, "rb") as f:
            line = f.readline()
    except OSError:
        return None
    for field in line.split():
        if field.startswith(b"avg10="):
            try:
                return float(field[6:])
            except ValueError:
                return None
    return None


def spin_load_limit() -> float:
    """$BLOCKFABRIC_REACTOR_SPIN_LOAD (percent CPU pressure, 0-100) or DEFAULT_SPIN_LOAD."""
    raw = os.environ.get(SPIN_LOAD_ENV)
    if not raw:
        return DEFAULT_SPIN_LOAD
    try:
        limit = float(raw)
    except ValueError:
        limit = -1.0
    if not 0.0 <= limit <= 100.0:
        log.warning("%s: %r is not a percentage 0-100: using %s", SPIN_LOAD_ENV, raw,
                    DEFAULT_SPIN_LOAD)
        return DEFAULT_SPIN_LOAD
    return limit


def spin_default() -> float:
    """set_default_spin's value, else BLOCKFABRIC_REACTOR_SPIN_US if set (microseconds, 0
    to MAX_SPIN_US), else DEFAULT_SPIN_US."""
    if _default_override is not None:
        return _default_override
    raw = os.environ.get(SPIN_ENV)
    if not raw:
        return DEFAULT_SPIN_US
    try:
        return parse_spin_us(raw)
    except ValueError as exc:
        log.warning("%s: %s: using %s", SPIN_ENV, exc, DEFAULT_SPIN_US)
        return DEFAULT_SPIN_US


class Timer:
    """A handle for :meth:`Reactor.call_later`; :meth:`cancel` is idempotent."""

    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    """One thread's event loop.  Not thread-safe except :meth:`call_soon_threadsafe`
    and :meth:`stop`."""

    def __init__(self, name: str = "reactor", spin_us: float | None = None) -> None:
        self.name = name
        #: Adaptive polling: before sleeping, poll the providers' engines (``add_poller``)
        #: for up to this many microseconds while they have work outstanding (0: never).
        self.spin_us = spin_default() if spin_us is None else parse_spin_us(spin_us)
        #: the adaptive part (see _spin): whether to spin before the next wait, far misses
        #: in a row, waits skipped since the last probe, when a spin that ran out began
        self._spinning = True
        self._far = 0
        self._spin_skips = 0
        self._spun_out = 0.0
        self._load_at = 0.0             # when to look at the load average again
        self._crowded = False           # it was too high: no spinning
        #: CPU pressure (percent, cpu_pressure) above which there is no spinning
        self.spin_load = spin_load_limit()
        #: waits left without a spin after a receive found several commands (note_arrivals)
        self._busy = 0
        #: counters for status: spins that found work, spins that ran out, waits that did
        #: not spin because of the depth, or of the load / CPU pressure
        self.spin_hits = 0
        self.spin_misses = 0
        self.spin_skips_depth = 0
        self.spin_skips_pressure = 0
        self._pollers: list[Callable[[], bool | None]] = []
        #: the pollers' depth callables (add_poller), by poller
        self._depths: dict[Callable[[], bool | None], Callable[[], int]] = {}
        #: the pollers that only follow the others' spins (add_poller ``follows``)
        self._followers: set[Callable[[], bool | None]] = set()
        #: a provider that waits for this loop (set_waiter), or None: the loop's own epoll
        self._waiter: Callable[[float | None], Any] | None = None
        #: the waiter's epoll (watch/unwatch), which holds this loop's fds meanwhile, or None
        self._mover: Any = None
        #: the waiter's whole-pass form and the pass hook it opens and closes itself
        self._runner: Callable[[float | None, Callable[[_Ready | None], None]], None] | None = None
        self._runner_hook: Any = None
        self._moved: set[int] = set()       # this loop's fds now in the mover's epoll
        self._ep = select.epoll()
        #: fd -> its callbacks (a list object per registration: a stale event for an fd
        #: unregistered and registered again earlier in the same batch is told apart by it)
        self._readers: dict[int, list[Callable[[], object]]] = {}
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._calls: collections.deque[Callable[[], object]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.add_reader(self._wake_r, self._drain_wake)
        self._running = False
        self._stopping = False
        self.closed = False
        self.thread: threading.Thread | None = None
        #: the thread running :meth:`run_forever` now (None when none is): a provider may
        #: leave work to this loop's timers only from that thread
        self.ident: int | None = None

    # -- registration -------------------------------------------------------------------
    def add_reader(self, fd: int, callback: Callable[[], object]) -> None:
        """Call ``callback`` whenever ``fd`` is readable.  Several callbacks may share one fd
        (a provider may serve many CQs through one completion channel); each runs."""
        callbacks = self._readers.get(fd)
        if callbacks is None:
            if not self._watch_moved(fd):
                self._ep.register(fd, select.EPOLLIN)
            self._readers[fd] = [callback]
        else:
            callbacks.append(callback)

    def _watch_moved(self, fd: int) -> bool:
        """With a waiter that holds this loop's fds: put ``fd`` in its epoll (True)."""
        mover = self._mover
        if mover is None:
            return False
        try:
            mover.watch_fd(fd)
        except (OSError, ValueError):
            return False
        self._moved.add(fd)
        return True

    def remove_reader(self, fd: int, callback: Callable[[], object] | None = None) -> None:
        """Stop calling ``callback`` (or every callback) for ``fd``; unknown ones are fine."""
        callbacks = self._readers.get(fd)
        if callbacks is None:
            return
        if callback is not None:
            try:
                callbacks.remove(callback)
            except ValueError:
                return
            if callbacks:
                return
        del self._readers[fd]
        if fd in self._moved:
            self._moved.discard(fd)
            self._mover.unwatch_fd(fd)
            return
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass        # already closed: the kernel dropped it from the epoll itself

    def add_cq(self, cq: Any, callback: Callable[[], object]) -> bool:
        """Call ``callback`` when ``cq`` (a :class:`~blockfabric.rdma.CQ`) may have
        completions.  A provider that serves many CQs through one engine (soft, in poll
        mode) registers that engine once per reactor (``cq.attach_reactor``): each wake-up
        then runs its progress once and calls back only the owners of CQs that got
        completions; any other CQ is waited on through its ``fileno()``.  True when the
        provider attached it: ``callback`` then runs again for every completion that arrives
        after it last polled, so it needs no arming (``req_notify``/``ack_events``) and may
        stop polling at the first batch smaller than it asked for."""
        attach = getattr(cq, "attach_reactor", None)
        if attach is None or not attach(self, callback):
            self.add_reader(cq.fileno(), callback)
            return False
        return True

    def remove_cq(self, cq: Any, callback: Callable[[], object]) -> None:
        """Undo :meth:`add_cq`."""
        detach = getattr(cq, "detach_reactor", None)
        if detach is None or not detach(self, callback):
            self.remove_reader(cq.fileno(), callback)

    def add_poller(self, poller: Callable[[], bool | None],
                   depth: Callable[[], int] | None = None, follows: bool = False) -> None:
        """A provider engine to busy-poll before sleeping (``spin_us``): ``poller()`` runs
        a pass if there is work and returns True, False if it found none yet, None when
        nothing is outstanding (no point in spinning for it).  ``depth()``, if given, is
        how many of its commands are outstanding (see SPIN_MAX_DEPTH).  A poller that
        ``follows`` (the FUSE session's) keeps up the spins of a loop that has a
        transport's poller, and makes none on its own: a loop without one gets its
        answers from another thread (the soft provider's progress thread), which a
        spin would keep waiting for the GIL."""
        self._pollers.append(poller)
        if depth is not None:
            self._depths[poller] = depth
        if follows:
            self._followers.add(poller)

    def remove_poller(self, poller: Callable[[], bool | None]) -> None:
        self._depths.pop(poller, None)
        self._followers.discard(poller)
        try:
            self._pollers.remove(poller)
        except ValueError:
            pass

    def note_arrivals(self, count: int) -> None:
        """A receive brought ``count`` commands (or answers) at once: from
        SPIN_BUSY_ARRIVALS on, the link is at depth, and the next SPIN_BUSY_WAITS waits do
        not spin (loop thread)."""
        if count >= SPIN_BUSY_ARRIVALS:
            self._busy = SPIN_BUSY_WAITS

    def spin_stats(self) -> dict[str, float | int]:
        """The spin's knobs and counters, for status output."""
        return {"spin_us": self.spin_us, "load_limit": self.spin_load,
                "hits": self.spin_hits, "misses": self.spin_misses,
                "skips_depth": self.spin_skips_depth,
                "skips_pressure": self.spin_skips_pressure}

    def fileno(self) -> int:
        """The loop's epoll: readable when one of its own file descriptors is."""
        return self._ep.fileno()

    def set_waiter(self, waiter: Callable[[float | None], Any] | None,
                   mover: Any = None, runner: Any = None, hook: Any = None) -> bool:
        """Let a provider do this loop's waiting (loop thread, or before it runs): each pass
        calls ``waiter(timeout)`` instead of waiting in the loop's epoll; the provider waits
        in an epoll of its own that holds this loop's (:meth:`fileno`), serves what is ready
        of its own in the pass, and returns True when the loop's file descriptors may be
        ready too (polled then, without waiting), else the list of this loop's ready
        ``(fd, events)`` it found (possibly empty).  With ``mover`` (an object with
        ``watch_fd(fd)`` and ``unwatch_fd(fd)`` on the provider's epoll) this loop's file
        descriptors move into that epoll while the waiter has the place: a wake-up by one
        of them (a FUSE request) is one ``epoll_wait``, not one in the provider's epoll
        and another in the loop's.  With ``runner`` and ``hook`` (its entry in
        ``PASS_HOOKS``), while ``hook`` is the only pass hook, each pass is
        ``runner(timeout, serve)``: the provider opens its pass, waits, serves its part,
        calls ``serve(ready)`` (this loop's part; ``ready`` None: poll the loop's own
        epoll) and closes the pass, without the generic hooks' calls.  One waiter at a
        time: False if another has the place.  ``None`` gives the place back (and the file
        descriptors)."""
        if waiter is not None and self._waiter is not None:
            return False
        if waiter is None:
            self._unmove()
        self._waiter = waiter
        self._runner = runner if waiter is not None else None
        self._runner_hook = hook if waiter is not None else None
        if waiter is not None and mover is not None:
            self._mover = mover
            for fd in tuple(self._readers):
                if self._watch_moved(fd):
                    try:
                        self._ep.unregister(fd)
                    except (OSError, ValueError):
                        pass
        return True

    def _unmove(self) -> None:
        """The file descriptors in the waiter's epoll back into the loop's own."""
        mover, moved = self._mover, self._moved
        self._mover = None
        if mover is None:
            return
        for fd in tuple(moved):
            try:
                mover.unwatch_fd(fd)
            except (OSError, ValueError):
                pass
            try:
                self._ep.register(fd, select.EPOLLIN)
            except (OSError, ValueError):
                pass        # closed meanwhile (its reader goes with remove_reader)
        moved.clear()

    def set_spin(self, us: float) -> None:
        """Change ``spin_us`` (and restart the adaptation from it)."""
        self.spin_us = parse_spin_us(us)
        self._spinning = True
        self._far = self._spin_skips = 0

    def _spin(self) -> bool:
        """Busy-poll while some poller has work outstanding (or expects it soon), for up to
        ``spin_us``; True once one did some, or once anything of the loop's own epoll is
        ready (served by the pass that follows).  Each turn yields the CPU (sched_yield).
        Adaptive: a spin that runs out and whose answer then came far later
        (SPIN_NEAR_FACTOR) counts as a far miss, and SPIN_FAR_MISSES in a row stop the
        spinning but for a probe every SPIN_PROBE_EVERY waits, until a spin finds work or
        misses narrowly again: a peer that answers slowly (a far backend, an idle
        keep-alive) costs no CPU, a quick one (or one that is quick once both ends spin)
        gets the full spin.  Sets ``_spun_out`` (the monotonic time the spin began) when
        it ran out, for :meth:`_after_wait`."""
        if len(self._followers) >= len(self._pollers):
            return False                # no transport's poller: nothing to spin for
        if self._busy:
            self._busy -= 1
            self.spin_skips_depth += 1
            return False
        if self._depths:
            if sum(depth() for depth in tuple(self._depths.values())) > SPIN_MAX_DEPTH:
                self.spin_skips_depth += 1
                return False
        if not self._spinning:
            self._spin_skips += 1
            if self._spin_skips < SPIN_PROBE_EVERY:
                return False
            self._spin_skips = 0
        pollers = self._pollers
        now = time.monotonic
        start = now()
        if start >= self._load_at:
            self._load_at = start + SPIN_LOAD_EVERY
            self._crowded = self._pressed()
        if self._crowded:
            self.spin_skips_pressure += 1
            return False
        deadline = start + self.spin_us * 1e-6
        ep_poll = self._ep.poll
        while True:
            waiting = False
            for poller in tuple(pollers):
                try:
                    got = poller()
                except Exception:  # noqa: BLE001  (as a callback's: logged, the loop goes on)
                    log.exception("%s: unhandled error in poller %r", self.name, poller)
                    got = None
                if got:
                    break
                if got is not None:
                    waiting = True
            else:
                if not waiting:
                    return False
                # Anything else of this loop's that became ready (a FUSE request, a call
                # from another thread, a new connection) ends the spin too: the spin waits
                # for the loop's next event, not only for the pollers' answers.
                try:
                    got = bool(ep_poll(0))
                except InterruptedError:
                    got = False
            if got:
                self.spin_hits += 1
                self._spinning = True
                self._far = 0
                return True
            _yield()
            if now() >= deadline:
                self.spin_misses += 1
                self._spun_out = start
                return False

    def _pressed(self) -> bool:
        """The CPUs are under pressure (PSI above ``spin_load``); where the kernel has no
        PSI, the machine is oversubscribed (load average).  ``spin_load`` 100: never."""
        if self.spin_load >= 100.0:
            return False
        pressure = cpu_pressure()
        return _oversubscribed() if pressure is None else pressure > self.spin_load

    def _after_wait(self) -> None:
        """After the wait that followed a spin that ran out: near or far miss."""
        start, self._spun_out = self._spun_out, 0.0
        if time.monotonic() - start <= self.spin_us * (SPIN_NEAR_FACTOR * 1e-6):
            self._far = 0
            self._spinning = True
        else:
            self._far += 1
            if self._far >= SPIN_FAR_MISSES:
                self._spinning = False

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        timer = Timer(time.monotonic() + max(0.0, delay), callback)
        heapq.heappush(self._timers, (timer.when, next(self._seq), timer))
        return timer

    def call_soon(self, callback: Callable[[], object]) -> None:
        """From the loop thread only: run ``callback`` in the next pass (after the ready
        file descriptors of that pass have been served)."""
        self._calls.append(callback)

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> None:
        if self.closed:
            return      # no loop will run it; and the wake pipe's number may be reused
        self._calls.append(callback)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is already awake

    def call_sync(self, callback: Callable[[], object], timeout: float = 5.0) -> None:
        """Run ``callback`` on the loop thread and wait for it; run it here when called
        from the loop thread itself or when no loop thread is running."""
        if self.thread is None or not self.thread.is_alive() \
                or self.thread is threading.current_thread() or self._stopping:
            callback()
            return
        done = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            try:
                callback()
            except BaseException as exc:  # handed back to the caller
                error.append(exc)
            finally:
                done.set()

        self.call_soon_threadsafe(run)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: loop did not run a call within {timeout} s")
        if error:
            raise error[0]

    # -- running ------------------------------------------------------------------------
    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def run_once(self, timeout: float | None = None) -> None:
        """Wait for at most ``timeout`` seconds (None: until something happens), then run
        every ready callback, due timer and queued call: one pass, for the providers that
        batch per pass (``blockfabric.rdma.base.PASS_HOOKS``: the soft provider sends what
        the pass posted on each connection in one sendmsg at its end)."""
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)           # a cancelled timer does not wake the loop
        if self._calls:
            timeout = 0
        elif timers:
            until = max(0.0, timers[0][0] - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        if self.spin_us and self._pollers and timeout != 0:
            if self._spin():
                timeout = 0         # a poller ran a pass: serve the rest without sleeping
            elif self._spun_out:
                try:
                    self._wait_and_serve(timeout)
                finally:
                    self._after_wait()
                return
        if self._waiter is None and not _pass_hooks:    # _wait_and_serve's plain case, inline
            ready: _Ready
            try:
                ready = self._ep.poll(-1 if timeout is None else timeout)
            except InterruptedError:
                ready = ()
            self._serve(ready)
            return
        self._wait_and_serve(timeout)

    def _wait_and_serve(self, timeout: float | None) -> None:
        waiter = self._waiter
        if waiter is not None:
            runner = self._runner
            if runner is not None and len(_pass_hooks) == 1 \
                    and _pass_hooks[0] is self._runner_hook:
                runner(timeout, self._serve)
            else:
                self._wait_pass(waiter, timeout)
            return
        ready: _Ready
        try:
            ready = self._ep.poll(-1 if timeout is None else timeout)
        except InterruptedError:
            ready = ()
        if not _pass_hooks:
            self._serve(ready)
            return
        tid = threading.get_ident()
        opened = [end for begin, end in tuple(_pass_hooks) if begin(tid)]
        try:
            self._serve(ready)
        finally:
            self._close_pass(opened, tid)

    def _close_pass(self, opened: list[Callable[[int], object]], tid: int) -> None:
        for end in opened:
            try:
                end(tid)
            except Exception:  # noqa: BLE001  (as a callback's: logged, the loop goes on)
                log.exception("%s: unhandled error in %r", self.name, end)

    def _wait_pass(self, waiter: Callable[[float | None], bool],
                   timeout: float | None) -> None:
        """:meth:`run_once` with a waiter: the pass opens first, since the waiter serves
        the provider's part of it as it returns."""
        tid = threading.get_ident()
        opened = [end for begin, end in tuple(_pass_hooks) if begin(tid)]
        try:
            ready: Any = ()
            try:
                own = waiter(timeout)
            except Exception:  # noqa: BLE001  (as a callback's: logged, the loop goes on)
                log.exception("%s: unhandled error in waiter %r", self.name, waiter)
                own = True
            if own is True:
                try:
                    ready = self._ep.poll(0)
                except InterruptedError:
                    pass
            elif own:
                ready = own             # this loop's fds, ready in the waiter's epoll
            self._serve(ready)
        finally:
            self._close_pass(opened, tid)

    def _serve(self, ready: _Ready | None) -> None:
        """Every ready callback, due timer and queued call: one pass (``ready`` None: what
        the loop's own epoll has ready now)."""
        if ready is None:
            try:
                ready = self._ep.poll(0)
            except InterruptedError:
                ready = ()
        readers = self._readers
        if len(ready) == 1:
            callbacks = readers.get(ready[0][0])
            if callbacks is not None:
                if len(callbacks) == 1:
                    callback = callbacks[0]
                    try:                # self._run, inline: the common wake-up
                        callback()
                    except Exception:  # noqa: BLE001
                        log.exception("%s: unhandled error in %r", self.name, callback)
                else:
                    self._run_all(callbacks)
        elif ready:
            batch = [readers.get(fd) for fd, _ in ready]
            for (fd, _), callbacks in zip(ready, batch):
                # An earlier callback of this batch may have unregistered (and closed) this
                # fd, and the number may even be registered again for something else.
                if callbacks is not None and readers.get(fd) is callbacks:
                    self._run_all(callbacks)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._run(timer.callback)
        # Only the calls queued so far: one that queues itself again (a queue with more
        # completions than its share of a pass) runs in the next pass, not in a loop here.
        calls = self._calls
        for _ in range(len(calls)):
            call = calls.popleft()
            try:                        # self._run, inline
                call()
            except Exception:  # noqa: BLE001
                log.exception("%s: unhandled error in %r", self.name, call)

    def _run_all(self, callbacks: list[Callable[[], object]]) -> None:
        for callback in tuple(callbacks):
            if callback in callbacks:
                self._run(callback)

    def _run(self, callback: Callable[[], object]) -> None:
        try:
            callback()
        except Exception:  # one bad callback must not take the loop (and every queue) down
            log.exception("%s: unhandled error in %r", self.name, callback)

    def run_forever(self) -> None:
        self._running = True
        self.ident = threading.get_ident()
        try:
            while not self._stopping:
                self.run_once(None)
        finally:
            self.ident = None
            self._running = False

    def start(self) -> threading.Thread:
        """Run the loop on a new daemon thread."""
        self.thread = threading.Thread(target=self.run_forever, name=self.name, daemon=True)
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        self._stopping = True
        self.call_soon_threadsafe(lambda: None)

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def close(self) -> None:
        self.closed = True
        self._unmove()
        self._readers.clear()
        self._ep.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

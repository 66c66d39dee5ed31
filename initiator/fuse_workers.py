"""A mount served by several processes: FUSE workers on cloned /dev/fuse descriptors.

One Python process drives about one core (its reactor thread and the GIL).  With
``--fuse-workers N`` (N > 1) the mount process starts N - 1 worker processes once the kernel's
INIT is answered.  Each worker opens /dev/fuse and attaches it to the mount's session
(``FUSE_DEV_IOC_CLONE``), connects its own share of the controller's I/O queues (Fabrics
Connect with QID > 0 and the controller's CNTLID, as the Linux host connects its I/O queues
from several CPUs) on its own reactor, and serves requests on its clone exactly as the mount
process serves them on the original.  The kernel gives each request to whichever descriptor
reads it first, so every process serves every kind of request; only the mount process
holds the admin queue (keep-alive, asynchronous events, reconnecting) and the mount.

* Queues: the controller is asked for max(-i, N) I/O queues; the granted ones are split in
  N contiguous runs as even as can be (:func:`~.connection.share_qids`), the mount process
  taking the first.
* A worker that dies (crash, kill) is started again (its requests in progress fail with
  ECONNABORTED: the kernel ends them when their descriptor closes); one that dies
  :data:`MAX_DEATHS` times in :data:`DEATH_WINDOW` seconds is left dead, and the others
  (the mount process always) serve on.  One that ends on purpose (SIGTERM: exit status 0)
  is not started again.
* Reconnecting: a lost controller takes the workers' queues with it.  They hold their
  commands (as the mount process does) until the mount process reconnects and tells them
  the new CNTLID, then connect their queues to it and re-issue what they held; when the
  mount process gives up (ctrl_loss_tmo), so do they.
* ``.status`` (which any process may be asked for) is made by the mount process, with each
  worker's pid, queues and counters fetched from it.
* Unmount or SIGTERM: the kernel ends every clone of the session (ENODEV), the mount process
  tells its workers to stop and waits for them (SIGKILL after :data:`STOP_TIMEOUT`); a worker
  whose mount process is gone (its control socket closes) stops by itself.

Longer than ~500 lines because both ends of the mount-process/worker channel live here (the
supervisor: start, restart, stop, status; the worker: clone, connect, serve, follow
reconnects), so a message and its answer are read side by side.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_conns
from typing import Any, Callable

from blockfabric.initiator.connection import share_qids
from blockfabric.initiator.fusefs import Counters, MountOptions, VolumeFS
from blockfabric.initiator.host import ConnectOptions, Controller, HostNamespace
from blockfabric.initiator.recovery import CtrlState
from blockfabric.protocol import IdentifyNamespace

log = logging.getLogger(__name__)

MAX_WORKERS = 64
#: Seconds a worker may take to start, clone the session and connect its queues.
SETUP_TIMEOUT = 60.0
#: Seconds the workers get to end at unmount before SIGKILL.
STOP_TIMEOUT = 10.0
#: Seconds .status waits for a worker's counters.
STATS_TIMEOUT = 2.0
#: A worker that dies this often within DEATH_WINDOW seconds is not started again.
MAX_DEATHS, DEATH_WINDOW = 3, 60.0
RESTART_DELAY = 1.0
#: Connect attempts of a (re)started worker: the target may not yet have noticed that the
#: queues of the worker it replaces are gone ("qid already connected").
CONNECT_TRIES, CONNECT_PAUSE = 10, 0.5


def check_count(count: int, options: MountOptions, conn: ConnectOptions) -> None:
    """ValueError unless a mount can run ``count`` FUSE worker processes."""
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"--fuse-workers: expected 1 to {MAX_WORKERS}, got {count}")
    if count == 1:
        return
    if options.binding != "kernel":
        raise ValueError("--fuse-workers needs the kernel binding (binding=kernel, the "
                         "default): libfuse's threads share one process")
    if conn.paths:
        raise ValueError("--fuse-workers with further paths (--path, multipath) is not "
                         "supported: use one path")


def _namespaces(ctrl: Controller) -> list[tuple]:
    return [(ns.nsid, ns.block_size, ns.nblocks, ns.read_only, ns.nguid,
             ns.identify.pack() if ns.identify is not None else None)
            for ns in ctrl.namespaces.values()]


def _stats(fs: VolumeFS, ctrl: Controller, qids: list[int]) -> dict[str, Any]:
    rec = ctrl.recovery_stats()
    return {"pid": os.getpid(), "queues": qids, "counters": fs.counters.values,
            "queue_stats": ctrl.queue_stats(), "queue_state": rec["state"],
            "reconnects": rec["reconnects"], "held": rec["held"], "retried": rec["retried"],
            "failed": rec["failed"]}


# --------------------------------------------------------------------------- mount process

@dataclasses.dataclass
class _Worker:
    index: int
    qids: list[int]
    proc: subprocess.Popen | None = None
    conn: Connection | None = None
    pid: int = 0
    state: str = "starting"         # starting, running, restarting, failed, stopped
    started: int = 0                # processes started for this slot
    deaths: list[float] = dataclasses.field(default_factory=list)
    last_exit: str = ""
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    reader: threading.Thread | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def send(self, msg: Any) -> bool:
        conn = self.conn
        if conn is None:
            return False
        try:
            with self.lock:
                conn.send(msg)
            return True
        except (OSError, ValueError):
            return False


class FuseWorkers:
    """The mount process's side: start, watch, restart, inform and stop the workers."""

    def __init__(self, fs: VolumeFS, master_fd: int, count: int, mountpoint: str,
                 fsname: str, on_change: Callable[[], None] | None = None) -> None:
        self.fs = fs
        self.ctrl = fs.ctrl
        self.master_fd = master_fd
        self.count = count
        self.mountpoint = mountpoint
        self.fsname = fsname
        self.on_change = on_change
        self.workers: list[_Worker] = []
        self.stopping = False
        self._seq = 0                   # controller announcements (reconnects)
        self._ids = itertools.count(1)
        self._waiting: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.ctrl.state_listeners.append(self._ctrl_changed)
        self.ctrl.namespace_listeners.append(self._ns_changed)

    # -- starting ---------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker and wait until each serves (or raise OSError with why)."""
        granted = self.ctrl.io_queues_granted
        self.workers = [_Worker(i, share_qids(granted, i, self.count))
                        for i in range(1, self.count)]
        for w in self.workers:
            self._spawn(w)
        failed, why = self._wait_ready(self.workers)
        if failed is not None:
            raise OSError(f"FUSE worker {failed.index}: {why}")

    def _config(self, w: _Worker) -> dict[str, Any]:
        ctrl = self.ctrl
        opts = dataclasses.replace(ctrl.opts, hostnqn=ctrl.hostnqn, hostid=ctrl.hostid)
        return {"index": w.index, "count": self.count, "qids": w.qids, "opts": opts,
                "options": self.fs.options, "cntlid": ctrl.cntlid, "seq": self._seq,
                "depth": ctrl.io_depth, "max_transfer": ctrl.max_transfer,
                "inline_size": ctrl.inline_size, "namespaces": _namespaces(ctrl),
                "mountpoint": self.mountpoint, "fsname": self.fsname,
                "log_level": logging.getLogger("blockfabric").getEffectiveLevel()}

    def _spawn(self, w: _Worker) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            w.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(self.master_fd)],
                pass_fds=(theirs.fileno(), self.master_fd), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        w.pid = w.proc.pid
        # its log goes where ours goes, now and after a daemon's stdio moved to /dev/null
        # (inheriting our stderr would keep a caller's pipe open for as long as it lives)
        threading.Thread(target=_copy_log, args=(w.proc.stderr,), daemon=True,
                         name=f"fuse-worker-{w.index}-log").start()
        w.conn = Connection(ours.detach())
        w.state = "starting"
        w.started += 1
        w.send(("config", self._config(w)))
        log.info("FUSE worker %d: pid %d, I/O queues %s", w.index, w.pid, _qids(w.qids))

    def _wait_ready(self, workers: list[_Worker]) -> tuple[_Worker | None, str]:
        """Wait until each of ``workers`` serves, answering every one's questions while
        they start (a worker connecting its queues asks where the controller stands, and
        one left unanswered would go on the last word it heard). ``(w, why)`` for the first
        that will not serve (it is then stopped), ``(None, '')`` once all do."""
        pending = list(workers)
        deadline = time.monotonic() + SETUP_TIMEOUT
        while pending:
            conns: list[Any] = [w.conn for w in pending]
            ready = wait_conns(conns, max(0.0, deadline - time.monotonic()))
            if not ready:
                return pending[0], self._not_started(
                    pending[0], f"not ready within {SETUP_TIMEOUT:g} s")
            for w in [w for w in pending if w.conn in ready]:
                conn = w.conn
                assert conn is not None
                try:
                    msg = conn.recv()
                except (EOFError, OSError) as exc:
                    return w, self._not_started(
                        w, f"exited while starting ({exc or 'no message'})")
                if msg[0] == "ctrl?":       # connecting, it asks where the controller is
                    w.send(self._ctrl_word())
                    continue
                if msg[0] != "ready":
                    return w, self._not_started(
                        w, str(msg[1]) if msg[0] == "error" else f"unexpected {msg[0]!r}")
                pending.remove(w)
                w.state = "running"
                w.reader = threading.Thread(target=self._read, args=(w, conn), daemon=True,
                                            name=f"fuse-worker-{w.index}")
                w.reader.start()
        return None, ""

    def _not_started(self, w: _Worker, why: str) -> str:
        """Stop worker ``w``, which will not serve; ``why``."""
        self._kill(w)
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        return why

    # -- watching -----------------------------------------------------------------------
    def _read(self, w: _Worker, conn: Connection) -> None:
        """Messages of one worker process, until it exits."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "stats":
                w.stats = msg[2]
                event = self._waiting.get(msg[1])
                if event is not None:
                    event.set()
            elif kind == "ctrl?":
                w.send(self._ctrl_word())
            elif kind == "status?":
                threading.Thread(target=self._answer_status, args=(w, msg[1]),
                                 daemon=True).start()
        if conn is w.conn:
            self._died(w)

    def _ctrl_word(self) -> tuple:
        """Where the controller stands, as a worker's ``announce`` takes it."""
        return ("ctrl", self._seq, self.ctrl.cntlid, self.ctrl.state.value)

    def _answer_status(self, w: _Worker, req: int) -> None:
        try:
            text = self.fs.status_text()
        except Exception as exc:  # noqa: BLE001  (the worker must get an answer)
            log.exception(".status for FUSE worker %d", w.index)
            text = f"(no status: {exc})\n".encode()
        w.send(("status", req, text))

    def _died(self, w: _Worker) -> None:
        proc = w.proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        if w.conn is not None:
            w.conn.close()
            w.conn = None
        if self.stopping:
            w.state = "stopped"
            return
        if code == 0:
            # it ended on purpose: told to (SIGTERM), or its session ended (the unmount,
            # which ends this process's serving too); only a crash or a kill is restarted
            w.state = "stopped"
            log.info("FUSE worker %d (pid %d) stopped", w.index, w.pid)
            self._changed()
            return
        self._relaunch(w, _exit_text(code))

    def _relaunch(self, w: _Worker, why: str) -> None:
        """Worker ``w`` died (or did not start again) for ``why``: start it again after
        RESTART_DELAY, unless that makes MAX_DEATHS within DEATH_WINDOW."""
        while why:
            now = time.monotonic()
            w.deaths = [t for t in w.deaths if now - t < DEATH_WINDOW] + [now]
            w.last_exit = why
            w.stats = {}
            if len(w.deaths) >= MAX_DEATHS:
                w.state = "failed"
                log.error("FUSE worker %d (pid %d) %s, %d times in %g s: not starting it "
                          "again; the mount serves on without it", w.index, w.pid, why,
                          len(w.deaths), DEATH_WINDOW)
                self._changed()
                return
            w.state = "restarting"
            log.error("FUSE worker %d (pid %d) %s: starting it again", w.index, w.pid, why)
            time.sleep(RESTART_DELAY)
            why = self._restart(w)

    def _restart(self, w: _Worker) -> str:
        """Start worker ``w`` again: '' once it serves (or when it is not for now: the
        mount is stopping, or its controller is not live), else why it did not start."""
        with self._lock:            # stop() sets stopping under it: no start after that
            if self.stopping or w.state != "restarting":
                return ""
            if self.ctrl.state.value != "live":
                return ""           # _ctrl_changed starts it once the controller is back
            try:
                self._spawn(w)
            except OSError as exc:
                return f"could not be started ({exc})"
        _, why = self._wait_ready([w])
        if why:
            return f"did not start: {why}"
        self._changed()
        return ""

    def _restart_later(self, w: _Worker) -> None:
        self._relaunch(w, self._restart(w))

    def _changed(self) -> None:
        if self.on_change is not None and not self.stopping:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001
                log.exception("recording the FUSE workers")

    # -- telling the workers ------------------------------------------------------------------
    def _ctrl_changed(self, ctrl: Controller) -> None:
        """After the mount's controller reconnected (or gave up): tell the workers."""
        with self._lock:
            self._seq += 1
            msg = ("ctrl", self._seq, ctrl.cntlid, ctrl.state.value)
        for w in self.workers:
            if w.state == "running":
                w.send(msg)
            elif w.state == "restarting" and ctrl.state.value == "live":
                threading.Thread(target=self._restart_later, args=(w,), daemon=True).start()

    def _ns_changed(self, ctrl: Controller, _nsids: set[int]) -> None:
        msg = ("namespaces", _namespaces(ctrl))
        for w in self.workers:
            if w.state == "running":
                w.send(msg)

    # -- what they did ------------------------------------------------------------------
    def stats(self) -> list[dict[str, Any]]:
        """Each running worker's counters, fresh (or the last ones, after a timeout)."""
        events = {}
        for w in self.workers:
            if w.state == "running":
                req = next(self._ids)
                events[req] = self._waiting[req] = threading.Event()
                w.send(("stats?", req))
        deadline = time.monotonic() + STATS_TIMEOUT
        for req, event in events.items():
            event.wait(max(0.0, deadline - time.monotonic()))
            self._waiting.pop(req, None)
        return [dict(w.stats, index=w.index, pid=w.pid, queues=w.qids, state=w.state,
                     restarts=max(0, w.started - 1), last_exit=w.last_exit)
                for w in self.workers]

    def record(self) -> list[dict[str, Any]]:
        """What the mount record says of the workers (``blockfabric list -o json``)."""
        own = share_qids(self.ctrl.io_queues_granted, 0, self.count)
        return [{"index": 0, "pid": os.getpid(), "queues": own, "state": "running"}] + [
            {"index": w.index, "pid": w.pid, "queues": w.qids, "state": w.state}
            for w in self.workers]

    # -- stopping -------------------------------------------------------------------------
    def stop(self) -> None:
        """Tell every worker to stop, wait for them, kill what is left."""
        with self._lock:
            self.stopping = True
        for w in self.workers:
            w.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT
        for w in self.workers:
            proc = w.proc
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("FUSE worker %d (pid %d) did not stop: killing it", w.index, w.pid)
                self._kill(w)
        for w in self.workers:
            if w.reader is not None:
                w.reader.join(5)
            self._kill(w)           # one started while we stopped (its reader was late)
            if w.conn is not None:
                w.conn.close()
                w.conn = None
            w.state = "stopped"

    def _kill(self, w: _Worker) -> None:
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def _copy_log(pipe: Any) -> None:
    for line in pipe:
        try:
            os.write(2, line)
        except OSError:
            pass
    pipe.close()


def _qids(qids: list[int]) -> str:
    return f"{qids[0]}-{qids[-1]}" if len(qids) > 1 else str(qids[0])


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def status_lines(fs: VolumeFS) -> tuple[list[str], list[dict[str, Any]]]:
    """.status's ``workers`` section, and each worker's stats (for the totals)."""
    pool: FuseWorkers = fs.workers
    stats = pool.stats()
    own = share_qids(fs.ctrl.io_queues_granted, 0, pool.count)
    c = fs.counters.values
    lines = [f"workers     {pool.count} processes serve FUSE requests on clones of one "
             f"session",
             f"  worker 0: pid {os.getpid()} (the mount process), running, I/O queues "
             f"{_qids(own)}, reads {c['reads']}, writes {c['writes']}, errors {c['errors']}"]
    for st in stats:
        counters = st.get("counters") or {}
        text = (f"  worker {st['index']}: pid {st['pid']}, {st['state']}, I/O queues "
                f"{_qids(st['queues'])}")
        if counters:
            text += (f" ({st['queue_state']}; reconnects {st['reconnects']}, held "
                     f"{st['held']}, retried {st['retried']}), reads {counters['reads']}, "
                     f"writes {counters['writes']}, errors {counters['errors']}")
        if st["restarts"]:
            text += f", restarted {st['restarts']} time(s) (last {st['last_exit']})"
        lines.append(text)
    return lines, stats


# --------------------------------------------------------------------------- worker process

class WorkerController(Controller):
    """A worker's I/O queues of the mount's controller: no admin queue, no keep-alive, no
    events; queues ``qids`` connected to controller ``cntlid``, which the mount process
    names again after each reconnect (:meth:`announce`)."""

    def __init__(self, opts: ConnectOptions, cfg: dict[str, Any]) -> None:
        super().__init__(opts)
        self.qids: list[int] = cfg["qids"]
        self.cntlid = cfg["cntlid"]
        self.io_depth = cfg["depth"]
        self.max_transfer = cfg["max_transfer"]
        self.inline_size = cfg["inline_size"]
        self._announced = (cfg["seq"], cfg["cntlid"], "live")
        self._seq_used = cfg["seq"]
        #: asks the mount process where its controller stands (the answer: announce)
        self.ask_ctrl: Callable[[], None] | None = None
        self.set_namespaces(cfg["namespaces"])

    def set_namespaces(self, described: list[tuple]) -> set[int]:
        """The namespaces as the mount process describes them, updated in place."""
        changed = set()
        seen = set()
        for nsid, bs, nblocks, read_only, nguid, raw in described:
            seen.add(nsid)
            ident = IdentifyNamespace.unpack_from(raw) if raw is not None else None
            ns = self.namespaces.get(nsid)
            if ns is None:
                self.namespaces[nsid] = HostNamespace(self, nsid, bs, nblocks, read_only,
                                                      nguid, ident)
                changed.add(nsid)
            elif (ns.block_size, ns.nblocks, ns.read_only) != (bs, nblocks, read_only):
                ns.block_size, ns.nblocks, ns.read_only, ns.identify = bs, nblocks, \
                    read_only, ident
                changed.add(nsid)
        for nsid in set(self.namespaces) - seen:
            self.namespaces.pop(nsid).active = False
            changed.add(nsid)
        return changed

    def _establish(self) -> None:
        """Connect our queues to controller ``cntlid``; a first connect tries again for a
        while (a restarted worker's queues may still be connected on the target: the old
        process's are dropped once the target notices they are gone)."""
        tries = CONNECT_TRIES if self.state == CtrlState.CONNECTING else 1
        # waiting for the mount process to reconnect is no try (up to the setup timeout)
        deadline = time.monotonic() + SETUP_TIMEOUT - 5
        attempt = 0
        while True:
            if attempt:
                # the controller may have been lost meanwhile: connect only to a live one,
                # and to the one it is now (never to one the mount process is setting up)
                time.sleep(CONNECT_PAUSE)
                seq, cntlid, state = self._ask()
                if state != CtrlState.LIVE.value:
                    log.info("connecting queues %s: the mount's controller is %s; waiting",
                             _qids(self.qids), state)
                    if state in (CtrlState.FAILED.value, CtrlState.CLOSED.value) or \
                            time.monotonic() > deadline:
                        raise ConnectionError(f"the mount's controller is {state}")
                    continue
                self.cntlid, self._seq_used = cntlid, seq
            attempt += 1
            try:
                self._connect_queues()
                return
            except Exception as exc:  # noqa: BLE001  (the last one is raised)
                if attempt >= tries:
                    raise
                self._teardown_queues(f"connect failed: {exc}")
                log.info("connecting queues %s: %s; again", _qids(self.qids), exc)

    def _connect_queues(self) -> None:
        with self._state_lock:
            self._gen += 1
        for qid in self.qids:
            queue = self.open_queue(qid, self.io_depth)
            self.io_queues.append(queue)
            self.fabrics_connect(queue, qid, self.io_depth - 1, 0)

    def shutdown(self, timeout: float = 2.0) -> None:
        pass                        # the mount process shuts the controller down

    def announce(self, seq: int, cntlid: int, state: str) -> None:
        """Where the mount's controller stands: ``seq`` counts its reconnects (and giving
        up), ``cntlid`` is its id now, ``state`` its state (live, reconnecting, failed)."""
        self._announced = (seq, cntlid, state)
        self._wake.set()
        if state == "live" and seq != self._seq_used and self.state == CtrlState.LIVE:
            # our queues belong to the controller that was lost, even if nothing noticed
            self._lost(f"the mount's controller reconnected as {cntlid}")

    def _ask(self) -> tuple[int, int, str]:
        """Where the mount's controller stands now (the last word heard, if no answer)."""
        if self.ask_ctrl is not None:
            self._wake.clear()
            self.ask_ctrl()
            self._wake.wait(STATS_TIMEOUT)
        return self._announced

    def _recover(self) -> None:
        """Connect our queues again once the mount's controller is live: at once if it
        is (only our queues were lost), else once the mount process has reconnected and
        names the controller; every reconnect_delay while that fails; give up with it."""
        self._teardown_queues(self.recovery.last_reason)
        while not self._closed:
            seq, cntlid, state = self._ask()
            if self._closed:
                break
            if state in (CtrlState.FAILED.value, CtrlState.CLOSED.value):
                self.recovery.last_reason = f"the mount's controller is {state}"
                self._give_up(self.recovery.last_reason)
                return
            if self._loss_deadline is not None and time.monotonic() >= self._loss_deadline:
                break
            if state == CtrlState.LIVE.value:
                self.recovery.attempts += 1
                self.cntlid, self._seq_used = cntlid, seq
                try:
                    self._establish()
                except Exception as exc:  # noqa: BLE001  (retry)
                    log.info("queues %s to controller %d: %s", _qids(self.qids), cntlid, exc)
                    self._teardown_queues(f"reconnect failed: {exc}")
                else:
                    self._resume(self.path_index)
                    return
            # until the mount process reconnects (a new seq), or reconnect_delay
            deadline = time.monotonic() + self.opts.reconnect_delay
            while not self._closed and self._announced[0] == seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
                self._wake.clear()
        self._give_up(f"ctrl_loss_tmo ({self.opts.ctrl_loss_tmo:g} s) expired")


class WorkerFS(VolumeFS):
    """The mount's files as a worker serves them: .status comes from the mount process."""

    status_waits = True

    def __init__(self, ctrl: WorkerController, options: MountOptions, link: _Link) -> None:
        super().__init__(ctrl, options)
        self.link = link

    def status_text(self) -> bytes:
        return self.link.ask_status()


class _Link:
    """The worker's end of its control socket: requests from the mount process on a thread
    of its own, and .status asked of it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._answers: dict[int, list] = {}
        self._cond = threading.Condition()

    def send(self, msg: Any) -> None:
        try:
            with self.lock:
                self.conn.send(msg)
        except (OSError, ValueError):
            pass

    def ask_status(self) -> bytes:
        req = next(self._ids)
        with self._cond:
            self._answers[req] = []
        self.send(("status?", req))
        with self._cond:
            self._cond.wait_for(lambda: self._answers[req], STATS_TIMEOUT * 3)
            got = self._answers.pop(req)
        if not got:
            raise OSError(5, "the mount process did not answer")
        return got[0]

    def answered(self, req: int, text: bytes) -> None:
        with self._cond:
            if req in self._answers:
                self._answers[req].append(text)
                self._cond.notify_all()


def worker_main(sock_fd: int, master_fd: int) -> int:
    """A FUSE worker process (``python -m blockfabric.initiator.fuse_workers``)."""
    from blockfabric.initiator.fuse_kernel import KernelFuse
    from blockfabric.initiator.fuse_mount import clone_fd
    conn = Connection(sock_fd)
    msg = conn.recv()
    cfg = msg[1]
    logging.basicConfig(level=cfg["log_level"],
                        format=f"%(asctime)s fuse-worker-{cfg['index']} %(levelname)s "
                               "%(name)s: %(message)s")
    link = _Link(conn)
    try:
        fd = clone_fd(master_fd)
        os.close(master_fd)
        ctrl = WorkerController(cfg["opts"], cfg)
    except Exception as exc:  # noqa: BLE001  (the mount process must hear why)
        link.send(("error", str(exc)))
        return 1
    ctrl.ask_ctrl = lambda: link.send(("ctrl?",))
    serving: dict[str, Any] = {}        # fs and server, once connected
    stopped = threading.Event()

    def control() -> None:
        """The mount process's requests, from before the connect (the answers to its
        questions) to the end."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break           # the mount process is gone
            kind = msg[0]
            if kind == "stats?" and "fs" in serving:
                link.send(("stats", msg[1], _stats(serving["fs"], ctrl, cfg["qids"])))
            elif kind == "status":
                link.answered(msg[1], msg[2])
            elif kind == "ctrl":
                ctrl.announce(*msg[1:])
            elif kind == "namespaces":
                if ctrl.set_namespaces(msg[1]):
                    for listener in list(ctrl.namespace_listeners):
                        listener(ctrl, set())
            elif kind == "stop":
                break
        stopped.set()
        if "server" in serving:
            serving["server"].stop()
    threading.Thread(target=control, daemon=True, name="fuse-worker-control").start()
    try:
        try:
            ctrl.connect()
        except Exception as exc:  # noqa: BLE001  (the mount process must hear why)
            link.send(("error", str(exc)))
            return 1
        fs = serving["fs"] = WorkerFS(ctrl, cfg["options"], link)
        server = KernelFuse(fs, cfg["mountpoint"], cfg["fsname"])
        server.adopt(fd)
        serving["server"] = server
        if stopped.is_set():
            server.stop()
        link.send(("ready", os.getpid()))
        server.serve()
    finally:
        ctrl.close()
    return 0


def counters_sum(parts: list[dict[str, int]]) -> dict[str, int]:
    """Counters of several processes as one (the largest_ ones: the largest)."""
    out = dict.fromkeys(Counters.NAMES, 0)
    for part in parts:
        for key, value in part.items():
            out[key] = max(out[key], value) if key in Counters.LARGEST else out[key] + value
    return out


if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1]), int(sys.argv[2])))

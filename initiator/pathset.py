"""ANA multipath: one subsystem reached through several paths (gateways) at once.

:class:`MultipathController` is what ``Controller(opts)`` returns when ``opts.paths`` names
further listeners.  It connects one :class:`~blockfabric.initiator.host.Controller` per path
at the same time (each its own admin and I/O queues and controller ID on one gateway, the
same subsystem NQN), checks that they are one subsystem (Identify CMIC's ANA bit and every
namespace's NGUID agree), reads each path's ANA log and routes I/O:

* to the paths whose ANA state for the namespace's group is **optimized**; if none, to the
  **non-optimized** ones; never to inaccessible, persistent-loss or changing ones;
* round-robin over the I/O queues of those paths.  Round-robin, not queue-depth: the
  choice is one index into a precomputed tuple (O(1), no counter to keep per completion),
  and our gateways in one ANA state serve alike, so keeping depth per path would cost the
  completion path work for nothing;
* a command that completes with a path-related status (SCT 3: ANA Inaccessible, Persistent
  Loss, Transition) or is lost with its queue is re-issued on another path, or held until a
  path can serve it; the caller sees an error only once every path has given up
  (ctrl_loss_tmo on each) or the controller is closed;
* ANA change events (each path's controller re-reads its log) and reconnects re-rank the
  paths; lost paths reconnect in the background (reconnect_delay, ctrl_loss_tmo).

The routes are rebuilt off the I/O path (event worker, reconnect threads, or the reactor on
a lost command) and swapped in as one dict; the per-I/O path reads that dict without a lock.
All paths share one reactor (so every completion runs on one thread, as with one path), one
protection domain and one arena: memory a caller registers (:attr:`pd`) is valid on every
path.  That needs every path to go through one RDMA device (always so with the soft
provider).

**Paths over different transports** (``--path tcp://ADDR:PORT`` with ``-t rdma``, or the
reverse): each path controller has its own transport (and RDMA provider); memory is still
registered once, through :class:`~blockfabric.initiator.sharedpd.SharedPD`.

Why one module of ~550 lines: it is one class with one invariant: routing, holding and
re-issuing commands, and re-ranking on what the paths report share the routes and the held
list under one lock (``_mp_lock``), which the per-I/O :meth:`MultipathController.issue`
reads with none.  Cut into mixins (as the host's Controller is), that invariant would span
files and each part be typed against the whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from blockfabric.errors import BlockfabricError
# relative: the host module this controller subclasses is the one that returns it
from .host import (Arena, ConnectOptions, Controller, ControllerLost, CtrlEvent, CtrlState,
                   HeldCommand, IoCommand, HostNamespace, NvmeError)
from blockfabric.fabric.tcp import local_pd
from blockfabric.initiator.multipath import format_path
from blockfabric.initiator.sharedpd import SharedPD
from blockfabric.protocol.identify import CMIC_ANA
from blockfabric.protocol.logpages import AnaState

if TYPE_CHECKING:
    from blockfabric.fabric.reactor import Timer
    from blockfabric.rdma import CMId

log = logging.getLogger(__name__)

_USABLE = (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED)
#: How often held commands look again for a path when no event said anything changed (an
#: ANA transition with no event, a lost event): each look re-reads the live paths' ANA logs.
HELD_POLL = 0.5


class SubsystemMismatch(BlockfabricError):
    """Two paths lead to different subsystems (or namespaces): not one multipath device."""


class MultipathController(Controller):
    """Several paths to one subsystem, used as one controller (see the module text)."""

    def __init__(self, opts: ConnectOptions) -> None:
        super().__init__(opts)
        self.path_ctrls: list[Controller] = []
        #: each path's transport: its own (tcp://, rdma://) or the primary one's
        self.transports = [opts.transport] + [p[2] if len(p) > 2 and p[2] else opts.transport
                                              for p in opts.paths]
        self._mixed = len(set(self.transports)) > 1
        self._pd_cmid: CMId | None = None   # a mixed set's RDMA device, when a TCP path came first
        for (address, port), transport in zip(self.paths, self.transports):
            popts = dataclasses.replace(opts, traddr=address, trsvcid=int(port), paths=[],
                                        transport=transport,
                                        hostnqn=self.hostnqn, hostid=self.hostid)
            pc = Controller(popts, share=self)
            pc.state_listeners.append(self._path_changed)
            pc.ana_listeners.append(self._ana_changed)
            pc.namespace_listeners.append(self._namespaces_changed)
            self.path_ctrls.append(pc)
        #: nsid -> ((path controller, queue), ...): where its I/O goes now
        self._route: dict[int, tuple] = {}
        self._serving: dict[int, frozenset[int]] = {}   # nsid -> path indexes serving it
        self._veto: set[tuple[int, int]] = set()    # (path, nsid) answered with SCT 3
        self._excluded: dict[int, str] = {}         # path -> why it is not this subsystem
        self._mp_lock = threading.RLock()
        self._poll_timer: Timer | bool | None = None    # (True: one is being made)
        self.failbacks = 0
        self.last_failover: float | None = None
        self.last_failback: float | None = None
        self.anatt = 0

    # -- set-up ------------------------------------------------------------------------
    def connect(self) -> MultipathController:
        self.reactor.start()
        errors: dict[int, BaseException] = {}

        def one(index: int, pc: Controller) -> None:
            try:
                pc._establish()
                with pc._state_lock:
                    pc._move(CtrlEvent.CONNECTED)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[index] = exc
                try:
                    pc._teardown_queues(f"connect failed: {exc}")
                except Exception:  # noqa: BLE001
                    log.debug("tearing down path %d", index, exc_info=True)
        threads = [threading.Thread(target=one, args=(i, pc), name=f"nvme-path{i}",
                                    daemon=True) for i, pc in enumerate(self.path_ctrls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(errors) == len(self.path_ctrls):
            self.close()
            raise errors[0]
        try:
            live = [pc for pc in self.path_ctrls if pc.state is CtrlState.LIVE]
            first = live[0]
            for pc in live[1:]:
                self._check_same(first, pc)
        except BaseException:
            self.close()
            raise
        for index, exc in sorted(errors.items()):
            pc = self.path_ctrls[index]
            log.warning("path %s: %s; retrying it in the background every %g s",
                        self._name(pc), exc, self.opts.reconnect_delay)
            if isinstance(exc, NvmeError) and exc.dnr:
                with pc._state_lock:
                    pc._move(CtrlEvent.REFUSED)
                pc.recovery.last_reason = str(exc)
            else:
                pc.reconnect_in_background(f"connect failed: {exc}")
        self.max_transfer = min(pc.max_transfer for pc in live)
        self.inline_size = min(pc.inline_size for pc in live)
        for nsid, pns in first.namespaces.items():
            self.namespaces[nsid] = HostNamespace(self, nsid, pns.block_size, pns.nblocks,
                                              pns.read_only, pns.nguid, pns.identify)
        self.state = CtrlState.LIVE
        self._rerank("connected")
        return self

    def _memory(self, transport: str, context: Any = None) -> tuple[Any, Arena]:
        """One protection domain and arena for every path (a path's queue asks, from its
        connect thread).  Paths of one transport share the device's (or a local) PD; a
        mixed set registers through a :class:`SharedPD` on the RDMA device, whose context a
        TCP path connecting first finds by resolving the first RDMA path's address."""
        with self._state_lock:
            if self.pd is None:
                if not self._mixed:
                    self.pd = context.alloc_pd() if transport == "rdma" else local_pd()
                else:
                    if context is None:
                        context = self._rdma_context()
                    # (a PD to its users: reg_mr and close)
                    self.pd = SharedPD(context.alloc_pd())  # type: ignore[assignment]
                self.arena = Arena(self.pd, self.opts.arena_size)  # type: ignore[arg-type]
            if self._mixed and transport == "rdma":
                return self.pd.inner, self.arena  # type: ignore[union-attr, return-value]
            return self.pd, self.arena  # type: ignore[return-value]  # (made together)

    def _rdma_context(self) -> Any:
        index = self.transports.index("rdma")
        address, port = self.paths[index]
        provider = self.path_ctrls[index].provider
        cmid = provider.create_id()  # type: ignore[union-attr]  # (an RDMA path's)
        try:
            cmid.resolve(address, port, timeout=self.opts.connect_timeout)
        except BaseException:
            cmid.close()
            raise
        self._pd_cmid = cmid
        return cmid.context

    def _name(self, pc: Controller) -> str:
        """A path as ``--path`` takes it: with its transport in a mixed set."""
        return format_path(*pc.path, pc.opts.transport if self._mixed else None)

    def path_names(self) -> list[str]:
        """Every path as :meth:`_name` writes it (``.status``)."""
        return [self._name(pc) for pc in self.path_ctrls]

    def _check_same(self, first: Controller, pc: Controller) -> None:
        """Raise SubsystemMismatch unless ``pc`` leads to the subsystem ``first`` does."""
        a, b = first.identify, pc.identify
        where = f"paths {self._name(first)} and {self._name(pc)}"
        if a is None or b is None:
            return
        if a.subnqn.strip("\0 ") != b.subnqn.strip("\0 "):
            raise SubsystemMismatch(f"{where} lead to different subsystems "
                                    f"({a.subnqn!r}, {b.subnqn!r})")
        if bool(a.cmic & CMIC_ANA) != bool(b.cmic & CMIC_ANA):
            raise SubsystemMismatch(f"{where}: one reports ANA (Identify CMIC bit 3) and "
                                    "the other not: not one gateway group")
        for nsid, ns in first.namespaces.items():
            other = pc.namespaces.get(nsid)
            if other is not None and ns.nguid != other.nguid:
                raise SubsystemMismatch(
                    f"{where}: namespace {nsid} has NGUID {ns.nguid.hex()} on one and "
                    f"{other.nguid.hex()} on the other: not the same namespace")

    # -- routing -------------------------------------------------------------------------
    def path_state(self, index: int, nsid: int) -> AnaState | None:
        """The ANA state of namespace ``nsid`` through path ``index`` as last read (None:
        the path does not report ANA, so it serves everything as optimized)."""
        if (index, nsid) in self._veto:
            return AnaState.INACCESSIBLE
        ana = self.path_ctrls[index].ana_log
        if ana is None:
            return None
        for group in ana[1]:
            if nsid in group.nsids:
                return group.state
        return AnaState.INACCESSIBLE

    def _rerank(self, why: str) -> None:
        """Rebuild the routes from the paths' states and ANA logs; re-issue held commands
        that now have a path; count failovers (a path leaves a namespace's route) and
        failbacks (an optimized path joins it)."""
        with self._mp_lock:
            live = [(i, pc) for i, pc in enumerate(self.path_ctrls)
                    if pc.state is CtrlState.LIVE and pc.io_queues and i not in self._excluded]
            route: dict[int, tuple] = {}
            serving: dict[int, frozenset[int]] = {}
            moved_off = moved_back = False
            for nsid in self.namespaces:
                best, fallback = [], []
                for i, pc in live:
                    state = self.path_state(i, nsid)
                    if state is None or state == AnaState.OPTIMIZED:
                        best.append((i, pc))
                    elif state == AnaState.NON_OPTIMIZED:
                        fallback.append((i, pc))
                chosen = best or fallback
                # interleaved (A q1, B q1, A q2, ...): consecutive I/Os alternate paths
                lanes = [[(pc, q) for q in pc.io_queues] for _, pc in chosen]
                route[nsid] = tuple(x for row in itertools.zip_longest(*lanes)
                                    for x in row if x is not None)
                now = frozenset(i for i, _ in chosen)
                before = self._serving.get(nsid)
                serving[nsid] = now
                if before is not None:
                    if before - now:
                        moved_off = True
                    if now - before:        # a path (back) in the route: failback
                        moved_back = True
            self._route = route
            self._serving = serving
            if moved_off:
                self.recovery.failovers += 1
                self.last_failover = time.time()
            if moved_back:
                self.failbacks += 1
                self.last_failback = time.time()
            primary = next((pc for i, pc in live), None) or next(
                (pc for pc in self.path_ctrls if pc.identify is not None), self.path_ctrls[0])
            self.admin, self.io_queues = primary.admin, primary.io_queues
            self.cntlid, self.identify = primary.cntlid, primary.identify
            self.authenticated = primary.authenticated
            self.ana_log = primary.ana_log
            if self.state is not CtrlState.CLOSED:
                states = {pc.state for pc in self.path_ctrls}
                self.state = (CtrlState.LIVE if live else CtrlState.RECONNECTING
                              if CtrlState.RECONNECTING in states else CtrlState.FAILED)
            held, self._held = self._held, []
        if moved_off or moved_back:
            log.warning("%s: paths re-ranked (%s): %s", self.opts.subnqn, why,
                        self.describe_routes())
        self._release(held)

    def describe_routes(self) -> str:
        return "; ".join(
            f"n{nsid} via " + (", ".join(self._name(self.path_ctrls[i])
                                         for i in sorted(idx)) or "no path")
            for nsid, idx in sorted(self._serving.items()))

    direct_queues = False           # issue_io: every command goes through issue() below

    def issue(self, cmd: IoCommand, queue: Any = None, held: bool = False) -> None:
        """Send ``cmd`` on the next queue of a path that serves its namespace best (the
        ``queue`` a caller names is a hint for one path; it is not used here), or hold it
        until one can (``held``: it was held already, and counted then).  No lock, no
        allocation: one dict look-up and one index."""
        route = self._route.get(cmd.nsid)
        if route:
            pc, q = route[next(self._rr) % len(route)]
            cmd.path = pc
            cmd.gen = pc._gen
            try:
                q.submit_rw(cmd, cmd.opcode, cmd.nsid, cmd.slba, cmd.nlb, cmd.addr,
                            cmd.length, cmd.rkey, cmd.data)
            except ConnectionError as exc:
                self._hold(cmd, exc)
            return
        self._park(cmd, held)

    def _dispatch(self, req: HeldCommand, held: bool = False) -> None:
        if isinstance(req, IoCommand):
            self.issue(req, held=held)
            return
        route = self._route.get(req.nsid)
        if not route:
            self._park(req, held)
            return
        pc, q = route[next(self._rr) % len(route)]
        req.path = pc
        req.gen = pc._gen
        try:
            req.send(self, q)
        except ConnectionError as exc:
            self._hold(req, exc)

    def _park(self, req: HeldCommand, held: bool = False) -> None:
        """No path serves ``req`` now: hold it for a re-rank, or fail it if none ever will
        (``held``: it was held before, and counted then; failing it counts as ``failed``)."""
        with self._mp_lock:
            if self.state is CtrlState.CLOSED or all(
                    pc.state in (CtrlState.FAILED, CtrlState.CLOSED)
                    for pc in self.path_ctrls):
                fail = True
                if held:
                    self.recovery.failed += 1
            else:
                fail = False
                self._held.append(req)
                if not held:
                    req.held += 1
                    self.recovery.held += 1
                if self._poll_timer is None:
                    self._poll_timer = True
                    self.reactor.call_soon_threadsafe(self._poll_later)
        if fail:
            why = self.recovery.last_reason or "every path gave up"
            self._lose([req], ControllerLost(f"no path left: {why}"))

    def _hold(self, req: HeldCommand, error: BaseException) -> None:
        """Lost with its queue (reactor thread, or a submitter): that path reconnects in
        the background; the command goes to another path now, or waits for one."""
        reason = str(error)
        req.held += 1
        pc = req.path
        self.recovery.held += 1
        self.recovery.last_reason = reason
        if pc is not None:
            if req.gen == pc._gen:          # not a leftover of an earlier connection
                pc._lost(reason)            # LIVE -> RECONNECTING at once (no wait)
            index = self.path_ctrls.index(pc)
            if any(index in s for s in self._serving.values()):
                self._rerank(f"path {self._name(pc)} lost: {reason}")
        self.recovery.retried += 1
        self._dispatch(req, held=True)

    def _path_status(self, req: HeldCommand, word: int, result: int) -> None:
        """SCT 3 (ANA Inaccessible, Persistent Loss, Transition...): not through this path
        for now.  Its ANA log is read again (the event worker), the path leaves the route
        for that namespace meanwhile, and the command goes to another path; with Do Not
        Retry set, the command completes with that status instead."""
        pc = req.path
        self.recovery.path_errors += 1
        if word & 0x8000:
            # Do Not Retry: not through another path either; the caller gets the status
            # (as the Linux host completes a path error with DNR, not fails it over)
            # (req: an I/O command, as the queues hand them here)
            Controller._path_status(self, req, word, result)  # type: ignore[arg-type]
            return
        if pc is not None:
            index = self.path_ctrls.index(pc)
            key = (index, req.nsid)
            if key not in self._veto:
                self._veto.add(key)
                log.info("path %s answered %#05x for namespace %s: re-reading its ANA log",
                         self._name(pc), (word >> 1) & 0x7FF, req.nsid)
                self._reread(pc)
                self._rerank(f"path {self._name(pc)}: status {(word >> 1) & 0x7FF:#05x}")
        self.recovery.retried += 1
        self._dispatch(req)

    def _reread(self, pc: Controller) -> None:
        if pc._events is None or pc.state is not CtrlState.LIVE:
            return

        def read() -> None:
            try:
                ana = pc.read_ana_log()
            except (BlockfabricError, ConnectionError, TimeoutError) as exc:
                log.info("re-reading the ANA log of %s: %s", self._name(pc), exc)
                return
            except Exception:   # (never lost silently in the executor)
                log.exception("re-reading the ANA log of %s failed", self._name(pc))
                return
            self._ana_changed(pc, ana)
        try:
            pc._events.submit(read)
        except RuntimeError:        # closing
            pass

    def _poll_later(self) -> None:
        self._poll_timer = self.reactor.call_later(HELD_POLL, self._poll)

    def _poll(self) -> None:
        """Held commands still waiting: look at every live path's ANA log again."""
        with self._mp_lock:
            self._poll_timer = None
            waiting = bool(self._held)
        if not waiting:
            return
        for pc in self.path_ctrls:
            self._reread(pc)
        self._rerank("held commands waiting")
        with self._mp_lock:
            if self._held and self._poll_timer is None:
                self._poll_timer = self.reactor.call_later(HELD_POLL, self._poll)

    def _release(self, held: list) -> None:
        for req in held:
            self._dispatch(req, held=True)

    # -- what the paths tell -------------------------------------------------------------
    def _ana_changed(self, pc: Controller, ana: tuple[int, list]) -> None:
        index = self.path_ctrls.index(pc)
        with self._mp_lock:
            self._veto = {k for k in self._veto if k[0] != index}
        self._rerank(f"ANA log of {self._name(pc)}: chgcnt {ana[0]}")

    def _path_changed(self, pc: Controller) -> None:
        if self._closing:           # our own close: nothing to re-rank
            return
        index = self.path_ctrls.index(pc)
        if pc.state is CtrlState.LIVE:
            live = [p for p in self.path_ctrls if p is not pc and p.state is CtrlState.LIVE]
            try:
                if live:
                    self._check_same(live[0], pc)
                self._excluded.pop(index, None)
            except SubsystemMismatch as exc:
                log.error("%s: leaving that path unused", exc)
                self._excluded[index] = str(exc)
            with self._mp_lock:
                self._veto = {k for k in self._veto if k[0] != index}
        else:
            self.recovery.last_reason = pc.recovery.last_reason
        self._rerank(f"path {self._name(pc)} {pc.state.value}")
        if all(p.state in (CtrlState.FAILED, CtrlState.CLOSED) for p in self.path_ctrls):
            with self._mp_lock:
                held, self._held = self._held, []
                self.recovery.failed += len(held)
            self._lose(held, ControllerLost(f"every path gave up: {pc.recovery.last_reason}"))

    def _namespaces_changed(self, pc: Controller, changed: set[int]) -> None:
        """A path saw namespaces added, removed or changed: bring ours along, in place."""
        mine = set()
        with self._mp_lock:
            for nsid in changed:
                pns = pc.namespaces.get(nsid)
                ns = self.namespaces.get(nsid)
                if pns is None:
                    if ns is not None:
                        ns.active = False
                        del self.namespaces[nsid]
                        mine.add(nsid)
                elif ns is None:
                    self.namespaces[nsid] = HostNamespace(self, nsid, pns.block_size,
                                                      pns.nblocks, pns.read_only, pns.nguid,
                                                      pns.identify)
                    mine.add(nsid)
                elif (ns.block_size, ns.nblocks, ns.read_only) != (
                        pns.block_size, pns.nblocks, pns.read_only):
                    ns.block_size, ns.nblocks, ns.read_only = (pns.block_size, pns.nblocks,
                                                               pns.read_only)
                    ns.identify = pns.identify
                    mine.add(nsid)
        if mine:
            self._rerank("namespaces changed")
        for listener in list(self.namespace_listeners):
            try:
                listener(self, mine)
            except Exception:
                log.exception("namespace listener %r failed", listener)

    # -- information ---------------------------------------------------------------------
    def paths_view(self) -> list[dict[str, Any]]:
        """Every path: address, controller state and ID, and per namespace its ANA state
        and whether I/O goes there now (``blockfabric connect``, ``.status``)."""
        out = []
        for i, pc in enumerate(self.path_ctrls):
            ana = {}
            for nsid in sorted(self.namespaces):
                state = self.path_state(i, nsid) if pc.state is CtrlState.LIVE else None
                ana[nsid] = ("optimized" if state is None and pc.state is CtrlState.LIVE
                             else state.name.lower().replace("_", "-") if state is not None
                           else "-")
            out.append({"path": self._name(pc), "state": pc.state.value,
                        "transport": "tcp" if pc.opts.transport == "tcp"
                        else f"rdma ({pc.provider.name} provider)",
                        "cntlid": pc.cntlid if pc.state is CtrlState.LIVE else None,
                        "ana": ana,
                        "serving": sorted(n for n, idx in self._serving.items() if i in idx),
                        "losses": pc.recovery.losses, "reconnects": pc.recovery.reconnects,
                        "excluded": self._excluded.get(i)})
        return out

    def paths_lines(self) -> list[str]:
        """One line per path, as ``nvme list-subsys`` shows them: address, controller
        state and ID, each namespace's ANA state, ``*`` where its I/O goes now, the
        transport (and RDMA provider)."""
        lines = []
        for p in self.paths_view():
            ana = ", ".join(f"n{nsid} {state}{'*' if nsid in p['serving'] else ''}"
                            for nsid, state in p["ana"].items())
            ctrl = f", controller {p['cntlid']}" if p["cntlid"] is not None else ""
            over = p["transport"].replace(" (", ", ").rstrip(")")
            lines.append(f"{p['path']} {p['state']}{ctrl}: {ana or 'no namespaces'} "
                         f"(over {over})"
                         + (f" (not used: {p['excluded']})" if p["excluded"] else ""))
        return lines

    def recovery_stats(self) -> dict[str, Any]:
        with self._mp_lock:
            out = self.recovery.as_dict()
            serving = sorted({i for idx in self._serving.values() for i in idx})
            out.update(state=self.state.value,
                       path=", ".join(self._name(self.path_ctrls[i]) for i in serving)
                       or "-",
                       held_now=len(self._held), failbacks=self.failbacks,
                       reconnects=sum(pc.recovery.reconnects for pc in self.path_ctrls),
                       losses=sum(pc.recovery.losses for pc in self.path_ctrls),
                       attempts=sum(pc.recovery.attempts for pc in self.path_ctrls),
                       last_failover=self.last_failover, last_failback=self.last_failback)
        return out

    def queue_stats(self) -> dict[int, dict[str, int]]:
        """Every live path's queues, numbered path * 1000 + qid past the first path."""
        out: dict[int, dict[str, int]] = {}
        for i, pc in enumerate(self.path_ctrls):
            for qid, st in pc.queue_stats().items():
                out[i * 1000 + qid] = st
        return out

    def shutdown(self, timeout: float = 2.0) -> None:
        for pc in self.path_ctrls:
            if pc.state is CtrlState.LIVE:
                pc.shutdown(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True
        for pc in self.path_ctrls:
            try:
                pc.close()
            except Exception:  # noqa: BLE001 - close the others all the same
                log.exception("closing path %s", self._name(pc))
        with self._mp_lock:
            self.state = CtrlState.CLOSED
            self._route = {}
        self.admin, self.io_queues = None, []
        super().close()
        if self._pd_cmid is not None:
            self._pd_cmid.close()
            self._pd_cmid = None

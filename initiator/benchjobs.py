"""``blockfabric bench --numjobs N``: one process per job, as fio runs its jobs.

A Python process drives about one core (its controller's reactor thread and the GIL), so
jobs that share a process share that core; in their own processes they use as many cores as
there are jobs.  Each job process connects its own controller (its own queues and reactor)
and lays its job out exactly as job number ``index`` of a one-process run would be (same
seed, same slice of the namespace with --verify), then waits: the parent starts them all at
once when every one is connected, shows the progress line from the counts they send twice a
second, and merges their results, every latency included, into fio's report (one per job,
or one for all with --group_reporting).  ``--thread`` keeps the jobs in one process (fio's
option of that name).

With a placement (``--cpus``, or the NUMA node of the NIC the route to the target leaves
by) each job process is pinned to its own share of the CPUs
(:func:`blockfabric.numa.worker_placement`) and its memory placed on the node.

Ctrl-C: the job processes ignore SIGINT; the parent asks each to stop, and they drain what
is in flight and report, as a one-process run does.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from blockfabric import numa
from blockfabric.errors import BlockfabricError
from blockfabric.initiator.bench import Bench
from blockfabric.initiator.benchopts import BenchError, BenchOptions
from blockfabric.initiator.benchreport import JobResult, Progress, make_result

#: Seconds between a job process's progress counts.
TICK = 0.5
#: Seconds a job process may take to start and connect (spawn imports the package).
SETUP_TIMEOUT = 60.0
#: Seconds a job process may take to end after its result (or a stop) before it is killed.
EXIT_TIMEOUT = 40.0


class _Stop(KeyboardInterrupt):
    """The parent asked this job to stop (its Ctrl-C): Bench.run drains as on a Ctrl-C."""


def _job_process(conn: Connection, opts: BenchOptions, connect_opts: Any, index: int,
                 placement: numa.Placement) -> None:
    """One job, in its own process (the target of a spawned multiprocessing.Process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the parent says when to stop
    numa.place_worker(placement, index, opts.numjobs)
    bench = Bench(dataclasses.replace(opts, eta="never"), connect_opts, only=[index])
    try:
        try:
            bench.setup()
        except (BlockfabricError, OSError, TimeoutError, ValueError) as exc:
            conn.send(("error", str(exc)))
            return
        conn.send(("ready", os.getpid()))
        if conn.recv() != "go":
            return
        last = [0.0]

        def tick() -> None:
            now = time.monotonic()
            if now - last[0] >= TICK:
                last[0] = now
                conn.send(("tick", bench.totals()))
            try:
                stop = conn.poll()
            except (EOFError, OSError):
                stop = True
            if stop:
                raise _Stop
        bench.run(on_tick=tick)
        ctrl = bench.controllers[0] if bench.controllers else None
        conn.send(("done", bench.job_results(), bench.interrupted, {
            **bench.controller_stats(),
            "job": index, "cpus": numa.format_cpulist(os.sched_getaffinity(0)),
            "paths": [list(p) for p in ctrl.paths] if ctrl else []}))
    except (EOFError, BrokenPipeError):
        pass                                # the parent is gone: nobody to report to
    finally:
        bench.close()


class ProcessBench:
    """``numjobs`` job processes behind :class:`~blockfabric.initiator.bench.Bench`'s
    interface (setup, run, result, errors, close, interrupted)."""

    def __init__(self, opts: BenchOptions, connect_opts: Any, placement: numa.Placement,
                 err=sys.stderr) -> None:
        self.opts = opts
        self.connect_opts = connect_opts
        self.placement = placement
        self.err = err
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.pids: list[int | None] = []
        self.ticks: list[tuple[int, int, int, int]] = []
        self.results: list[JobResult] = []
        self.extras: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.interrupted = False
        self._pending: set[int] = set()

    def setup(self) -> None:
        n = self.opts.numjobs
        ctx = multiprocessing.get_context("spawn")     # no threads or sockets inherited
        for j in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_job_process, name=f"blockfabric-bench-job{j}",
                               args=(theirs, self.opts, self.connect_opts, j,
                                     self.placement),
                               daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
            self.pids.append(None)
            self.ticks.append((0, 0, 0, 0))
        problems = []
        deadline = time.monotonic() + SETUP_TIMEOUT
        for j, conn in enumerate(self.conns):
            msg = self._recv(j, deadline - time.monotonic())
            if msg is None:
                problems.append(f"job {j}: not connected within {SETUP_TIMEOUT:.0f} s")
            elif msg[0] == "error":
                problems.append(msg[1] if n == 1 else f"job {j}: {msg[1]}")
            else:
                self.pids[j] = msg[1]
        if problems:
            raise BenchError("; ".join(dict.fromkeys(problems)))

    def _recv(self, j: int, timeout: float) -> tuple | None:
        conn = self.conns[j]
        try:
            if conn.poll(max(0.0, timeout)):
                return conn.recv()
        except (EOFError, OSError):
            self.procs[j].join(1)
            return ("error", f"its process ended (exit status {self.procs[j].exitcode})")
        return None

    def run(self) -> None:
        for conn in self.conns:
            conn.send("go")
        self._pending = set(range(len(self.conns)))
        progress = Progress(self.totals, self.opts, self.err, self.opts.eta)
        t0 = time.monotonic()
        try:
            try:
                self._collect(progress, t0)
            except KeyboardInterrupt:
                self.interrupted = True
                for j in self._pending:
                    try:
                        self.conns[j].send("stop")
                    except OSError:
                        pass
                self._collect(progress, t0)
        finally:
            progress.close()

    def _collect(self, progress: Progress, t0: float) -> None:
        """Progress counts and results until every job process has reported."""
        while self._pending:
            by_conn = {id(self.conns[j]): j for j in self._pending}
            for conn in wait([self.conns[j] for j in self._pending], timeout=0.25):
                j = by_conn[id(conn)]
                try:
                    msg: Any = conn.recv()  # type: ignore[union-attr,call-arg]  # a Connection
                except (EOFError, OSError):
                    self._pending.discard(j)
                    self.procs[j].join(1)
                    self.failures.append(f"job {j}: its process ended without a result "
                                         f"(exit status {self.procs[j].exitcode})")
                    continue
                if msg[0] == "tick":
                    self.ticks[j] = msg[1]
                elif msg[0] == "done":
                    self._pending.discard(j)
                    self.results.extend(msg[1])
                    self.interrupted |= msg[2]
                    self.extras.append(msg[3])
            progress.tick(time.monotonic() - t0)

    def totals(self) -> tuple[int, int, int, int]:
        return tuple(sum(t[i] for t in self.ticks) for i in range(4))  # type: ignore

    def errors(self) -> list[str]:
        return self.failures + [e for r in self.results for e in r.errors]

    def result(self) -> dict[str, Any]:
        results = sorted(self.results, key=lambda r: r.index)
        extras = {e["job"]: e for e in self.extras}
        first = self.extras[0] if self.extras else {}
        from blockfabric.initiator.multipath import format_path
        return make_result(self.opts, self.connect_opts, results, {
            "controllers": "per-process",
            "provider": first.get("provider"),
            "nsid": first.get("nsid"),
            "interrupted": self.interrupted,
            # each job process: where it ran and what it did (the jobs' reports add up
            # to these, and with --group_reporting the one report is their sum)
            "processes": [{"job": r.index, "pid": r.pid, "cpus": extras[r.index]["cpus"],
                           "read_ios": r.stats["read"].ios, "write_ios": r.stats["write"].ios,
                           "read_bytes": r.stats["read"].bytes,
                           "write_bytes": r.stats["write"].bytes} for r in results],
            "queue_stats": [q for e in self.extras for q in e["queue_stats"]],
            "paths": [format_path(*p) for p in first.get("paths", [])],
            "recovery": [r for e in self.extras for r in e["recovery"]],
            "ana_paths": [a for e in self.extras for a in e["ana_paths"]],
        })

    def close(self) -> None:
        for j, proc in enumerate(self.procs):
            if proc.is_alive() and (j in self._pending or self.pids[j] is None):
                try:
                    self.conns[j].send("stop")
                except OSError:
                    pass
        deadline = time.monotonic() + EXIT_TIMEOUT
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

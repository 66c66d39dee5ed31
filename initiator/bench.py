"""``blockfabric bench``: fio-style load driven through the host library, with no FUSE.

It measures the NVMe-oF path alone, so that a number taken through the FUSE mount (with the
fio job files in benchmarks/fio/) can be compared with what the fabric itself delivers.
This module owns the run and the command: connect, lay the jobs out over the namespace,
start them, watch the clock and the progress line, drain, collect and print.  One job's
I/O loop (on the reactor thread) is :mod:`.benchio`; the options are in :mod:`.benchopts`,
the --verify block format in :mod:`.benchverify`, statistics and fio's JSON and text in
:mod:`.benchreport`, and ``--numjobs`` as processes in :mod:`.benchjobs`.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import time
from typing import Any, Callable

# BenchError, BenchOptions, parse_fio_size, JobResult, make_result: also imported from here
# (their home before the split), so the old import path keeps working
from blockfabric.initiator.benchio import Job
from blockfabric.initiator.benchopts import (BenchError, BenchOptions,  # noqa: F401
                                             options_from_args, parse_fio_size)
from blockfabric.initiator.benchreport import (JobResult, Progress,  # noqa: F401
                                               format_text, make_result)
from blockfabric.initiator.host import Controller
from blockfabric.initiator.multipath import format_path

DRAIN_TIMEOUT = 30.0


# --------------------------------------------------------------------------- the run

class Bench:
    """Connect, lay the jobs out over the namespace, run, and collect results."""

    def __init__(self, opts: BenchOptions, connect_opts: Any, err=sys.stderr,
                 only: list[int] | None = None) -> None:
        self.opts = opts
        self.connect_opts = connect_opts
        self.err = err
        #: the jobs this process runs (benchjobs.py runs one per process); None: all
        self.only = only
        self.controllers: list[Controller] = []
        self.jobs: list[Job] = []
        self.interrupted = False

    def _connect(self) -> Controller:
        ctrl = Controller(self.connect_opts).connect()
        self.controllers.append(ctrl)
        return ctrl

    def setup(self) -> None:
        opts = self.opts
        per_job = opts.controllers == "per-job"
        ctrl = self._connect()
        nsid = opts.nsid if opts.nsid is not None else min(ctrl.namespaces, default=None)
        if nsid not in ctrl.namespaces:
            raise BenchError(f"namespace {nsid} is not active on {self.connect_opts.subnqn} "
                             f"(active: {sorted(ctrl.namespaces) or 'none'})")
        if opts.writes and ctrl.namespaces[nsid].read_only:
            raise BenchError(f"namespace {nsid} is read-only")
        start, size = opts.layout(ctrl.namespaces[nsid], ctrl.max_transfer)
        split = bool(opts.verify and opts.writes and opts.numjobs > 1)
        here = list(range(opts.numjobs)) if self.only is None else self.only
        for local, j in enumerate(here):
            if per_job and local:
                ctrl = self._connect()
            if per_job:
                local = 0
            queues = ctrl.io_queues
            slots_here = (opts.iodepth if per_job else opts.iodepth * len(here))
            room = len(queues) * min(q.depth for q in queues)
            if slots_here > room:
                raise BenchError(f"{slots_here} commands in flight per controller exceed its "
                                 f"{len(queues)} I/O queue(s) of depth {queues[0].depth}: "
                                 f"raise --nr-io-queues or --queue-size")
            base = local * opts.iodepth
            rotated = [queues[(base + k) % len(queues)] for k in range(len(queues))]
            self.jobs.append(Job(j, opts, ctrl, ctrl.namespaces[nsid],
                                 start + (j * size if split else 0), size, rotated))

    def run(self, on_tick: Callable[[], None] | None = None) -> None:
        """Run the jobs to their end (``on_tick``: called a few times a second)."""
        opts = self.opts
        for job in self.jobs:
            job.ctrl.reactor.call_soon_threadsafe(job.begin)
        t0 = time.monotonic()
        ramp_end = t0 + opts.ramp_time
        ramped = opts.ramp_time <= 0
        limit = opts.ramp_time + opts.runtime if (opts.time_based or opts.runtime > 0) \
            else None
        progress = Progress(self.totals, opts, self.err, opts.eta)
        try:
            while not all(j.finished.is_set() for j in self.jobs):
                now = time.monotonic()
                if not ramped and now >= ramp_end:
                    ramped = True
                    for job in self.jobs:
                        job.ctrl.reactor.call_soon_threadsafe(job.begin_measure)
                if limit is not None and now - t0 >= limit:
                    break
                if any(j.errors for j in self.jobs):
                    break
                wake = 1.0 - ((now - t0) % 1.0)
                if limit is not None:
                    wake = min(wake, t0 + limit - now)
                if not ramped:
                    wake = min(wake, ramp_end - now)
                self.jobs[0].finished.wait(max(0.001, min(wake, 0.25)))
                progress.tick(time.monotonic() - t0)
                if on_tick is not None:
                    on_tick()
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self._drain()
            progress.close()

    def _drain(self) -> None:
        """Stop the workloads and wait for what is in flight (and any verify read-back),
        giving up only when nothing has completed for DRAIN_TIMEOUT seconds."""
        for job in self.jobs:
            job.ctrl.reactor.call_soon_threadsafe(job.stop)
        seen, quiet_since = -1, time.monotonic()
        while not all(j.finished.is_set() for j in self.jobs):
            done = sum(j.completions for j in self.jobs)
            if done != seen:
                seen, quiet_since = done, time.monotonic()
            elif time.monotonic() - quiet_since > DRAIN_TIMEOUT:
                for job in self.jobs:
                    if not job.finished.is_set():
                        job.errors.append(f"job {job.index}: {job.inflight} command(s) did "
                                          f"not complete within {DRAIN_TIMEOUT:.0f} s")
                        job.error_kind = job.error_kind or errno.ETIMEDOUT
                return
            next(j for j in self.jobs if not j.finished.is_set()).finished.wait(0.5)

    def close(self) -> None:
        for job in self.jobs:
            try:
                job.close()
            except Exception as exc:  # noqa: BLE001 - the controllers must still go
                print(f"blockfabric bench: releasing job {job.index}'s memory: {exc}",
                      file=self.err)
        for ctrl in self.controllers:
            ctrl.close()
        self.controllers = []

    # -- results -------------------------------------------------------------------------
    def errors(self) -> list[str]:
        return [e for j in self.jobs for e in j.errors]

    def totals(self) -> tuple[int, int, int, int]:
        """Read I/Os, read bytes, write I/Os, write bytes so far (for the progress line)."""
        r = [j.stats["read"] for j in self.jobs]
        w = [j.stats["write"] for j in self.jobs]
        return (sum(s.ios for s in r), sum(s.bytes for s in r),
                sum(s.ios for s in w), sum(s.bytes for s in w))

    def job_results(self) -> list[JobResult]:
        stats = {id(c): c.queue_stats() for c in self.controllers}
        return [j.result(stats.get(id(j.ctrl), {})) for j in self.jobs]

    def controller_stats(self) -> dict[str, Any]:
        """What the run's controllers report, for the result's "blockfabric" section (a job
        process sends it back to its parent: benchjobs.py)."""
        first = self.controllers[0] if self.controllers else None
        return {
            "provider": first.provider.name if first else None,
            "nsid": self.jobs[0].ns.nsid if self.jobs else None,
            "queue_stats": [{str(q): s for q, s in c.queue_stats().items()}
                            for c in self.controllers],
            # Reconnects and failovers during the run (see docs/reliability.md).
            "recovery": [c.recovery_stats() for c in self.controllers],
            "ana_paths": [c.paths_view() for c in self.controllers
                          if hasattr(c, "paths_view")],
        }

    def result(self) -> dict[str, Any]:
        first = self.controllers[0] if self.controllers else None
        return make_result(self.opts, self.connect_opts, self.job_results(), {
            "controllers": self.opts.controllers, "interrupted": self.interrupted,
            **self.controller_stats(),
            "paths": [format_path(a, p) for a, p in first.paths] if first else [],
        })


# --------------------------------------------------------------------------- command

def cmd_bench(args: argparse.Namespace) -> int:
    from blockfabric import numa
    from blockfabric.initiator.benchjobs import ProcessBench
    from blockfabric.initiator.commands import options
    opts = options_from_args(args)
    connect_opts = options(args, args.nqn)
    processes = opts.numjobs > 1 and not opts.thread
    try:        # --cpus, or the route's NIC's node (best effort; logged)
        placement = numa.place_host(connect_opts.traddr, opts.cpus,
                                    rdma=connect_opts.transport == "rdma", apply_now=not processes)
    except numa.PlacementError as exc:
        raise BenchError(str(exc)) from None
    bench = (ProcessBench(opts, connect_opts, placement) if processes
             else Bench(opts, connect_opts))
    try:
        bench.setup()
        bench.run()
        result = bench.result()
        result["blockfabric"]["placement"] = placement.as_dict()
    finally:
        bench.close()
    if args.output_format == "json":
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_text(result))
    sys.stdout.flush()
    errors = bench.errors()
    for message in errors[:10]:
        print(f"blockfabric bench: {message}", file=sys.stderr)
    if len(errors) > 10:
        print(f"blockfabric bench: ... and {len(errors) - 10} more", file=sys.stderr)
    if errors:
        return 1
    return 130 if bench.interrupted else 0

"""I/O counters and latency histograms, and their Prometheus text exposition.

The hot path pays for one ``perf_counter_ns`` pair, one ``bisect`` over 16 bucket bounds and a
few integer additions per I/O (for the namespace and the controller together: :func:`done_pair`;
the count of I/Os is the buckets' sum, not kept apart), on the reactor thread, with no lock:
only the reactor writes
these numbers, and a scrape copies them on the reactor (``Reactor.call_sync``) before
formatting.  That is why the exposition is written by hand instead of using
prometheus_client: its metric objects take a lock on every increment, and it would be a new
dependency for about sixty lines of text formatting.
"""

from __future__ import annotations

import bisect
import http.server
import logging
import socket
import threading
import time
from bisect import bisect_left
from time import perf_counter_ns
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from blockfabric.logutil import printable

log = logging.getLogger(__name__)

#: Upper bounds of the latency buckets, in seconds (a Prometheus ``le`` label each).
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                   50e-3, 100e-3, 250e-3, 500e-3, 1.0, 5.0)
#: the same bounds in nanoseconds, for ``bisect_left`` of an elapsed ``perf_counter_ns``
BOUNDS_NS = [int(b * 1e9) for b in LATENCY_BUCKETS]
_BOUNDS_NS = BOUNDS_NS

READ, WRITE = 0, 1


class IoStats:
    """Counts for one namespace, controller or subsystem; index 0 reads, 1 writes."""

    __slots__ = ("bytes", "errors", "buckets", "latency_ns", "inflight")

    def __init__(self) -> None:
        self.bytes = [0, 0]
        self.errors = 0
        # One more bucket than bounds: the +Inf bucket.  Stored per bucket, cumulated when
        # exposed, so that an update touches one slot.
        self.buckets = [[0] * (len(_BOUNDS_NS) + 1), [0] * (len(_BOUNDS_NS) + 1)]
        self.latency_ns = [0, 0]
        self.inflight = 0

    @property
    def ops(self) -> list[int]:
        """Reads and writes completed without error: the sum of each one's buckets (every
        one lands in exactly one, so the per-I/O path counts it there only)."""
        return [sum(self.buckets[READ]), sum(self.buckets[WRITE])]

    def done(self, direction: int, nbytes: int, started_ns: int, ok: bool) -> None:
        """One read or write finished (``started_ns`` from ``time.perf_counter_ns``)."""
        elapsed = time.perf_counter_ns() - started_ns
        if ok:
            self.bytes[direction] += nbytes
            self.buckets[direction][bisect.bisect_left(_BOUNDS_NS, elapsed)] += 1
            self.latency_ns[direction] += elapsed
        else:
            self.errors += 1

    def add(self, other: IoStats) -> None:
        """Fold ``other`` in (a subsystem keeps the history of a removed namespace)."""
        for d in (READ, WRITE):
            self.bytes[d] += other.bytes[d]
            self.latency_ns[d] += other.latency_ns[d]
            self.buckets[d] = [a + b for a, b in zip(self.buckets[d], other.buckets[d])]
        self.errors += other.errors

    def copy(self) -> IoStats:
        out = IoStats()
        out.add(self)
        out.inflight = self.inflight
        return out

    def as_dict(self) -> dict[str, int]:
        return {"reads": self.ops[READ], "writes": self.ops[WRITE],
                "read_bytes": self.bytes[READ], "written_bytes": self.bytes[WRITE],
                "errors": self.errors, "inflight": self.inflight}


def done_pair(a: IoStats, b: IoStats, direction: int, nbytes: int, started_ns: int) -> None:
    """One read or write finished without error, counted in ``a`` and ``b`` (a namespace
    and a controller) with one clock read and one bucket search: the per-I/O path."""
    elapsed = perf_counter_ns() - started_ns
    bucket = bisect_left(_BOUNDS_NS, elapsed)
    a.bytes[direction] += nbytes
    a.buckets[direction][bucket] += 1
    a.latency_ns[direction] += elapsed
    b.bytes[direction] += nbytes
    b.buckets[direction][bucket] += 1
    b.latency_ns[direction] += elapsed


# --- exposition ------------------------------------------------------------------------------

@dataclass
class Family:
    """One metric family: name, type, help, and its samples (labels, value)."""

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _escape(value: str) -> str:
    """A label value as the text format wants it: backslash, double quote and newline
    escaped.  Label values include host NQNs, a peer's bytes: anything not printable (a
    newline, a surrogate escape of bytes that were not UTF-8) is first made visible text by
    :func:`printable`, so no value can break a line or the UTF-8 of the page."""
    return printable(value).replace("\\", "\\\\").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value)) if value != float("inf") else "+Inf"


def render(families: Iterable[Family]) -> str:
    """The Prometheus text format (version 0.0.4)."""
    lines = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            suffix = ""
            if "__suffix" in labels:
                labels = dict(labels)
                suffix = labels.pop("__suffix")
            lines.append(f"{fam.name}{suffix}{_labels(labels)} {_number(value)}")
    return "\n".join(lines) + "\n"


class IoFamilies:
    """The I/O families of one level (subsystem, namespace or controller)."""

    def __init__(self, level: str) -> None:
        p = f"blockfabric_{level}"
        self.ops = Family(f"{p}_io_total", "counter",
                          f"Reads and writes completed without error, per {level}.")
        self.bytes = Family(f"{p}_io_bytes_total", "counter",
                            f"Bytes moved by completed reads and writes, per {level}.")
        self.errors = Family(f"{p}_io_errors_total", "counter",
                             f"I/O commands that completed with an error status, per {level}.")
        self.latency = Family(f"{p}_io_latency_seconds", "histogram",
                              f"Time from command to response, per {level}.")
        self.inflight = Family(f"{p}_io_inflight", "gauge",
                               f"I/O commands being executed now, per {level}.")

    def add(self, labels: dict[str, str], stats: IoStats) -> None:
        for d, op in ((READ, "read"), (WRITE, "write")):
            lab = dict(labels, op=op)
            self.ops.samples.append((lab, stats.ops[d]))
            self.bytes.samples.append((lab, stats.bytes[d]))
            total = 0
            for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), stats.buckets[d]):
                total += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                self.latency.samples.append((dict(lab, le=le, __suffix="_bucket"), total))
            self.latency.samples.append((dict(lab, __suffix="_sum"),
                                         stats.latency_ns[d] / 1e9))
            self.latency.samples.append((dict(lab, __suffix="_count"), total))
        self.errors.samples.append((labels, stats.errors))
        self.inflight.samples.append((labels, stats.inflight))

    def families(self) -> list[Family]:
        return [self.ops, self.bytes, self.errors, self.latency, self.inflight]


# --- the HTTP listener -------------------------------------------------------------------

class _HTTPServer6(http.server.HTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``GET /metrics`` on a small thread; ``collect()`` returns the exposition text."""

    def __init__(self, address: str, port: int, collect: Callable[[], str]) -> None:
        collector = collect

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = collector().encode("utf-8", "backslashreplace")
                except Exception as exc:  # a scrape must not kill the thread
                    log.warning("metrics scrape failed: %s", exc)
                    self.send_error(503, "the target did not answer")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("metrics: " + fmt, *args)

        server_class = _HTTPServer6 if ":" in address else http.server.HTTPServer
        self.httpd = server_class((address, port), Handler)
        self.address = address
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics",
                                       daemon=True)

    def start(self) -> MetricsServer:
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join(5)
        self.httpd.server_close()


def placement_families(pl: dict[str, Any] | None) -> list[Family]:
    """Where the reactor runs and where placed memory lives (docs/numa.md)."""
    if not pl:
        return []
    reactor = pl["reactor"]
    info = Family("blockfabric_reactor_placement_info", "gauge",
                  "1, labelled with the reactor's allowed CPUs, their NUMA node(s) and the "
                  "configured memory node (none: not placed).",
                  [({"cpus": reactor["cpus"], "nodes": ",".join(map(str, reactor["nodes"])),
                     "memory_node": "none" if pl["node"] is None else str(pl["node"]),
                     "memory_policy": pl["memory_policy"]}, 1)])
    pages = Family("blockfabric_placed_memory_pages", "gauge",
                   "Pages present per NUMA node of the memory bound to the placement's node "
                   "(from /proc/self/numa_maps), per kind of region.",
                   [({"region": m["what"], "node": node}, n)
                    for m in pl["memory"] for node, n in m["pages_by_node"].items()])
    return [info, pages]


def render_metrics(st: dict[str, Any]) -> str:
    """The target's status snapshot (``Target.snapshot``, what ``status`` shows) in the
    Prometheus text format, every name prefixed ``blockfabric_``."""
    up = Family("blockfabric_up", "gauge", "1 while the target serves, 0 while it drains.",
                   [({}, 0 if st["state"] == "draining" else 1)])
    reloads = Family("blockfabric_reloads_total", "counter",
                        "Configuration reloads applied.", [({}, st["reloads"])])
    reload_ok = Family("blockfabric_last_reload_ok", "gauge",
                          "0 when the last reload was rejected.",
                          [({}, 0 if st["last_reload_error"] else 1)])
    auth_failed = Family("blockfabric_auth_failures_total", "counter",
                            "DH-HMAC-CHAP exchanges that failed (a wrong answer, a message "
                            "out of sequence, not finished in time); each ended its queue.",
                            [({}, st.get("auth_failures", 0))])
    hold = Family("blockfabric_buffer_hold_disconnects_total", "counter",
                     "Controllers torn down because a queue held a bounce buffer past "
                     "limits.buffer_hold_timeout.", [({}, st.get("buffer_hold_disconnects", 0))])
    listeners = Family("blockfabric_listener_controllers", "gauge",
                          "Controllers connected through each listener.",
                          [({"listener": x["endpoint"], "provider": x["provider"]},
                            x["controllers"]) for x in st["listeners"]])
    sub_fams, ns_fams, ctrl_fams = (IoFamilies(x) for x in
                                    ("subsystem", "namespace", "controller"))
    conns = Family("blockfabric_subsystem_controllers", "gauge",
                      "Controllers connected to each subsystem.")
    size = Family("blockfabric_namespace_size_bytes", "gauge", "Namespace size.")
    for sub in st["subsystems"]:
        labels = {"subnqn": sub["nqn"]}
        sub_fams.add(labels, sub["io"])
        conns.samples.append((labels, sub["controllers"]))
        for ns in sub["namespaces"]:
            nl = dict(labels, nsid=str(ns["nsid"]))
            ns_fams.add(nl, ns["io"])
            size.samples.append((nl, ns["size"]))
    depth = Family("blockfabric_controller_queue_depth_in_use", "gauge",
                      "Commands the target holds on each queue (AERs included).")
    queues = Family("blockfabric_controller_queues", "gauge", "Connected queues.")
    for c in st["controllers"]:
        labels = {"cntlid": str(c["cntlid"]), "hostnqn": c["hostnqn"], "subnqn": c["subnqn"]}
        if not c["discovery"]:
            ctrl_fams.add(labels, c["io"])
        queues.samples.append((labels, len(c["queues"])))
        for q in c["queues"]:
            depth.samples.append((dict(labels, qid=str(q["qid"])), q["in_use"]))
    group_fams = IoFamilies("poll_group")
    group_queues = Family("blockfabric_poll_group_queues", "gauge",
                          "I/O queues each poll group (reactors) serves.")
    group_cpu = Family("blockfabric_poll_group_cpu_seconds_total", "counter",
                       "CPU time (user + system) of each poll group's process.")
    for g in st.get("groups") or ():
        labels = {"group": str(g["index"])}
        group_fams.add(labels, g["io"])
        group_queues.samples.append((labels, g["queues"]))
        group_cpu.samples.append((labels, g["cpu_s"]))
    extra = [group_queues, group_cpu] + group_fams.families() if st.get("groups") else []
    return render([up, reloads, reload_ok, auth_failed, hold, listeners, conns, size, queues,
                   depth] + placement_families(st.get("placement")) + sub_fams.families()
                  + ns_fams.families() + ctrl_fams.families() + extra)

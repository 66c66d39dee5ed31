"""The control socket: a unix stream socket, one JSON request and one JSON answer per
connection, served from a small thread (``blockfabric-target status`` is its client).

The socket is created mode 0660 inside a directory the daemon owns (/run/blockfabric, made by
systemd's RuntimeDirectory=), so only root and the service's group may ask.  The answer is
computed on the reactor (``Reactor.call_sync``), so it is a consistent picture and nothing on
the I/O path takes a lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from blockfabric.logutil import printable

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024


class ControlError(Exception):
    """The control socket cannot be used (no target there, or a bad answer)."""


class ControlServer:
    """Accept on ``path``; ``handle(request) -> answer`` (both JSON-able mappings)."""

    def __init__(self, path: str, handle: Callable[[dict[str, Any]], Any]) -> None:
        self.path = path
        self.handle = handle
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        self._unlink_stale()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o117)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        self.sock.listen(8)
        self._closing = False
        self.thread = threading.Thread(target=self._serve, name="control", daemon=True)

    def _unlink_stale(self) -> None:
        """Remove a socket left by a target that died; refuse to steal a live one's."""
        if not os.path.exists(self.path):
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
                return
        raise OSError(f"{self.path}: another target is running (its control socket answers)")

    def start(self) -> ControlServer:
        self.thread.start()
        return self

    def _serve(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    self._answer(conn)
                except Exception as exc:  # one bad client must not stop the socket
                    log.warning("control socket: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        try:
            request = json.loads(data or b"{}")
            if not isinstance(request, dict):
                raise ValueError("the request must be a JSON object")
            answer = {"ok": True, "result": self.handle(request)}
        except Exception as exc:
            answer = {"ok": False, "error": str(exc)}
        conn.sendall(json.dumps(answer, default=_jsonable).encode() + b"\n")

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self.thread.is_alive():
            self.thread.join(5)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _jsonable(obj: object) -> object:
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def request(path: str, command: str, timeout: float = 10.0) -> Any:
    """Ask the target at ``path``; raises ControlError when nothing answers there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(json.dumps({"command": command}).encode() + b"\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except FileNotFoundError as exc:
        raise ControlError(f"{path}: no control socket (is blockfabric-target running, "
                           "and is this its control_socket?)") from exc
    except OSError as exc:
        raise ControlError(f"{path}: {exc.strerror or exc}") from exc
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise ControlError(f"{path}: not a JSON answer") from exc
    if not answer.get("ok"):
        raise ControlError(f"{path}: {answer.get('error', 'request failed')}")
    return answer["result"]


# --- for a person at a terminal ---------------------------------------------------------

def _size(n: int) -> str:
    from blockfabric.sizes import format_size
    return format_size(n)


def _io_line(io: dict[str, int]) -> str:
    return (f"reads {io['reads']} ({_size(io['read_bytes'])})  writes {io['writes']} "
            f"({_size(io['written_bytes'])})  errors {io['errors']}  inflight {io['inflight']}")


def placement_lines(pl: dict[str, Any] | None) -> list[str]:
    """Where the reactor runs and where its memory lives (docs/numa.md)."""
    if not pl:
        return []
    r = pl["reactor"]
    nodes = ",".join(map(str, r["nodes"])) or "?"
    memory = (f"memory {pl['memory_policy']} node {pl['node']}" if pl["node"] is not None
              else "memory not placed")
    lines = [f"placement: reactor on CPUs {r['cpus']} (node {nodes}, last ran on CPU "
             f"{r['last_cpu']}), {memory} ({pl['reason']})"]
    for m in pl["memory"]:
        pages = " ".join(f"N{n}={c}" for n, c in m["pages_by_node"].items()) or "none yet"
        lines.append(f"  {m['what']}: {m['regions']} region(s), {_size(m['bytes'])}, "
                     f"policy {m['policy']}, pages {pages}")
    return lines


def format_status(st: dict[str, Any]) -> str:
    """The status answer as text: listeners, subsystems and namespaces, controllers."""
    up = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st["started"]))
    lines = [f"blockfabric-target {st['version']}  pid {st['pid']}  up since {up} "
             f"({st['uptime_s']:.0f} s)  state {st['state']}",
             f"config {st['config']}  reloads {st['reloads']}  discovery genctr {st['genctr']}"
             + (f"  authentication failures {st['auth_failures']}"
                if st.get("auth_failures") else "")
             + (f"  buffer hold disconnects {st['buffer_hold_disconnects']}"
                if st.get("buffer_hold_disconnects") else "")]
    if st.get("last_reload_error"):
        lines.append(f"last reload FAILED: {st['last_reload_error']}")
    gw = st.get("gateway")
    if gw:
        ana_groups = ", ".join(f"{g} {state.replace('_', '-')}"
                               for g, state in gw["groups"].items()) or "none"
        lo, hi = gw["cntlid_range"]
        lines.append(f"gateway {gw['name']} in group {gw['group']}  cntlid {lo}-{hi}  home "
                     f"groups {gw['home_groups'] or 'none'}  ANA groups: {ana_groups}  chgcnt "
                     f"{gw['chgcnt']}  takeovers {gw['takeovers']} releases {gw['releases']}")
    lines.extend(placement_lines(st.get("placement")))
    spin = st.get("spin")
    if spin:
        lines.append(f"reactor spin: {spin['spin_us']:g} us (none above {spin['load_limit']:g} % "
                     f"CPU pressure)  hits {spin['hits']}  misses {spin['misses']}  skipped: "
                     f"depth {spin['skips_depth']}  pressure {spin['skips_pressure']}")
    lines.append("")
    lines.append("listeners:")
    for x in st["listeners"]:
        name = f" ({x['name']})" if x.get("name") else ""
        lines.append(f"  {x['endpoint']}{name}  provider {x['provider']}  "
                     f"controllers {x['controllers']}")
    lines.append("")
    lines.append("subsystems:")
    for s in st["subsystems"]:
        who = "any host" if s["allow_any_host"] else f"{len(s['hosts'])} host(s)"
        lines.append(f"  {s['nqn']}  ({who}, on {', '.join(s['listeners'])})")
        lines.append(f"    {_io_line(s['io'])}")
        for ns in s["namespaces"]:
            ro = " read-only" if ns["read_only"] else ""
            where = f" {ns['path']}" if ns.get("path") else ""
            lines.append(f"    ns {ns['nsid']}: {ns['backend']}{where} {_size(ns['size'])} "
                         f"bs {ns['block_size']}{ro}")
            lines.append(f"      {_io_line(ns['io'])}")
    lines.append("")
    lines.append(f"controllers: {len(st['controllers'])}")
    for c in st["controllers"]:
        queues = " ".join(f"q{q['qid']}:{q['in_use']}/{q['depth']}"
                          + (f"@g{q['group']}" if q.get("group") else "") for q in c["queues"])
        # a host NQN is the peer's: never raw bytes on an operator's terminal
        lines.append(f"  ctrl {c['cntlid']}  {printable(c['hostnqn'])} -> {c['subnqn']}")
        auth = ""
        if c.get("auth_required"):
            done = ",".join(f"q{q}" for q in c["authenticated_queues"]) or "none yet"
            auth = f"  DH-HMAC-CHAP authenticated: {done}"
        same = [q for q in c["queues"] if q.get("same_host")]
        shm = (f"  same host: shared memory, {max(q['shared_regions'] for q in same)} "
               "regions mapped" if same else "")
        lines.append(f"    via {c['listener']} ({c['provider']}) from {c['peer']}  "
                     f"kato {c['kato_ms']} ms  queues {queues}{auth}{shm}")
        lines.append(f"    {_io_line(c['io'])}  admin errors {c['admin_errors']}")
    groups = st.get("groups")
    if groups:
        lines.append("")
        lines.append(f"poll groups: {len(groups)} (reactors)")
        for g in groups:
            state = "" if g.get("alive", True) else "  NOT RUNNING"
            lines.append(f"  group {g['index']} ({g['role']}, pid {g['pid']})  I/O queues "
                         f"{g['queues']}  cpu {g['cpu_s']:.2f} s{state}")
            lines.append(f"    {_io_line(g['io'])}")
    return "\n".join(lines) + "\n"

"""Mount records under /run/blockfabric: what ``blockfabric list`` and ``umount`` read.

A mount process writes one JSON record once its mount is live and removes it on the way
out.  A record whose process is gone, or whose mount point no longer carries a blockfabric
mount, is stale (the process was killed): listing removes it.  Records are replaced
atomically (temp file, fsync, rename, fsync the directory) so a reader never sees half of
one.

Root uses /run/blockfabric; an ordinary user $XDG_RUNTIME_DIR/blockfabric (or
/tmp/blockfabric-UID); $BLOCKFABRIC_RUNTIME_DIR overrides both (tests use it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from blockfabric.fileutil import atomic_write
from blockfabric.initiator.fusefs import SUBTYPE

ROOT_RUNTIME_DIR = "/run/blockfabric"
RECORD_PREFIX = "mount-"


def runtime_dir() -> str:
    override = os.environ.get("BLOCKFABRIC_RUNTIME_DIR")
    if override:
        return override
    if os.geteuid() == 0:
        return ROOT_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "blockfabric") if xdg else f"/tmp/blockfabric-{os.geteuid()}"


@dataclass
class MountRecord:
    """One live mount: who serves it and what it is connected to."""

    mountpoint: str
    pid: int
    subnqn: str
    traddr: str
    trsvcid: int
    provider: str
    cntlid: int
    hostnqn: str
    options: list[str] = field(default_factory=list)
    namespaces: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    #: with --fuse-workers N > 1: each serving process's index, pid, I/O queues and state
    fuse_workers: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MountRecord:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def record_path(mountpoint: str, directory: str | None = None) -> str:
    """Never resolves the path: stat-ing a mount point from inside its own FUSE init (or
    of a hung mount) would block forever."""
    digest = hashlib.sha1(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return os.path.join(directory or runtime_dir(), f"{RECORD_PREFIX}{digest}.json")


def write_record(record: MountRecord, directory: str | None = None) -> str:
    directory = directory or runtime_dir()
    os.makedirs(directory, mode=0o755, exist_ok=True)
    path = record_path(record.mountpoint, directory)
    atomic_write(path, json.dumps(asdict(record), indent=2) + "\n", mode=0o644)
    return path


def remove_record(mountpoint: str, pid: int | None = None, directory: str | None = None) -> None:
    """Remove the record of ``mountpoint`` (only if it is ``pid``'s, when given)."""
    path = record_path(mountpoint, directory)
    if pid is not None:
        rec = _load(path)
        if rec is not None and rec.pid != pid:
            return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _load(path: str) -> MountRecord | None:
    try:
        with open(path, encoding="utf-8") as f:
            return MountRecord.from_dict(json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def blockfabric_mounts() -> set[str]:
    """Mount points that carry a blockfabric FUSE mount now (from /proc/self/mountinfo)."""
    found = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype = right.split(" ", 1)[0]
                if fstype == f"fuse.{SUBTYPE}":
                    found.add(_unescape(left.split(" ")[4]))
    except OSError:
        pass
    return found


def _unescape(text: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 3 < len(text) and text[i + 1:i + 4].isdigit():
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs.  A zombie (exited, not yet reaped by its parent: a
    foreground mount started by a shell or supervisor that waits later) is not alive: its
    mount is gone, and ``umount`` waiting for it would only time out."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def active_records(directory: str | None = None, clean: bool = True) -> list[MountRecord]:
    """Records of live mounts, sorted by mount point; stale ones are removed if ``clean``."""
    directory = directory or runtime_dir()
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.startswith(RECORD_PREFIX) and n.endswith(".json"))
    except FileNotFoundError:
        return []
    mounted = blockfabric_mounts()
    live = []
    for name in names:
        path = os.path.join(directory, name)
        rec = _load(path)
        if rec is not None and pid_alive(rec.pid) and rec.mountpoint in mounted:
            live.append(rec)
        elif clean:
            try:
                os.unlink(path)
            except (FileNotFoundError, PermissionError):
                pass
    return sorted(live, key=lambda r: r.mountpoint)


def find_record(mountpoint: str, directory: str | None = None) -> MountRecord | None:
    """The live record of ``mountpoint``; records hold resolved paths (made before
    mounting), so a path given through a symlink is resolved only when nothing matches."""
    records = active_records(directory)
    for path in (os.path.abspath(mountpoint), os.path.realpath(mountpoint)):
        for rec in records:
            if rec.mountpoint == path:
                return rec
    return None

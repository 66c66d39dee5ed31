"""Atomic file replacement, shared by the target (configs) and the host (mount records)."""

from __future__ import annotations

import os
import tempfile


def atomic_write(path: str | os.PathLike[str], text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves the old or the new file, never a
    torn one: temp file in the same directory (created 0600, then given ``mode``), fsync,
    rename, fsync the directory (as nvmetcli's save_to_file does)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)

"""This host's identity on the fabric: the host NQN and host ID, read from or kept in files."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Callable

log = logging.getLogger(__name__)


HOSTNQN_FILES = ("/etc/nvme/hostnqn", "/etc/blockfabric/hostnqn")
HOSTID_FILES = ("/etc/nvme/hostid", "/etc/blockfabric/hostid")


def default_hostnqn() -> str:
    """``/etc/nvme/hostnqn`` as nvme-cli, else one generated once under /etc/blockfabric."""
    return _stable_id(HOSTNQN_FILES, lambda: f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}")


def default_hostid() -> bytes:
    text = _stable_id(HOSTID_FILES, lambda: str(uuid.uuid4()))
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_OID, text).bytes


def _stable_id(files: tuple[str, ...], make: Callable[[], str]) -> str:
    for path in files:
        try:
            with open(path, encoding="ascii") as f:
                value = f.read().strip()
            if value:
                return value
        except OSError:
            continue
    value = make()
    path = files[-1]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(value + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # read-only /etc: still usable, just not stable across runs
        log.warning("could not keep %s (%s): using %s for this run", path, exc, value)
    return value

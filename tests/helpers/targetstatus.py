"""``blockfabric-target status`` as data, for any suite: one reading, or the first reading
that a check accepts (workers and counters settle a moment after the event a test caused).

Use ``from helpers.targetstatus import settled, status``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable

BIN = pathlib.Path(sys.executable).parent


def status(sock: str | pathlib.Path, timeout: float = 20.0) -> dict[str, Any]:
    """The target's status (``--output-format json``) through its control socket."""
    out = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", str(sock),
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=timeout, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def settled(sock: str | pathlib.Path, check: Callable[[dict[str, Any]], Any],
            timeout: float = 15.0) -> dict[str, Any]:
    """The status once ``check(status)`` holds, or the last one read when ``timeout``
    seconds have passed (the caller's assertion then says what was wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(sock)
        if check(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)

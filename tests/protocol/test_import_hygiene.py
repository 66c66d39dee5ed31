"""Importing the protocol layer loads nothing that does I/O (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
baseline = set(sys.modules)
import blockfabric.protocol
added = sorted(set(sys.modules) - baseline)
print(json.dumps({"added": added}))
"""
FORBIDDEN_EXACT = {"socket", "_socket", "threading", "selectors", "select", "ssl", "asyncio",
                   "subprocess"}
FORBIDDEN_PREFIXES = ("pyverbs", "fuse", "pyfuse3", "blockfabric.rdma", "blockfabric.fabric",
                      "blockfabric.target", "blockfabric.initiator")


def test_import_loads_no_io_modules() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    added = json.loads(out.splitlines()[-1])["added"]
    assert "blockfabric.protocol" in added  # the probe really imported it
    bad = [m for m in added if m in FORBIDDEN_EXACT or m.startswith(FORBIDDEN_PREFIXES)]
    assert bad == []

"""A real target subprocess for the bench tests, and a helper that runs the real CLI."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from e2e.conftest import BIN, HOSTNQN, NQN, TargetProc, free_port, ram_config  # noqa: F401
from e2e.conftest import module_ram_target, start_target  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def target(module_ram_target):
    """One ramdisk target for a test module (each test uses its own part of the disk)."""
    return module_ram_target


def bench_cmd(port: int, *flags: str) -> list[str]:
    return [str(BIN / "blockfabric"), "bench", "-a", "127.0.0.1", "-s", str(port), "-n", NQN,
            "-q", HOSTNQN, "--provider", "soft", *flags]


def bench(target: TargetProc, *flags: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``blockfabric bench`` against ``target``, as a user would run it."""
    return subprocess.run(bench_cmd(target.port, *flags), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def bench_json(target: TargetProc, *flags: str) -> dict[str, Any]:
    done = bench(target, "-o", "json", *flags)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)

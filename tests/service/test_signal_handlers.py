"""The target's signal handlers only queue work for the reactor.

A handler runs in the main thread between two bytecodes, or while a system call there
returns EINTR: with stderr a pipe the reader is slow to empty, that is in the middle of a log
line's write.  A handler that logged itself then wrote to stderr inside that write
(``RuntimeError: reentrant call inside <_io.BufferedWriter name='<stderr>'>``, printed by
logging as "--- Logging error ---" with a traceback, and the line lost)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import yaml

from e2e.conftest import BIN, free_port

from .conftest import base_config


def test_signals_while_stderr_is_full_are_handled_without_a_reentrant_write(tmp_path):
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path, free_port())))
    proc = subprocess.Popen([str(BIN / "blockfabric-target"), "run", "-C", str(path), "-vv"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    lines: list[bytes] = []
    ready, reading = threading.Event(), threading.Event()
    reading.set()

    def read() -> None:
        for line in proc.stderr:                # type: ignore[union-attr]
            lines.append(line)
            if b"ready:" in line:
                ready.set()
            reading.wait()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(20), b"".join(lines).decode(errors="replace")
        reading.clear()                         # stop emptying the pipe: its 64 KiB fill
        for _ in range(600):                    # with the reloads' lines, and the main
            os.kill(proc.pid, signal.SIGHUP)    # thread blocks in a write, where the
            time.sleep(0.002)                   # next SIGHUP lands
        reading.set()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        reader.join(10)
        assert rc == 0, b"".join(lines)[-6000:].decode(errors="replace")
    finally:
        reading.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    log = b"".join(lines).decode(errors="replace")
    assert "SIGHUP: reloading" in log and "draining and stopping" in log, log[-3000:]
    for bad in ("reentrant", "Logging error", "Traceback"):
        assert bad not in log, log[-6000:]

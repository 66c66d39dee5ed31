"""sd_notify with a NOTIFY_SOCKET the test owns: READY=1 only once every listener accepts,
WATCHDOG=1 from the reactor, STOPPING=1 at SIGTERM, in that order, and exit 0."""

from __future__ import annotations

import signal
import socket

from .conftest import base_config, free_port


def test_ready_after_every_listener_then_stopping(tmp_path, notify_socket, start_service):
    ports = [free_port() for _ in range(3)]
    config = base_config(tmp_path, ports[0])
    config["listeners"] = [{"provider": "soft", "address": "127.0.0.1", "port": p}
                           for p in ports]
    svc = start_service(config, env={"NOTIFY_SOCKET": notify_socket.path,
                                     "WATCHDOG_USEC": "200000"})
    notify_socket.wait_for("READY=1", 10)
    # READY=1 has arrived: every listener must accept right now, with no retry.
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    ready_line = next(i for i, line in enumerate(svc.proc.lines) if "ready:" in line)
    listening = [i for i, line in enumerate(svc.proc.lines) if "listening on" in line]
    assert len(listening) == 3 and max(listening) < ready_line
    notify_socket.wait_for("WATCHDOG=1", 2)
    svc.proc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.proc.wait(15) == 0
    messages = notify_socket.wait_for("STOPPING=1", 1)
    kinds = [m.split("\n")[0].split("=")[0] for m in messages if "WATCHDOG" not in m]
    assert kinds == ["READY", "STOPPING"], messages
    assert "MAINPID=" in messages[0]


def test_no_notify_socket_no_messages_and_clean_exit(tmp_path, start_service):
    svc = start_service(base_config(tmp_path, free_port()))
    assert svc.proc.stop() == 0
    assert "drained" in svc.proc.log

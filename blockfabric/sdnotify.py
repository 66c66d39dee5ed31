"""The systemd notify protocol, written out: one datagram to $NOTIFY_SOCKET.

It is a few lines over a unix datagram socket (sd_notify(3)), so no library is needed; an
abstract socket name starts with '@'.  Without NOTIFY_SOCKET this does nothing.
"""

from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1"); True when it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True

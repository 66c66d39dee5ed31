"""blockfabric.net: namespaces, veth and addresses are made and always torn down."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockfabric.net import destroy_netns_pair
from helpers.netns import netns_pair  # noqa: F401  (fixture)

pytestmark = pytest.mark.netns

PROBE = """
import socket, sys
from blockfabric.net import enter_netns
enter_netns(sys.argv[1])
family = socket.AF_INET6 if ':' in sys.argv[2] else socket.AF_INET
if sys.argv[3] == 'listen':
    s = socket.socket(family); s.bind((sys.argv[2], 0)); s.listen()
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept(); c.sendall(c.recv(16).upper())
else:
    c = socket.create_connection((sys.argv[2], int(sys.argv[4])), timeout=5)
    c.sendall(b'ping'); print(c.recv(16).decode())
"""


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize("family", [4, 6])
def test_pair_connects_across_veth_and_is_removed(netns_pair, family):
    pair = netns_pair
    assert set(pair.names) <= set(_namespaces())
    addrs = pair.ipv4 if family == 4 else pair.ipv6
    server = subprocess.Popen([sys.executable, "-c", PROBE, pair.names[1], addrs[1], "listen"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        client = subprocess.run([sys.executable, "-c", PROBE, pair.names[0], addrs[1], "connect",
                                 port], capture_output=True, text=True, timeout=10)
        assert client.stdout.strip() == "PING", client.stderr
    finally:
        server.kill()
        server.wait()
    destroy_netns_pair(pair)
    assert not set(pair.names) & set(_namespaces())


def test_namespaces_are_isolated(netns_pair):
    """Side A cannot bind B's address: they really are two hosts."""
    code = ("import socket,sys\nfrom blockfabric.net import enter_netns\n"
            "enter_netns(sys.argv[1])\ns=socket.socket()\n"
            "try:\n s.bind((sys.argv[2],0)); print('bound')\nexcept OSError: print('refused')")
    out = subprocess.run([sys.executable, "-c", code, netns_pair.names[0], netns_pair.ipv4[1]],
                         capture_output=True, text=True, timeout=10).stdout.strip()
    assert out == "refused"

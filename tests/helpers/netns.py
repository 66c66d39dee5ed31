"""Network-namespace fixtures for any suite: two namespaces joined by veth, always removed.

Use ``from helpers.netns import netns_pair`` in a conftest; tests that take it should carry
the ``netns`` marker.  Without root the fixture skips, saying why.
"""

from __future__ import annotations

import pytest

from blockfabric.net import NetnsPair, can_create_netns, netns_pair as _netns_pair


def require_netns() -> None:
    """Skip the calling test unless namespaces can be made here."""
    ok, reason = can_create_netns()
    if not ok:
        pytest.skip(reason)


@pytest.fixture
def netns_pair() -> NetnsPair:
    """A fresh :class:`NetnsPair` (names with a random suffix), torn down after the test."""
    require_netns()
    with _netns_pair("bft") as pair:
        yield pair

"""The ``gateway`` section (a member of a gateway group) and ``ana_group``: what the schema
refuses and derives."""

from __future__ import annotations

import pytest

from blockfabric.errors import ConfigError
from blockfabric.target.config import TargetConfig

NQN = "nqn.2026-12.io.example:vol"


def conf(gateway: dict, namespaces: list | None = None) -> dict:
    rbd = {"pool": "rbd", "image": "vol0", "ceph_conf": "/etc/ceph/ceph.conf"}
    return {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420}],
            "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": namespaces or [
                {"nsid": 1, "backend": "rbd", "rbd": rbd},
                {"nsid": 130, "backend": "rbd", "ana_group": 7,
                 "rbd": dict(rbd, image="vol1")}]}],
            "gateway": {"name": "gw-a", "group": "rack1", "cntlid_min": 1,
                        "cntlid_max": 99, **gateway}}


def test_defaults_and_derived_values() -> None:
    cfg = TargetConfig.from_dict(conf({"ana_groups": [1]}))
    gw = cfg.gateway
    assert (gw.others, gw.lease, gw.renew_interval) == ("non-optimized", 6, 2)
    assert (gw.ceph.pool, gw.ceph.ceph_conf, gw.ceph.client) == (
        "rbd", "/etc/ceph/ceph.conf", "client.admin")        # from the first rbd namespace
    assert gw.anatt == 6 + 2 * 2 + 2
    a, b = cfg.subsystems[0].namespaces
    assert (a.ana_group_id, b.ana_group_id) == (1, 7)       # derived from the nsid / given
    again = TargetConfig.from_dict(cfg.to_dict())
    assert again.gateway == gw and again.subsystems == cfg.subsystems


@pytest.mark.parametrize("gateway, where, what", [
    ({"cntlid_max": 0}, "gateway.cntlid_max", "an integer from 1"),
    ({"cntlid_min": 50, "cntlid_max": 10}, "gateway.cntlid_max", "at least cntlid_min"),
    ({"lease": 4, "renew_interval": 2}, "gateway.renew_interval", "less than half the lease"),
    ({"ana_groups": [1, 1]}, "gateway.ana_groups[1]", "an ANA group not already used"),
    ({"ana_groups": [129]}, "gateway.ana_groups[0]", "to 128"),
    ({"others": "optimized"}, "gateway.others", "non-optimized"),
    ({"name": "a b"}, "gateway.name", "a gateway name"),
])
def test_refused(gateway: dict, where: str, what: str) -> None:
    with pytest.raises(ConfigError) as info:
        TargetConfig.from_dict(conf(gateway))
    assert where in str(info.value) and what in str(info.value), str(info.value)


def test_a_gateway_without_rbd_needs_a_ceph_section() -> None:
    ram = [{"nsid": 1, "backend": "ramdisk", "size": "1MiB"}]
    with pytest.raises(ConfigError, match="gateway.ceph"):
        TargetConfig.from_dict(conf({}, ram))
    cfg = TargetConfig.from_dict(conf({"ceph": {"pool": "gw"}}, ram))
    assert cfg.gateway.ceph.pool == "gw"

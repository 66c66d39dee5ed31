"""Host allow-list entries with DH-HMAC-CHAP secrets: loading, errors that name the file and
key without echoing the secret, and dumping back."""

from __future__ import annotations

import pytest

from blockfabric.errors import ConfigError
from blockfabric.protocol.auth import DhGroup, HashId, generate_secret
from blockfabric.target.config import TargetConfig, loads

HOST = "nqn.2014-08.org.nvmexpress:uuid:3f1a2b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b"
SECRET = generate_secret(32, 1)


def _config(*hosts: object) -> dict:
    return {"listeners": [{"address": "127.0.0.1"}],
            "subsystems": [{"nqn": "nqn.2026-12.io.blockfabric:s", "hosts": list(hosts)}]}


def test_entries_are_nqns_or_mappings_and_dump_back_the_same_way() -> None:
    cfg = TargetConfig.from_dict(_config(
        "nqn.2014-08.org.h:plain",
        {"nqn": HOST, "dhchap_secret": str(SECRET), "dhchap_hash": "hmac(sha512)",
         "dhchap_dhgroup": "ffdhe2048"}), "t.yaml")
    (sub,) = cfg.subsystems
    assert sub.host_nqns == ("nqn.2014-08.org.h:plain", HOST)
    assert sub.allows(HOST) and not sub.allows("nqn.2014-08.org.h:other")
    entry = sub.host(HOST)
    assert entry.dhchap_secret == SECRET and entry.dhchap_ctrl_secret is None
    assert (entry.hash_id, entry.dhgroup_id) == (HashId.SHA512, DhGroup.FFDHE2048)
    assert sub.host("nqn.2014-08.org.h:plain").dhchap_secret is None
    dumped = cfg.to_dict()["subsystems"][0]["hosts"]
    assert dumped[0] == "nqn.2014-08.org.h:plain"
    assert dumped[1]["dhchap_secret"] == str(SECRET)
    assert loads(cfg.to_yaml()) == cfg


@pytest.mark.parametrize("entry,key,expected", [
    ({"nqn": HOST, "dhchap_secret": "DHHC-1:01:c2VjcmV0:"}, "dhchap_secret", "32, 48 or 64"),
    ({"nqn": HOST, "dhchap_secret": str(SECRET)[:-6] + "AAAA=:"}, "dhchap_secret", None),
    ({"nqn": HOST, "dhchap_secret": 12}, "dhchap_secret", "quote it"),
    ({"nqn": HOST, "dhchap_ctrl_secret": str(SECRET)}, "dhchap_secret", "host secret too"),
    ({"nqn": HOST, "dhchap_secret": str(SECRET), "dhchap_ctrl_secret": str(SECRET)},
     "dhchap_ctrl_secret", "other than dhchap_secret"),
    ({"nqn": HOST, "dhchap_secret": str(SECRET), "dhchap_dhgroup": "ffdhe4096"},
     "dhchap_dhgroup", "null, ffdhe2048"),
    ({"nqn": HOST, "dhchap_secret": str(SECRET), "dhchap_hash": "sha256"},
     "dhchap_hash", "hmac(sha256)"),
    ({"nqn": HOST, "dhchap_secrte": str(SECRET)}, "dhchap_secrte", "did you mean"),
    ({"dhchap_secret": str(SECRET)}, "nqn", "an NQN"),
])
def test_bad_entries_name_file_key_and_expectation(entry, key, expected) -> None:
    with pytest.raises(ConfigError) as info:
        TargetConfig.from_dict(_config(entry), "/etc/blockfabric/target.yaml")
    err = info.value
    assert err.path == "/etc/blockfabric/target.yaml"
    assert err.key == f"subsystems[0].hosts[0].{key}"
    if expected:
        assert expected in err.expected
    body = str(SECRET).split(":")[2]
    assert body[:20] not in str(err)                 # the secret is never echoed


def test_same_host_twice_is_refused_even_as_string_and_mapping() -> None:
    with pytest.raises(ConfigError, match="host NQN not already used"):
        TargetConfig.from_dict(_config(HOST, {"nqn": HOST, "dhchap_secret": str(SECRET)}))

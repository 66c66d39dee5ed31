"""docs/operations.md lists every configuration key (its reference table is generated from
the config model and must match it), and `check --explain` says why a host can or cannot
connect."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import yaml

from blockfabric.target import config as cfg
from blockfabric.target.configref import BEGIN, END, markdown, rows

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"
TARGET = [sys.executable, "-m", "blockfabric.target.cli"]


def _all_keys(model=cfg.TargetConfig, prefix=""):
    """Every key path, walked independently of configref (so a bug there shows)."""
    for f in dataclasses.fields(model):
        if "kind" not in f.metadata:
            continue
        path = prefix + f.name
        yield path
        kind = f.metadata["kind"]
        if isinstance(kind, cfg.Nested):
            yield from _all_keys(kind.model, path + ".")
        elif isinstance(kind, cfg.ListOf) and isinstance(kind.item, cfg.Nested):
            yield from _all_keys(kind.item.model, path + "[].")


def test_operations_doc_has_the_current_generated_reference():
    text = DOC.read_text()
    block = text[text.index(BEGIN):text.index(END) + len(END)]
    assert block == markdown(), ("docs/operations.md is stale: regenerate with "
                                 "python -m blockfabric.target.configref")


def test_reference_lists_every_key_with_type_and_default():
    documented = {r[0]: r for r in rows()}
    keys = list(_all_keys())
    assert len(keys) > 30
    for key in keys:
        assert key in documented, key
        _, expected, default = documented[key]
        assert expected and default, key
        assert f"| `{key}` |" in DOC.read_text()
    assert documented["limits.queue_size"][2] == "`128`"
    assert documented["control_socket"][2] == f"`{cfg.DEFAULT_CONTROL_SOCKET}`"
    assert documented["metrics"][2] == "unset"


def test_doc_covers_the_operators_topics():
    text = DOC.read_text()
    for heading in ("## Install", "## Configuration reference", "## Reload", "## Stop",
                    "## Status and metrics", "## Logs", "## Upgrade", "## Troubleshooting"):
        assert heading in text
    assert "check --config /etc/blockfabric/target.yaml \\\n    --explain" in text


def _explain(tmp_path, *args):
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420,
                             "name": "a"},
                            {"provider": "soft", "address": "127.0.0.1", "port": 4421}],
              "subsystems": [{"nqn": NQN, "hosts": [HOSTNQN], "listeners": ["a"],
                              "namespaces": [{"nsid": 1, "backend": "null", "size": "1GiB"}]},
                             {"nqn": NQN + "x", "allow_any_host": True}]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(TARGET + ["check", "-C", str(path), "--explain", *args],
                          capture_output=True, text=True, timeout=30)


def test_explain_allowed_host(tmp_path):
    out = _explain(tmp_path, HOSTNQN, "--nqn", NQN)
    assert out.returncode == 0, out.stderr
    assert f"subsystem {NQN}: ALLOWED (listed in subsystems[0].hosts)" in out.stdout
    assert "exposed on 127.0.0.1:4420 provider soft" in out.stdout
    assert "4421" not in out.stdout                 # not on the unnamed listener


def test_explain_denied_host(tmp_path):
    out = _explain(tmp_path, OTHER_HOSTNQN, "--nqn", NQN)
    assert out.returncode == 1
    assert "DENIED (not in subsystems[0].hosts" in out.stdout
    assert "0x184" in out.stdout


def test_explain_unknown_subsystem_and_any_host(tmp_path):
    out = _explain(tmp_path, OTHER_HOSTNQN, "--nqn", "nqn.2026-12.io.example:nope")
    assert out.returncode == 1 and "NOT CONFIGURED" in out.stdout
    out = _explain(tmp_path, OTHER_HOSTNQN)          # any subsystem: the open one admits it
    assert out.returncode == 0 and "allow_any_host is true" in out.stdout

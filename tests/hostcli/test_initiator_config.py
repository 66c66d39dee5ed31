"""The initiator YAML on the shared schema engine (blockfabric.schema): its connection
defaults are ConnectOptions' (and so the CLI flags'), and it refuses what the target's
config refuses (a misspelt key with a did-you-mean, a key given twice, a bad NQN)."""

from __future__ import annotations

import dataclasses

import pytest

from blockfabric.errors import ConfigError
from blockfabric.initiator.cli import build_parser
from blockfabric.initiator.commands import options
from blockfabric.initiator.host import ConnectOptions
from blockfabric.initiator.initiator_config import loads

ENTRY = "{traddr: 10.0.0.1, nqn: 'nqn.2026-12.io.blockfabric:ram0', mountpoint: /m%s}"
COMPARED = ("trsvcid", "provider", "transport", "hdr_digest", "data_digest", "hostnqn",
            "nr_io_queues", "queue_size", "keep_alive_tmo", "reconnect_delay", "ctrl_loss_tmo",
            "dhchap_secret", "dhchap_ctrl_secret", "paths")


def _picked(opts: ConnectOptions) -> dict:
    return {name: getattr(opts, name) for name in COMPARED}


def test_yaml_and_flag_defaults_are_connect_options_defaults() -> None:
    base = ConnectOptions(traddr="10.0.0.1", subnqn="nqn.2026-12.io.blockfabric:ram0")
    from_yaml = loads("mounts: [%s]" % (ENTRY % "")).mounts[0].connect_options()
    args = build_parser().parse_args(["connect", "-a", "10.0.0.1", "-n", base.subnqn])
    from_flags = options(args, args.nqn)
    assert _picked(from_yaml) == _picked(base) == _picked(from_flags)


def test_yaml_values_reach_the_connect_options() -> None:
    spec = loads("mounts: [%s]" % (ENTRY % ", trsvcid: '4421', queue_size: 64, "
                                   "keep_alive_tmo: 0, ctrl_loss_tmo: -1, transport: tcp, "
                                   "hdr_digest: true, options: 'ro,threads=2'")).mounts[0]
    opts = spec.connect_options()
    assert (opts.trsvcid, opts.queue_size, opts.keep_alive_tmo, opts.ctrl_loss_tmo,
            opts.transport, opts.hdr_digest) == (4421, 64, 0, -1, "tcp", True)
    assert spec.name == "m" and spec.mount_options() is not None
    assert {f.name for f in dataclasses.fields(spec)} >= set(COMPARED)


@pytest.mark.parametrize("text,key,expected", [
    ("mounts: [%s]" % (ENTRY % ", queue_sise: 64"), "mounts[0].queue_sise",
     "did you mean 'queue_size'"),
    ("mounts: [%s]" % (ENTRY % ", hostnqn: myhost"), "mounts[0].hostnqn", "an NQN"),
    ("mounts:\n  - traddr: a\n    traddr: b\n", "line 3, column 5", "given twice"),
    ("mounts: [%s]" % (ENTRY % ", nr_io_queues: 0"), "mounts[0].nr_io_queues",
     "an integer from 1 to 1024"),
    ("- a\n", "(top level)", "a mapping (the initiator configuration)"),
])
def test_refused_like_the_target_config(text: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        loads(text, "/etc/i.yaml")
    assert (exc.value.path, exc.value.key) == ("/etc/i.yaml", key)
    assert expected in str(exc.value), exc.value


def test_empty_file_and_commented_out_mounts_are_no_mounts() -> None:
    assert loads("").mounts == ()
    assert loads("mounts:\n#  - traddr: 10.0.0.1\n").mounts == ()

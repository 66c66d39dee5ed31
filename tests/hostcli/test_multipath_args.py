"""Further paths (multipath failover) as users give them: ``--path`` on the command line and
``paths:`` in the initiator YAML.  Both go through one parser; bad values are usage errors
(exit 2, one line naming the value and what was expected) or a ConfigError naming the file,
the key and what was expected."""

from __future__ import annotations

import pytest

from blockfabric.errors import ConfigError
from blockfabric.initiator.cli import build_parser, main, resolve_path_args
from blockfabric.initiator.commands import options
from blockfabric.initiator.initiator_config import loads
from blockfabric.initiator.multipath import format_path, parse_path, parse_path_spec

COMMON = ["-a", "10.0.0.1", "-s", "4420", "-n", "nqn.2026-12.io.blockfabric:ram0"]


@pytest.mark.parametrize("text,want", [
    ("10.0.0.2", ("10.0.0.2", None)),
    ("10.0.0.2:4421", ("10.0.0.2", 4421)),
    (" 10.0.0.2:4421 ", ("10.0.0.2", 4421)),
    ("[fd00::2]", ("fd00::2", None)),
    ("[FD00:0::2]:4421", ("fd00::2", 4421)),
])
def test_parse_path_accepts(text, want):
    assert parse_path(text) == want


@pytest.mark.parametrize("text,expected", [
    ("", "ADDR, ADDR:PORT"),
    ("fd00::2:4420", "IPv6 address in brackets"),
    ("[fd00::2", "a ']'"),
    ("[fd00::2]4420", "':PORT' or nothing"),
    ("[10.0.0.2]:1", "brackets only around an IPv6"),
    ("target.example:4420", "an IPv4 or IPv6 address"),
    ("10.0.0.2:", "a port"),
    ("10.0.0.2:0", "a port"),
    ("10.0.0.2:65536", "a port"),
    ("10.0.0.2:44x", "a port"),
])
def test_parse_path_refuses(text, expected):
    with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        parse_path(text)


def test_format_path_brackets_ipv6_only():
    assert format_path("fd00::2", 4420) == "[fd00::2]:4420"
    assert format_path("10.0.0.2", 4420) == "10.0.0.2:4420"
    assert parse_path(format_path("fd00::2", 4420)) == ("fd00::2", 4420)


@pytest.mark.parametrize("command", ["connect", "mount", "bench"])
def test_path_flags_reach_the_connect_options(command):
    parser = build_parser()
    args = parser.parse_args([command, "--path", "10.0.0.2", *COMMON[:2], "-s", "4430",
                              *COMMON[4:], "--path", "[fd00::3]:4431"])
    resolve_path_args(parser, args)
    opts = options(args, args.nqn)
    assert opts.paths == [("10.0.0.2", 4430), ("fd00::3", 4431)]   # PORT defaults to -s
    assert options(build_parser().parse_args([command, *COMMON]), "x").paths == []


def test_help_documents_path():
    for command in ("connect", "mount", "bench"):
        text = build_parser().commands[command].format_help()
        assert "--path ADDR[:PORT]" in text and "multipath failover" in text
        assert "PORT defaults to -s" in text and "repeatable" in text


@pytest.mark.parametrize("argv,message", [
    (["connect", *COMMON, "--path", "fd00::2"], "argument --path: 'fd00::2': expected an "
                                                "IPv6 address in brackets"),
    (["connect", *COMMON, "--path", "10.0.0.2:0"], "'10.0.0.2:0': expected a port"),
    (["connect", *COMMON, "--path", "10.0.0.1"], "path 10.0.0.1:4420 is the same as the "
                                                 "primary path"),
    (["connect", *COMMON, "--path", "10.0.0.2", "--path", "10.0.0.2:4420"],
     "path 10.0.0.2:4420 is the same as path 10.0.0.2:4420 given before"),
    (["mount", "--path", "10.0.0.2", "/mnt"], "--path goes with -a/-n"),
    (["connect", "-a", "10.0.0.1", "-s", "http", "-n", "x"], "argument -s/--trsvcid: 'http'"),
])
def test_bad_path_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"blockfabric {argv[0]}: error: " in err and message in err, err
    assert err.startswith(f"usage: blockfabric {argv[0]} "), err


YAML = ("mounts: [{traddr: 10.0.0.1, trsvcid: 4420, nqn: n, mountpoint: /m, "
        "paths: %s}]")


def test_yaml_paths_as_strings_and_maps():
    spec = loads(YAML % "['10.0.0.2:4421', '10.0.0.3', '[fd00::2]:4422', "
                        "{traddr: 'fd00::3'}, {traddr: 10.0.0.4, trsvcid: '4423'}]").mounts[0]
    want = [("10.0.0.2", 4421), ("10.0.0.3", 4420), ("fd00::2", 4422), ("fd00::3", 4420),
            ("10.0.0.4", 4423)]
    assert spec.paths == want
    assert spec.connect_options().paths == want
    assert loads(YAML % "[]").mounts[0].connect_options().paths == []


@pytest.mark.parametrize("value,key,expected", [
    ("'10.0.0.2:4421'", "mounts[0].paths", "a list of further paths"),
    ("[4421]", "mounts[0].paths[0]", "ADDR, ADDR:PORT"),
    ("['fd00::2']", "mounts[0].paths[0]", "IPv6 address in brackets"),
    ("['host.example:4420']", "mounts[0].paths[0]", "an IPv4 or IPv6 address"),
    ("['10.0.0.2:0']", "mounts[0].paths[0]", "a port"),
    ("[{traddr: 10.0.0.2, port: 4421}]", "mounts[0].paths[0].port",
     "traddr, trsvcid, transport"),
    ("[{trsvcid: 4421}]", "mounts[0].paths[0].traddr", "an IPv4 or IPv6 address"),
    ("[{traddr: '10.0.0.2:4421'}]", "mounts[0].paths[0].traddr", "the port goes in trsvcid"),
    ("[{traddr: 10.0.0.2, trsvcid: 70000}]", "mounts[0].paths[0].trsvcid", "1 to 65535"),
    ("[{traddr: 10.0.0.2, trsvcid: true}]", "mounts[0].paths[0].trsvcid", "1 to 65535"),
    ("['10.0.0.1']", "mounts[0].paths", "differ from each other and from traddr/trsvcid"),
    ("['10.0.0.2', {traddr: 10.0.0.2}]", "mounts[0].paths", "given before"),
])
def test_bad_yaml_paths_name_file_key_and_expectation(value, key, expected):
    with pytest.raises(ConfigError) as exc:
        loads(YAML % value, "/etc/blockfabric/initiator.yaml")
    assert (exc.value.path, exc.value.key) == ("/etc/blockfabric/initiator.yaml", key)
    assert expected in exc.value.expected, exc.value
    assert str(exc.value).startswith(f"/etc/blockfabric/initiator.yaml: {key}: expected ")


# -- paths over their own transport (tcp://, rdma://; transport: in the YAML) -------------

@pytest.mark.parametrize("text,want", [
    ("tcp://10.0.0.2:4421", ("10.0.0.2", 4421, "tcp")),
    ("RDMA://10.0.0.2", ("10.0.0.2", None, "rdma")),
    ("tcp://[fd00::2]:4421", ("fd00::2", 4421, "tcp")),
    ("[fd00::2]:4421", ("fd00::2", 4421)),
])
def test_parse_path_spec_reads_the_transport(text, want):
    assert parse_path_spec(text) == want


@pytest.mark.parametrize("text,expected", [
    ("udp://10.0.0.2", "tcp:// or rdma:// before the address"),
    ("tcp://", "ADDR, ADDR:PORT"),
    ("tcp://fd00::2:4420", "IPv6 address in brackets"),
])
def test_parse_path_spec_refuses(text, expected):
    with pytest.raises(ValueError, match=expected.replace("[", r"\[")):
        parse_path_spec(text)


def test_path_transport_reaches_the_connect_options_and_formats_back():
    parser = build_parser()
    args = parser.parse_args(["mount", *COMMON, "--path", "tcp://10.0.0.1",
                              "--path", "[fd00::3]:4431", "/mnt"])
    resolve_path_args(parser, args)
    # the same address and port over TCP is another path than the primary RDMA one
    assert options(args, args.nqn).paths == [("10.0.0.1", 4420, "tcp"), ("fd00::3", 4431)]
    assert format_path("fd00::3", 4431, "rdma") == "rdma://[fd00::3]:4431"
    assert parse_path_spec(format_path("fd00::3", 4431, "rdma")) == ("fd00::3", 4431, "rdma")


@pytest.mark.parametrize("argv,message", [
    (["connect", *COMMON, "--path", "rdma://10.0.0.1"], "path rdma://10.0.0.1:4420 is the "
                                                        "same as the primary path"),
    (["connect", *COMMON, "-t", "tcp", "--path", "tcp://10.0.0.1:4420"],
     "is the same as the primary path"),
    (["connect", *COMMON, "--path", "nvme://10.0.0.2"], "expected tcp:// or rdma://"),
])
def test_bad_path_transport_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_yaml_paths_name_their_transport():
    spec = loads("mounts: [{traddr: 10.0.0.1, nqn: n, mountpoint: /m, transport: tcp, "
                 "paths: ['rdma://10.0.0.1', {traddr: 10.0.0.2, transport: RDMA}, "
                 "{traddr: 10.0.0.3, transport: tcp}, 10.0.0.4]}]").mounts[0]
    assert spec.connect_options().paths == [("10.0.0.1", 4420, "rdma"),
                                            ("10.0.0.2", 4420, "rdma"),
                                            ("10.0.0.3", 4420, "tcp"), ("10.0.0.4", 4420)]
    for value, key, expected in (
            ("[{traddr: 10.0.0.2, transport: fc}]", "mounts[0].paths[0].transport",
             "rdma or tcp"),
            ("['tcp://10.0.0.2', {traddr: 10.0.0.2, transport: tcp}]", "mounts[0].paths",
             "given before")):
        with pytest.raises(ConfigError) as exc:
            loads(YAML % value, "/etc/i.yaml")
        assert exc.value.key == key and expected in exc.value.expected, exc.value

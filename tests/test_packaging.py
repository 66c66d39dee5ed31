"""The distribution and the two console scripts, as a user installs and runs them."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent

TARGET_COMMANDS = ["run", "check", "status"]
HOST_COMMANDS = ["discover", "connect", "identify", "mount", "umount", "list", "disconnect",
                 "bench", "gen-dhchap-key"]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("prog,commands", [("blockfabric-target", TARGET_COMMANDS),
                                           ("blockfabric", HOST_COMMANDS)])
def test_help_lists_every_command(prog, commands):
    res = run(str(BIN / prog), "--help")
    assert res.returncode == 0, res.stderr
    for command in commands:
        assert command in res.stdout
    assert "exit status" in res.stdout


@pytest.mark.parametrize("prog,command", [("blockfabric-target", c) for c in TARGET_COMMANDS]
                         + [("blockfabric", c) for c in HOST_COMMANDS])
def test_every_subcommand_has_help(prog, command):
    res = run(str(BIN / prog), command, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: {prog} {command}")


@pytest.mark.parametrize("prog", ["blockfabric-target", "blockfabric"])
def test_no_command_is_a_usage_error(prog):
    res = run(str(BIN / prog))
    assert res.returncode == 2
    assert "usage:" in res.stderr


def test_connection_flags_follow_nvme_cli():
    res = run(str(BIN / "blockfabric"), "connect", "--help")
    pairs = [("-a", "--traddr"), ("-s", "--trsvcid"), ("-n", "--nqn"), ("-q", "--hostnqn"),
             ("-i", "--nr-io-queues"), ("-Q", "--queue-size"), ("-k", "--keep-alive-tmo"),
             ("-c", "--reconnect-delay"), ("-l", "--ctrl-loss-tmo")]
    for short, long in pairs:
        assert re.search(rf"^  {short} \S+, {long} \S+", res.stdout, re.M), (short, long)
    assert "--provider {auto,soft,verbs}" in res.stdout
    for flag in ("--dhchap-secret", "--dhchap-ctrl-secret"):
        assert re.search(rf"^  -\S \S+, {flag} \S+", res.stdout, re.M), flag


@pytest.mark.parametrize("argv,message", [
    (["--dhchap-secret", "DHHC-1:01:Zm9v:"], "--dhchap-secret: the key is 0 bytes"),
    (["--dhchap-secret", "secret"], "--dhchap-secret: a secret starts with 'DHHC-1:'"),
    (["--dhchap-ctrl-secret", "DHHC-1:00:" + "A" * 48 + ":"], "--dhchap-ctrl-secret: the CRC"),
    (["--dhchap-ctrl-secret", "DHHC-1:00:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACtVQoZ:"],
     "needs --dhchap-secret"),
])
def test_bad_secrets_are_usage_errors(argv, message):
    res = run(str(BIN / "blockfabric"), "connect", "-a", "127.0.0.1", "-n", "nqn.x", *argv)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_gen_dhchap_key_prints_secrets_that_parse():
    from blockfabric.protocol.auth import Secret
    keys = set()
    for hmac_id, length in ((0, 32), (1, 32), (2, 48), (3, 64)):
        res = run(str(BIN / "blockfabric"), "gen-dhchap-key", "--hmac", str(hmac_id))
        assert res.returncode == 0, res.stderr
        secret = Secret.parse(res.stdout.strip())
        assert (secret.transform, len(secret.key)) == (hmac_id, length)
        keys.add(secret.key)
    assert len(keys) == 4
    res = run(str(BIN / "blockfabric"), "gen-dhchap-key", "-l", "64")
    assert len(Secret.parse(res.stdout.strip()).key) == 64


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-w", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (path,) = out.glob("blockfabric-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_one_top_level_name(wheel):
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    tops = {t for t in tops if not t.endswith(".dist-info")}
    assert tops == {"blockfabric"}


def test_wheel_maps_target_and_initiator(wheel):
    names = set(wheel.namelist())
    for folder, package in (("target", "blockfabric/target"),
                            ("initiator", "blockfabric/initiator")):
        for source in (ROOT / folder).rglob("*.py"):
            rel = source.relative_to(ROOT / folder).as_posix()
            assert f"{package}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    for source in (ROOT / "blockfabric").rglob("*.py"):
        rel = source.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} is missing from the wheel (add its package to pyproject)"

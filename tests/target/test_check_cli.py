"""`blockfabric-target check` run as a real subprocess over a table of broken configs: each must
exit 2 with ONE stderr line naming the file and the key path, and print nothing on stdout."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

CLI = str(Path(sys.executable).with_name("blockfabric-target"))
HOST = "nqn.2014-08.org.nvmexpress:uuid:3f1a2b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b"

BASE: dict[str, Any] = {
    "listeners": [{"name": "lo", "provider": "soft", "address": "127.0.0.1", "port": 4420}],
    "subsystems": [{
        "nqn": "nqn.2026-12.io.blockfabric:ram0",
        "hosts": [HOST],
        "namespaces": [
            {"nsid": 1, "backend": "ramdisk", "size": "64MiB"},
            {"nsid": 2, "backend": "file", "path": "/var/tmp/bf-vol2.img", "size": "1MiB",
             "block_size": 512},
        ],
    }],
}


def _sub(**changes: Any) -> dict[str, Any]:
    """BASE's subsystem with ``changes`` applied."""
    return {**BASE["subsystems"][0], **changes}


def _ns(index: int, **changes: Any) -> Callable[[dict], None]:
    def mutate(cfg: dict) -> None:
        cfg["subsystems"][0]["namespaces"][index].update(changes)
    return mutate


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Set ``a.b`` (top-level mapping ``a``, key ``b``) or a top-level key."""
    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return mutate


def _listener(**fields: Any) -> Callable[[dict], None]:
    def mutate(cfg: dict) -> None:
        cfg["listeners"].append({"provider": "soft", **fields})
    return mutate


# (id, raw YAML text or a mutation of BASE, key path the error must name, fragment of the line)
CASES: list[tuple[str, str | Callable[[dict], None], str, str]] = [
    ("empty-file", "", "(top level)", "an empty file"),
    ("comment-only", "# nothing\n", "(top level)", "an empty file"),
    ("top-level-list", "- listeners\n", "(top level)", "got a list"),
    ("yaml-syntax", "listeners:\n  - address: [1\nsubsystems: []\n", "line 3, column 11",
     "valid YAML"),
    ("yaml-duplicate-key", "listeners: []\nsubsystems: []\nlisteners: []\n", "line 3, column 1",
     "given twice"),
    ("yaml-two-documents", "listeners: []\n---\nsubsystems: []\n", "line 2, column 1",
     "valid YAML"),
    ("unknown-top-key", _set("listener", []), "listener", "did you mean 'listeners'"),
    ("unknown-ns-key", _ns(0, blocksize=512), "subsystems[0].namespaces[0].blocksize",
     "did you mean 'block_size'"),
    ("missing-listeners", lambda c: c.pop("listeners"), "listeners", "the key is missing"),
    ("no-listeners", _set("listeners", []), "listeners", "at least 1"),
    ("bad-address", lambda c: c["listeners"][0].update(address="localhost"),
     "listeners[0].address", "IPv4 or IPv6"),
    ("bad-port", lambda c: c["listeners"][0].update(port=70000), "listeners[0].port", "70000"),
    ("port-as-string", lambda c: c["listeners"][0].update(port="4420"), "listeners[0].port",
     "an integer"),
    ("bad-provider", lambda c: c["listeners"][0].update(provider="rxe"),
     "listeners[0].provider", "auto, soft, verbs"),
    ("bad-transport", lambda c: c["listeners"][0].update(transport="fc"),
     "listeners[0].transport", "rdma, tcp"),
    ("dup-listener", _listener(address="127.0.0.1", port=4420), "listeners[1]",
     "127.0.0.1:4420"),
    ("dup-listener-v6-spelling", lambda c: c["listeners"].extend(
        [{"address": "::1"}, {"address": "0:0::1"}]), "listeners[2]", "[::1]:4420"),
    ("wildcard-overlap", _listener(address="0.0.0.0", port=4420), "listeners[1]", "wildcard"),
    ("dup-listener-name", _listener(address="127.0.0.2", name="lo"), "listeners[1].name",
     "listener name"),
    ("nqn-syntax", lambda c: c["subsystems"][0].update(nqn="iqn.2026-12.io.x:a"),
     "subsystems[0].nqn", "an NQN"),
    ("nqn-bad-month", lambda c: c["subsystems"][0].update(nqn="nqn.2026-13.io.x:a"),
     "subsystems[0].nqn", "an NQN"),
    ("nqn-too-long", lambda c: c["subsystems"][0].update(
        nqn="nqn.2026-12.io.x:" + "a" * 207), "subsystems[0].nqn", "223 bytes"),
    ("discovery-nqn", lambda c: c["subsystems"][0].update(
        nqn="nqn.2014-08.org.nvmexpress.discovery"), "subsystems[0].nqn", "discovery"),
    ("dup-nqn", lambda c: c["subsystems"].append(_sub(namespaces=[])), "subsystems[1].nqn",
     "not already used by subsystems[0].nqn"),
    ("serial-too-long", lambda c: c["subsystems"][0].update(serial="S" * 21),
     "subsystems[0].serial", "1 to 20"),
    ("serial-not-string", lambda c: c["subsystems"][0].update(serial=1234),
     "subsystems[0].serial", "quote it"),
    ("model-non-ascii", lambda c: c["subsystems"][0].update(model="bl\u00f6ck"),
     "subsystems[0].model", "ASCII"),
    ("host-not-nqn", lambda c: c["subsystems"][0].update(hosts=["client1"]),
     "subsystems[0].hosts[0]", "an NQN"),
    ("dup-host", lambda c: c["subsystems"][0].update(hosts=[HOST, HOST]),
     "subsystems[0].hosts[1]", "host NQN"),
    ("any-host-and-hosts", lambda c: c["subsystems"][0].update(allow_any_host=True),
     "subsystems[0].hosts", "allow_any_host"),
    ("allow-any-host-int", lambda c: c["subsystems"][0].update(allow_any_host=1),
     "subsystems[0].allow_any_host", "true or false"),
    ("namespace-not-mapping", lambda c: c["subsystems"][0].update(namespaces=[1]),
     "subsystems[0].namespaces[0]", "a mapping"),
    ("dup-nsid", _ns(1, nsid=1), "subsystems[0].namespaces[1].nsid", "an nsid"),
    ("nsid-zero", _ns(0, nsid=0), "subsystems[0].namespaces[0].nsid", "1 to 1024"),
    ("nsid-too-big", _ns(0, nsid=1025), "subsystems[0].namespaces[0].nsid", "1 to 1024"),
    ("missing-size", lambda c: c["subsystems"][0]["namespaces"][0].pop("size"),
     "subsystems[0].namespaces[0].size", "the key is missing"),
    ("size-decimal-unit", _ns(0, size="1GB"), "subsystems[0].namespaces[0].size",
     "write GiB"),
    ("size-fraction", _ns(0, size="1.5GiB"), "subsystems[0].namespaces[0].size",
     "binary unit"),
    ("size-unknown-unit", _ns(0, size="2Gib"), "subsystems[0].namespaces[0].size", "a unit of"),
    ("size-zero", _ns(0, size=0), "subsystems[0].namespaces[0].size", "at least"),
    ("size-not-block-multiple", _ns(1, size=1000), "subsystems[0].namespaces[1].size",
     "multiple of block_size 512"),
    ("block-size-1024", _ns(0, block_size=1024), "subsystems[0].namespaces[0].block_size",
     "512, 4096"),
    ("file-without-path", lambda c: c["subsystems"][0]["namespaces"][1].pop("path"),
     "subsystems[0].namespaces[1].path", "file backend needs one"),
    ("path-on-ramdisk", _ns(0, path="/tmp/x.img"), "subsystems[0].namespaces[0].path",
     "only file"),
    ("relative-path", _ns(1, path="vol2.img"), "subsystems[0].namespaces[1].path",
     "absolute path"),
    ("backend-bare-null", _ns(0, backend=None), "subsystems[0].namespaces[0].backend",
     'quote "null"'),
    ("backend-unknown", _ns(0, backend="nvme"), "subsystems[0].namespaces[0].backend",
     "ramdisk, file, null"),
    ("read-only-string", _ns(0, read_only="no"), "subsystems[0].namespaces[0].read_only",
     "true or false"),
    ("bad-uuid", _ns(0, uuid="1234"), "subsystems[0].namespaces[0].uuid", "a UUID"),
    ("zero-nguid", _ns(0, nguid="0" * 32), "subsystems[0].namespaces[0].nguid", "not all zero"),
    ("dup-uuid", lambda c: [ns.update(uuid="8461e01d-d0ac-5cad-99ec-c786fe9eb7dc")
                            for ns in c["subsystems"][0]["namespaces"]],
     "subsystems[0].namespaces[1].uuid", "namespace uuid"),
    ("shared-file", lambda c: c["subsystems"].append(_sub(
        nqn="nqn.2026-12.io.blockfabric:other", namespaces=[
            {"nsid": 1, "backend": "file", "path": "/var/tmp/../tmp/bf-vol2.img",
             "size": "1MiB"}])), "subsystems[1].namespaces[0].path", "namespace path"),
    ("unknown-listener-ref", lambda c: c["subsystems"][0].update(listeners=["eth0"]),
     "subsystems[0].listeners[0]", "127.0.0.1:4420, lo"),
    ("queue-size-small", _set("limits.queue_size", 8), "limits.queue_size", "16 to 1024"),
    ("inline-too-big", _set("limits.inline_data_size", "20KiB"), "limits.inline_data_size",
     "at most 16KiB"),
    ("mdts-not-pow2", _set("limits.mdts", "3MiB"), "limits.mdts", "power of two"),
    ("connect-timeout-zero", _set("limits.connect_timeout", 0), "limits.connect_timeout",
     "1 to 3600 (seconds)"),
    ("connect-timeout-text", _set("limits.connect_timeout", "10s"), "limits.connect_timeout",
     "1 to 3600 (seconds)"),
    ("limits-unknown-key", _set("limits.queue_depth", 64), "limits.queue_depth",
     "did you mean 'queue_size'"),
    ("kas-not-100ms", _set("keep_alive.kas_ms", 150), "keep_alive.kas_ms", "steps of 100"),
    ("kato-below-kas", lambda c: c.update(keep_alive={"kas_ms": 2000, "max_timeout_ms": 1000}),
     "keep_alive.max_timeout_ms", "at least kas_ms"),
    ("metrics-no-port", _set("metrics", {"address": "127.0.0.1"}), "metrics.port",
     "the key is missing"),
    ("control-socket-relative", _set("control_socket", "target.sock"), "control_socket",
     "absolute path"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, int, str, str]]:
    """Run every case's CLI at once (in parallel: each costs an interpreter start)."""
    folder = tmp_path_factory.mktemp("broken")
    procs = {}
    for case_id, content, _, _ in CASES:
        if callable(content):
            cfg = copy.deepcopy(BASE)
            content(cfg)
            content = yaml.safe_dump(cfg, sort_keys=False)
        path = folder / f"{case_id}.yaml"
        path.write_text(content)
        procs[case_id] = (str(path), subprocess.Popen(
            [CLI, "check", "--config", str(path)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    out = {}
    for case_id, (path, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        out[case_id] = (path, proc.returncode, stdout, stderr)
    return out


def test_table_is_big_and_ids_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) >= 20 and len(set(ids)) == len(ids)


@pytest.mark.parametrize(("case_id", "key", "fragment"), [(c[0], c[2], c[3]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_broken_config_fails_with_one_line(results: dict, case_id: str, key: str,
                                           fragment: str) -> None:
    path, returncode, stdout, stderr = results[case_id]
    assert returncode == 2, stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"blockfabric-target: error: {path}: {key}: expected "), lines[0]
    assert fragment in lines[0]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "check", *args], capture_output=True, text=True, timeout=60)


def test_missing_file_is_one_line_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    proc = run_check("--config", str(missing))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"blockfabric-target: error: {missing}: (file): expected a readable YAML file, "
        "got No such file or directory"]


def test_good_config_prints_effective_yaml(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(BASE))
    proc = run_check("-C", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    effective = yaml.safe_load(proc.stdout)
    sub = effective["subsystems"][0]
    assert len(sub["serial"]) == 20                      # derived, shown
    assert sub["model"] == "blockfabric"                 # default, shown
    assert sub["namespaces"][0]["size"] == "64MiB"
    assert sub["namespaces"][0]["block_size"] == 4096
    assert len(sub["namespaces"][0]["nguid"]) == 32
    assert effective["limits"]["queue_size"] == 128
    assert effective["listeners"][0]["transport"] == "rdma"
    # What check prints is itself a valid config that means the same thing.
    again = tmp_path / "again.yaml"
    again.write_text(proc.stdout)
    assert run_check("-C", str(again)).stdout.splitlines()[1:] == proc.stdout.splitlines()[1:]


@pytest.mark.skipif(Path("/etc/blockfabric/target.yaml").exists(),
                    reason="a real /etc/blockfabric/target.yaml exists here")
def test_without_config_checks_the_embedded_default() -> None:
    proc = run_check()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# effective configuration of the embedded default")
    effective = yaml.safe_load(proc.stdout)
    assert effective["subsystems"][0]["nqn"] == "nqn.2026-12.io.blockfabric:ram0"
    assert effective["subsystems"][0]["namespaces"][0]["size"] == "1GiB"

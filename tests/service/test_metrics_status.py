"""Scrape the metrics endpoint and ask `status` over the control socket of a running target:
the numbers match the I/O the test made."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from blockfabric.initiator.host import NvmeError

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN, base_config, free_port

TARGET = [sys.executable, "-m", "blockfabric.target.cli"]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Parse the exposition: (name, labels) -> value; also checks every line's syntax."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    sample = re.compile(r'([a-z_]+)(?:\{(.*)\})? (\S+)$')
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) blockfabric_[a-z_]+ ", line), line
            continue
        m = sample.match(line)
        assert m, line
        name, labels, value = m.groups()
        assert name.startswith("blockfabric_"), name
        pairs = frozenset(re.findall(r'([a-z]+)="((?:[^"\\]|\\.)*)"', labels or ""))
        out[name, pairs] = float(value)
    return out


def value(samples, name, **labels) -> float:
    want = frozenset((k, str(v)) for k, v in labels.items())
    return samples[name, want]


@pytest.fixture
def service(tmp_path, start_service):
    mport = free_port()
    config = base_config(tmp_path, free_port(), metrics={"address": "127.0.0.1",
                                                         "port": mport})
    config["subsystems"][0]["namespaces"].append(
        {"nsid": 2, "backend": "file", "path": str(tmp_path / "v2.img"), "size": "8MiB"})
    svc = start_service(config)
    svc.metrics_port = mport
    svc.socket = config["control_socket"]
    return svc


def test_metrics_counters_match_the_io(service):
    with service.connect() as ctrl:
        ns1, ns2 = ctrl.namespaces[1], ctrl.namespaces[2]
        for i in range(7):
            ns1.write(i * 4096, b"w" * 4096)
        for i in range(3):
            ns1.read(i * 8192, 8192)
        for i in range(5):
            ns2.write(i * 65536, b"f" * 65536)
        ns2.read(0, 4096)
        with pytest.raises(NvmeError):
            ns2.read(64 << 20, 4096)              # beyond the end: one error
        s = scrape(service.metrics_port)
        ns = {"subnqn": NQN}
        assert value(s, "blockfabric_namespace_io_total", nsid=1, op="write", **ns) == 7
        assert value(s, "blockfabric_namespace_io_total", nsid=1, op="read", **ns) == 3
        assert value(s, "blockfabric_namespace_io_bytes_total", nsid=1, op="read",
                     **ns) == 3 * 8192
        assert value(s, "blockfabric_namespace_io_total", nsid=2, op="write", **ns) == 5
        assert value(s, "blockfabric_namespace_io_bytes_total", nsid=2, op="write",
                     **ns) == 5 * 65536
        assert value(s, "blockfabric_subsystem_io_total", op="write", **ns) == 12
        assert value(s, "blockfabric_subsystem_io_total", op="read", **ns) == 4
        ctl = {"cntlid": ctrl.cntlid, "hostnqn": HOSTNQN, "subnqn": NQN}
        assert value(s, "blockfabric_controller_io_total", op="write", **ctl) == 12
        assert value(s, "blockfabric_controller_io_errors_total", **ctl) == 1
        # The histogram: +Inf bucket and _count equal the op count; buckets are cumulative.
        hist = {"nsid": "2", "op": "write", **ns}
        assert value(s, "blockfabric_namespace_io_latency_seconds_count", **hist) == 5
        assert value(s, "blockfabric_namespace_io_latency_seconds_bucket", le="+Inf",
                     **hist) == 5
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in s.items()
                         if k[0] == "blockfabric_namespace_io_latency_seconds_bucket"
                         and ("nsid", "2") in k[1] and ("op", "write") in k[1])
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert 0 < value(s, "blockfabric_namespace_io_latency_seconds_sum", **hist) < 5
        assert value(s, "blockfabric_subsystem_controllers", **ns) == 1
        assert value(s, "blockfabric_controller_queues", **ctl) == 3
        assert value(s, "blockfabric_up") == 1


def test_status_human_and_json(service):
    with service.connect(), service.connect(hostnqn=OTHER_HOSTNQN) as other:
        other.namespaces[1].write(0, b"s" * 16384)
        out = subprocess.run(TARGET + ["status", "--socket", service.socket,
                                       "--output-format", "json"],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert [x["port"] for x in st["listeners"]] == [service.port]
        assert st["state"] == "serving"
        ctrls = {c["hostnqn"]: c for c in st["controllers"]}
        assert set(ctrls) == {HOSTNQN, OTHER_HOSTNQN}
        c = ctrls[OTHER_HOSTNQN]
        assert c["io"]["writes"] == 1 and c["io"]["written_bytes"] == 16384
        assert c["kato_ms"] == 5000 and [q["qid"] for q in c["queues"]] == [0, 1, 2]
        sub = st["subsystems"][0]
        assert sub["nqn"] == NQN and [n["nsid"] for n in sub["namespaces"]] == [1, 2]
        assert sub["namespaces"][0]["io"]["written_bytes"] == 16384
        text = subprocess.run(TARGET + ["status", "--socket", service.socket],
                              capture_output=True, text=True, timeout=20)
        assert text.returncode == 0, text.stderr
        assert f"ctrl {c['cntlid']}  {OTHER_HOSTNQN} -> {NQN}" in text.stdout
        assert "kato 5000 ms" in text.stdout and "q1:" in text.stdout
        assert "writes 1 (16KiB)" in text.stdout


def test_status_without_a_target_says_so(tmp_path):
    out = subprocess.run(TARGET + ["status", "--socket", str(tmp_path / "none.sock")],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 1 and "no control socket" in out.stderr


def test_metrics_are_off_unless_configured(tmp_path, start_service):
    svc = start_service(base_config(tmp_path, free_port()))
    assert "metrics on" not in svc.proc.log
    assert svc.proc.stop() == 0

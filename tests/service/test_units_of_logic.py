"""The pure parts: the reload plan, the exposition format, and resizing the backends."""

from __future__ import annotations

import time

import pytest

from blockfabric.target import config as cfg
from blockfabric.target import metrics
from blockfabric.target import reload
from blockfabric.target.backends import FileBackend, RamdiskBackend

NQN = "nqn.2026-12.io.blockfabric:a"


def _conf(**sub):
    base = {"nqn": NQN, "allow_any_host": True,
            "namespaces": [{"nsid": 1, "backend": "ramdisk", "size": "1MiB"},
                           {"nsid": 2, "backend": "ramdisk", "size": "1MiB"},
                           {"nsid": 3, "backend": "file", "path": "/tmp/x.img",
                            "size": "1MiB"}]}
    base.update(sub)
    return cfg.TargetConfig.from_dict({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420}],
        "subsystems": [base]})


def test_plan_of_an_unchanged_config_is_empty():
    p = reload.plan(_conf(), _conf())
    assert p.summary() == "no changes" and not p.discovery_changed


def test_plan_classifies_namespace_changes():
    old = _conf()
    new = _conf(namespaces=[{"nsid": 1, "backend": "ramdisk", "size": "2MiB",
                             "read_only": True},
                            {"nsid": 3, "backend": "file", "path": "/tmp/x.img",
                             "size": "1MiB", "read_only": True},
                            {"nsid": 4, "backend": "null", "size": "1GiB"}])
    (change,) = reload.plan(old, new).changed
    assert [n.nsid for n in change.resized] == [1]
    assert [n.nsid for n in change.flipped] == [1]       # memory: flipped in place
    assert [n.nsid for n in change.replaced] == [3]      # a file is reopened
    assert change.removed == [2] and [n.nsid for n in change.added] == [4]
    assert change.changed_nsids == (1, 2, 3, 4)
    assert not change.access_changed


def _rbd_gateway(image="vol0", ana_group=None, **gateway):
    ns = {"nsid": 1, "backend": "rbd", "rbd": {"pool": "rbd", "image": image}}
    if ana_group is not None:
        ns["ana_group"] = ana_group
    gw = {"name": "gw-a", "group": "g", "cntlid_min": 1, "cntlid_max": 9, "ana_groups": [1]}
    return cfg.TargetConfig.from_dict({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420}],
        "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [ns]}],
        "gateway": {**gw, **gateway}})


def test_plan_of_rbd_namespaces_and_the_gateway_section():
    old = _rbd_gateway()
    (change,) = reload.plan(old, _rbd_gateway(ana_group=5)).changed
    assert [n.nsid for n in change.regrouped] == [1] and not change.replaced
    assert "ns_ana_group=1" in reload.plan(old, _rbd_gateway(ana_group=5)).summary()
    # another image under the same nsid is another volume (it used to be ignored)
    (change,) = reload.plan(old, _rbd_gateway(image="vol1")).changed
    assert [n.nsid for n in change.replaced] == [1]
    # what a reload applies to the gateway section, and what it refuses naming the key
    for ok in ({"ana_groups": [1, 2]}, {"others": "inaccessible"}, {"lease": 9},
               {"cntlid_max": 20}):
        new = _rbd_gateway(**ok)
        assert reload.plan(old, new).gateway_changed
        assert reload.gateway_refusal(old.gateway, new.gateway) is None, ok
    assert not reload.plan(old, _rbd_gateway()).gateway_changed
    for key, value in (("name", "gw-x"), ("group", "h")):
        why = reload.gateway_refusal(old.gateway, _rbd_gateway(**{key: value}).gateway)
        assert why.startswith(f"gateway.{key}: ") and "restart the gateway" in why
    why = reload.gateway_refusal(old.gateway, _rbd_gateway(image="vol1", ana_group=None,
                                                           ceph={"pool": "other"}).gateway)
    assert why.startswith("gateway.ceph: client.admin@rbd (") and "@other" in why
    assert reload.gateway_refusal(old.gateway, None).startswith("gateway: a reload cannot take")
    assert reload.gateway_refusal(None, old.gateway).startswith("gateway: a reload cannot make")


def test_plan_access_and_listener_changes_touch_discovery():
    p = reload.plan(_conf(), _conf(allow_any_host=False, hosts=[NQN + ":h"]))
    assert p.changed[0].access_changed and p.discovery_changed
    renamed = cfg.TargetConfig.from_dict({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420,
                       "name": "n"}], "subsystems": []})
    plain = cfg.TargetConfig.from_dict({
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": 4420}],
        "subsystems": []})
    p = reload.plan(plain, renamed)
    assert not p.added_listeners and not p.removed_listeners


def test_iostats_buckets_and_exposition():
    stats = metrics.IoStats()
    start = time.perf_counter_ns()
    stats.done(metrics.WRITE, 4096, start, True)
    stats.done(metrics.WRITE, 4096, start - 2_000_000_000, True)   # 2 s ago: the 5 s bucket
    stats.done(metrics.READ, 512, start, False)
    assert stats.ops == [0, 2] and stats.bytes == [0, 8192] and stats.errors == 1
    fams = metrics.IoFamilies("namespace")
    fams.add({"nsid": "1", "subnqn": 'a"b'}, stats)
    text = metrics.render(fams.families())
    assert 'subnqn="a\\"b"' in text
    assert 'blockfabric_namespace_io_latency_seconds_bucket{nsid="1",subnqn="a\\"b",' \
           'op="write",le="1.0"} 1' in text
    assert 'op="write",le="5.0"} 2' in text and 'op="write",le="+Inf"} 2' in text
    assert 'blockfabric_namespace_io_latency_seconds_count{nsid="1",subnqn="a\\"b",' \
           'op="write"} 2' in text
    assert "# TYPE blockfabric_namespace_io_latency_seconds histogram" in text


def test_ramdisk_resize_keeps_data_both_ways():
    with RamdiskBackend(1 << 20) as ram:
        ram.write(4096, b"k" * 4096)
        ram.resize(4 << 20)
        assert ram.size == 4 << 20 and len(ram.memory) == 4 << 20
        buf = bytearray(4096)
        ram.readinto(4096, buf)
        assert buf == b"k" * 4096
        ram.readinto((4 << 20) - 4096, buf)
        assert buf == bytes(4096)
        ram.resize(8192)
        ram.readinto(4096, buf)
        assert buf == b"k" * 4096
        with pytest.raises(OSError):
            ram.readinto(8192, buf)


def test_ramdisk_resize_refuses_while_memory_is_registered():
    with RamdiskBackend(1 << 20) as ram:
        held = ram.memory[0:4096]                 # what a memory region holds
        with pytest.raises(BufferError):
            ram.resize(2 << 20)
        held.release()
        ram.resize(2 << 20)
        assert ram.size == 2 << 20


def test_file_resize_grows_and_never_shrinks(tmp_path):
    path = tmp_path / "v.img"
    with FileBackend(str(path), 1 << 20) as f:
        f.write(0, b"z" * 4096)
        f.resize(3 << 20)
        assert path.stat().st_size == 3 << 20 and f.size == 3 << 20
        with pytest.raises(OSError, match="cannot shrink"):
            f.resize(1 << 20)
        assert path.stat().st_size == 3 << 20
    assert path.read_bytes()[:4096] == b"z" * 4096

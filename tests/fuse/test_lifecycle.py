"""Mounting and unmounting as a user does it: the daemon's exit status, the three ways to
unmount (each leaving no process, mount or record behind), list/disconnect, the initiator
YAML, and a loop device with ext4 on top of a mounted namespace."""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import tempfile

import pytest
import yaml

from blockfabric.errors import ConfigError
from blockfabric.initiator.initiator_config import load, loads

from .conftest import BIN, NQN, Mount, free_port, mounted_at, run_cli, wait_gone


def leftovers(m: Mount) -> list[str]:
    """Processes still serving ``m`` (pgrep on its unique mount point)."""
    out = subprocess.run(["pgrep", "-f", m.path], capture_output=True, text=True).stdout
    return [p for p in out.split() if int(p) != os.getpid()]


@pytest.mark.parametrize("how", ["umount", "fusermount", "sigterm"])
def test_unmount_leaves_nothing_behind(make_mount, how):
    m = make_mount(name=f"un-{how}")
    pid = m.pid
    assert leftovers(m) == [str(pid)]
    if how == "umount":
        run_cli("umount", m.path, env=m.env)
    elif how == "fusermount":
        subprocess.run(["fusermount3", "-u", m.path], check=True)
    else:
        os.kill(pid, signal.SIGTERM)
    assert wait_gone(pid), f"mount process {pid} still alive after {how}"
    assert not mounted_at(m.path)
    assert leftovers(m) == []
    assert json.loads(run_cli("list", "--output-format", "json", env=m.env).stdout) == \
        {"mounts": []}
    assert os.listdir(m.env["BLOCKFABRIC_RUNTIME_DIR"]) == []


def test_daemon_reports_connection_failure_and_leaves_nothing(target, tmp_path):
    m = Mount(target, tmp_path, name="refused")
    m.target = type("NoTarget", (), {"port": free_port()})()     # nothing listens there
    proc = run_cli(*m.argv(), env=m.env, check=False)
    assert proc.returncode == 1
    assert "refused" in proc.stderr, proc.stderr
    assert not mounted_at(m.path)
    assert leftovers(m) == []


def test_missing_mount_point_is_a_clear_error(target, tmp_path):
    m = Mount(target, tmp_path, name="gone")
    os.rmdir(m.path)
    proc = run_cli(*m.argv(), env=m.env, check=False)
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr


def test_list_shows_mounts_and_cleans_stale_records(make_mount):
    m = make_mount(name="listed")
    run_dir = m.env["BLOCKFABRIC_RUNTIME_DIR"]
    stale = os.path.join(run_dir, "mount-0000000000000000.json")
    with open(stale, "w") as f:
        json.dump({"mountpoint": "/nowhere", "pid": 2 ** 22 + 1, "subnqn": NQN,
                   "traddr": "127.0.0.1", "trsvcid": 1, "provider": "soft", "cntlid": 1,
                   "hostnqn": "x"}, f)
    out = json.loads(run_cli("list", "--output-format", "json", env=m.env).stdout)
    assert [r["mountpoint"] for r in out["mounts"]] == [m.path]
    assert out["mounts"][0]["subnqn"] == NQN
    assert [n["file"] for n in out["mounts"][0]["namespaces"]] == ["n1", "n2", "n3"]
    assert not os.path.exists(stale)
    text = run_cli("list", env=m.env).stdout
    assert m.path in text and NQN in text


def test_disconnect_by_nqn_unmounts(make_mount):
    m = make_mount(name="disc")
    pid = m.pid
    out = run_cli("disconnect", "-n", NQN, env=m.env).stdout
    assert "disconnected" in out
    assert wait_gone(pid) and not mounted_at(m.path)
    assert run_cli("disconnect", "-n", NQN, env=m.env, check=False).returncode == 1


def test_mount_all_from_the_initiator_yaml(target, tmp_path):
    m = Mount(target, tmp_path, name="fromyaml")
    cfg = tmp_path / "initiator.yaml"
    cfg.write_text(yaml.safe_dump({"mounts": [{
        "name": "vol", "traddr": "127.0.0.1", "trsvcid": target.port, "nqn": NQN,
        "mountpoint": m.path, "provider": "soft", "options": ["ro"]}]}))
    try:
        run_cli("mount", "--config", str(cfg), "--all", env=m.env)
        assert mounted_at(m.path)
        assert stat_mode(m.file("n1")) == 0o444
        # already mounted: a second --all is a no-op, not an error
        assert "already mounted" in run_cli("mount", "--config", str(cfg), "--all",
                                            env=m.env).stdout
    finally:
        m.cleanup()
    assert not mounted_at(m.path)


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777


def test_shipped_initiator_yaml_loads():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = load(os.path.join(root, "configs", "initiator.yaml"))
    assert config.mounts and config.find("ram0") is config.mounts[0]


@pytest.mark.parametrize("text,key,expected", [
    ("mounts: [{traddr: a, nqn: b}]", "mounts[0].mountpoint", "absolute path"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: rel}]", "mounts[0].mountpoint", "absolute"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, trsvcid: 0}]", "mounts[0].trsvcid",
     "integer from 1 to 65535"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, provider: tcp}]", "mounts[0].provider",
     "one of auto"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, colour: red}]", "mounts[0].colour",
     "one of"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, options: 'threads=x'}]",
     "mounts[0].options", "valid mount options"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m}, {traddr: a, nqn: c, mountpoint: /m}]",
     "mounts[1].mountpoint", "not already used by mounts[0]"),
    ("mount: []", "mount", "did you mean 'mounts'"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, dhchap_secret: 'DHHC-1:01:Zm9v:'}]",
     "mounts[0].dhchap_secret", "DH-HMAC-CHAP secret"),
    ("mounts: [{traddr: a, nqn: b, mountpoint: /m, dhchap_ctrl_secret: 'DHHC-1:00:"
     "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACtVQoZ:'}]",
     "mounts[0].dhchap_secret", "a host secret too"),
])
def test_bad_initiator_yaml_names_file_key_and_expectation(text, key, expected):
    with pytest.raises(ConfigError) as exc:
        loads(text, "/etc/x.yaml")
    assert exc.value.path == "/etc/x.yaml" and exc.value.key == key
    assert expected in exc.value.expected
    assert str(exc.value).startswith(f"/etc/x.yaml: {key}: expected")


@pytest.mark.skipif(os.geteuid() != 0, reason="losetup and mount need root")
@pytest.mark.skipif(shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None,
                    reason="needs util-linux and e2fsprogs")
def test_loop_device_ext4_copy_and_fsck(make_mount, tmp_path):
    m = make_mount(name="loop")
    fsdir = tmp_path / "ext4"
    fsdir.mkdir()
    loop = subprocess.run(["losetup", "--direct-io=on", "-f", "--show", m.file("n1")],
                          capture_output=True, text=True, check=True).stdout.strip()
    mounted = False
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True, timeout=60)
        subprocess.run(["mount", loop, str(fsdir)], check=True)
        mounted = True
        payload = {f"f{i}.bin": os.urandom(50_000 * (i + 1)) for i in range(5)}
        for name, data in payload.items():
            (fsdir / name).write_bytes(data)
        shutil.copytree(os.path.dirname(os.path.abspath(__file__)), fsdir / "tree")
        subprocess.run(["umount", str(fsdir)], check=True)
        mounted = False
        fsck = subprocess.run(["fsck.ext4", "-n", "-f", loop], capture_output=True, text=True)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
        subprocess.run(["mount", "-o", "ro", loop, str(fsdir)], check=True)
        mounted = True
        for name, data in payload.items():
            assert (fsdir / name).read_bytes() == data
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(fsdir)], check=False)
        subprocess.run(["losetup", "-d", loop], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to become an ordinary user (setpriv)")
def test_ordinary_user_mounts_uses_and_unmounts(target):
    """As nobody: mount (fusermount3 does the privileged part), write and read, umount."""
    nobody = pwd.getpwnam("nobody")
    base = tempfile.mkdtemp(prefix="bf-user-")
    try:
        os.chmod(base, 0o755)
        os.makedirs(os.path.join(base, "mnt"))
        for path in (base, os.path.join(base, "mnt")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        m = Mount(target, pathlib.Path(base), name="mnt")
        as_user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                   "--clear-groups", "env", f"HOME={base}"]
        env = dict(m.env, BLOCKFABRIC_RUNTIME_DIR=os.path.join(base, "run"))
        blockfabric = str(BIN / "blockfabric")
        subprocess.run(as_user + [blockfabric, *m.argv()], env=env, check=True, timeout=30)
        try:
            out = subprocess.run(as_user + ["sh", "-c", f"printf user | dd of={m.file('n1')} "
                                 f"conv=notrunc status=none; head -c 4 {m.file('n1')}; "
                                 f"grep -c 'state       live' {m.file('.status')}"],
                                 capture_output=True, text=True, timeout=30)
            assert out.stdout == "user1\n", out
        finally:
            subprocess.run(as_user + [blockfabric, "umount", m.path], env=env, timeout=30)
        assert not mounted_at(m.path)
        assert leftovers(m) == []
    finally:
        subprocess.run(["fusermount3", "-u", "-z", os.path.join(base, "mnt")],
                       capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)

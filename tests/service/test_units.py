"""The systemd units: systemd-analyze verify passes, and the settings the issue asks for
are there (a unit that verifies but forgets Type=notify would still be wrong)."""

from __future__ import annotations

import configparser
import pathlib
import shutil
import subprocess
import sys

import pytest

UNITS = pathlib.Path(__file__).resolve().parents[2] / "systemd"
VENV_BIN = pathlib.Path(sys.executable).parent


def _settings(path: pathlib.Path) -> dict[str, dict[str, list[str]]]:
    """Unit file sections -> key -> every value given (keys repeat in unit files)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key, []).append(value)
    return out


@pytest.fixture
def installed(tmp_path):
    """Copies of the units with ExecStart pointing at this venv (verify needs the binary)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (Debian package systemd)")
    for unit in UNITS.glob("*.service"):
        text = unit.read_text().replace("/usr/local/bin/", f"{VENV_BIN}/")
        (tmp_path / unit.name).write_text(text)
    template = tmp_path / "blockfabric-mount@.service"
    shutil.copy(template, tmp_path / "blockfabric-mount@vol0.service")
    return tmp_path


@pytest.mark.parametrize("unit", ["blockfabric-target.service",
                                  "blockfabric-mount@vol0.service"])
def test_systemd_analyze_verify(installed, unit):
    result = subprocess.run(["systemd-analyze", "verify", str(installed / unit)],
                            capture_output=True, text=True, timeout=60)
    # verify exits 0 on many problems it only warns about: any output is a failure here.
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", \
        result.stdout + result.stderr


def test_verify_would_catch_a_broken_unit(installed):
    broken = installed / "broken.service"
    broken.write_text((installed / "blockfabric-target.service").read_text()
                      .replace("Type=notify", "Type=notifyy"))
    result = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True,
                            text=True, timeout=60)
    assert "notifyy" in result.stderr


def test_target_unit_settings():
    s = _settings(UNITS / "blockfabric-target.service")
    unit, service = s["Unit"], s["Service"]
    assert service["Type"] == ["notify"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert "network-online.target" in " ".join(unit["After"])
    assert "network-online.target" in " ".join(unit["Wants"])
    assert unit["RequiresMountsFor"]
    for key, value in (("ProtectSystem", "strict"), ("PrivateTmp", "true"),
                       ("NoNewPrivileges", "true"), ("LimitMEMLOCK", "infinity")):
        assert service[key] == [value], key
    assert "CAP_IPC_LOCK" in service["CapabilityBoundingSet"][0]
    assert any("infiniband" in v for v in service["DeviceAllow"])
    assert "/run/blockfabric" in service["ReadWritePaths"][0]
    stop = int(service["TimeoutStopSec"][0])
    from blockfabric.target.drain import DRAIN_TIMEOUT
    assert DRAIN_TIMEOUT < stop, "a drain must end before systemd kills the daemon"
    watchdog = int(service["WatchdogSec"][0])
    assert watchdog > 0


def test_mount_unit_does_not_hang_boot():
    s = _settings(UNITS / "blockfabric-mount@.service")
    unit, service = s["Unit"], s["Service"]
    assert "network-online.target" in " ".join(unit["After"])
    assert "local-fs.target" not in " ".join(unit.get("Before", []))
    # nofail-like: wanted by remote-fs.target, never holding it (nor logins) while it retries
    assert "remote-fs.target" not in " ".join(unit.get("Before", []))
    assert service["Restart"] == ["on-failure"] and service["RestartSec"]
    assert int(service["TimeoutStartSec"][0]) <= 60
    assert "mount -f %I" in service["ExecStart"][0]
    assert s["Install"]["WantedBy"] == ["remote-fs.target"]


def test_units_parse_as_ini():
    """No stray lines a human would misread (every line is a comment, section or key)."""
    for unit in UNITS.glob("*.service"):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str
        parser.read_string(unit.read_text())
        assert parser.sections()

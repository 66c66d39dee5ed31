"""The target's parts reach the daemon only through the narrow interfaces they are given:
read from the source (every import, those under TYPE_CHECKING included), so a new import
of the composition root or of a part a module must not know fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

TARGET = pathlib.Path(__file__).resolve().parents[2] / "target"

#: module -> the target modules it must not import (directly or under TYPE_CHECKING)
FORBIDDEN = {
    # the controller gets services.Resources and services.Owner, never the daemon
    "controller": {"server", "listeners", "sessions", "registry", "broker", "reloader"},
    "ctrl_auth": {"server", "listeners", "sessions", "registry", "broker", "reloader",
                  "controller"},
    "ctrl_io": {"server", "listeners", "sessions", "registry", "broker", "reloader",
                "controller"},
    "services": {"server"},
    # each gets what it uses, not the Target
    "ana": {"server"},
    "gateway": {"server"},
    "rbdvolume": {"server", "reloader"},
    "resvctl": {"server"},
    "reloader": {"server"},
    "nschanges": {"server", "reloader"},
    # the parts of the daemon do not reach back into the root that builds them
    "broker": {"server", "registry", "sessions", "listeners", "controller"},
    "registry": {"server", "listeners"},
    "sessions": {"server", "listeners"},
    "listeners": {"server"},
    "drain": {"server"},
}


def target_imports(module: str) -> set[str]:
    """The ``blockfabric.target`` modules that ``target/<module>.py`` imports (relative
    imports included: ``from . import x``, ``from .x import y``)."""
    tree = ast.parse((TARGET / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1:         # relative, in target/
                name = "blockfabric.target" + ("." + name if name else "")
            if name == "blockfabric.target":
                found.update(alias.name for alias in node.names)
            elif name.startswith("blockfabric.target."):
                found.add(name.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("blockfabric.target."):
                    found.add(alias.name.split(".")[2])
    return {m for m in found if (TARGET / f"{m}.py").exists()}


def reached(module: str) -> set[str]:
    """Every target module ``module`` imports, directly or through the modules it imports."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in target_imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


#: the daemon: what the controller logic may not reach even through another module
DAEMON = {"server", "listeners", "sessions", "registry", "broker", "reloader", "reload",
          "pollgroups", "worker", "drain", "control", "status", "groupstate", "gateway",
          "nschanges", "cli"}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_module_imports_no_part_it_must_not_know(module):
    wrong = target_imports(module) & FORBIDDEN[module]
    assert not wrong, f"target/{module}.py imports {sorted(wrong)}"


@pytest.mark.parametrize("module", ["controller", "ctrl_auth", "ctrl_io", "services"])
def test_the_controller_reaches_nothing_of_the_daemon(module):
    """Not even through a module it imports (resvctl, namespace, backends, ...)."""
    wrong = reached(module) & DAEMON
    assert not wrong, f"target/{module}.py reaches {sorted(wrong)}"


def test_the_checker_follows_imports():
    """The closure is really followed: server reaches the controller through its parts."""
    assert {"controller", "ctrl_io", "ctrl_auth", "resvctl"} <= reached("server")
    assert "sessions" not in target_imports("controller") and "controller" in reached("sessions")


def test_the_checker_sees_imports_under_type_checking():
    """server.py's parts are found by the same reader, so an import it misses cannot pass."""
    assert {"listeners", "sessions", "registry", "broker"} <= target_imports("server")
    assert "controller" in target_imports("services")       # under TYPE_CHECKING there


def test_every_target_module_opens_with_what_it_owns():
    for path in sorted(TARGET.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.split("\n\n", 1)[0].strip(), f"{path.name}: no opening docstring"

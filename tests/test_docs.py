"""The documentation names only what exists: every file README.md and docs/*.md name, every
relative link they make, and every ``Class.member`` and ``module.name`` that
docs/architecture.md's walk through the code names.  A module renamed, split or removed
without its docs fails here (issue 15: the docs match the code)."""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
             "node_modules"}
#: files the docs name that are not in this repository, on purpose: the pure-Python
#: performance floor is found outside the project (docs/performance.md)
EXTERNAL = {"floor_target.py", "floor_host.py", "floor.py"}
#: a file name as the docs write one: an optional folder path, a name, a known ending
FILE_RE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh|md|yaml|fio))(?![\w/])")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
CODE_RE = re.compile(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)`")


@functools.cache
def tree_files() -> tuple[str, ...]:
    """Every file below the root, as a path relative to it (tooling folders left out)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = pathlib.Path(folder).relative_to(ROOT)
        found.extend((rel / name).as_posix() for name in files)
    return tuple(found)


def exists(ref: str) -> bool:
    """``ref`` is a file of the tree: the whole relative path, or its tail (docs write
    ``fabric/tcp_host.py`` and ``qp.py`` where the folder is clear from the text)."""
    return any(f == ref or f.endswith("/" + ref) for f in tree_files())


def named_files(doc: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in FILE_RE.finditer(line):
            ref = m.group(1).lstrip("./")
            if ref not in EXTERNAL and "://" not in line[max(0, m.start() - 8):m.start()]:
                out.append((n, ref))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    missing = [f"{doc.name}:{n}: {ref}" for n, ref in named_files(doc) if not exists(ref)]
    assert not missing, "named in the docs, not in the tree:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    broken = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in LINK_RE.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name}:{n}: {m.group(1)}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_checker_sees_a_missing_file(tmp_path):
    """A doc naming a module that is not there is caught (the check cannot pass blind)."""
    doc = tmp_path / "x.md"
    doc.write_text("`blockfabric/fabric/no_such.py` and `target/server.py`, `qp.py`\n")
    assert [ref for _, ref in named_files(doc) if not exists(ref)] == [
        "blockfabric/fabric/no_such.py"]


# -- the names docs/architecture.md gives for each hop ------------------------------------

@functools.cache
def code_index() -> tuple[dict[str, set[str]], dict[str, list[str]], dict[str, set[str]]]:
    """From every source module: class -> members (methods, class attributes, attributes
    set on ``self``), class -> base names, and module stem -> top-level names."""
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    modules: dict[str, set[str]] = {}
    for rel in tree_files():
        if not rel.endswith(".py") or not rel.startswith(("blockfabric/", "target/",
                                                         "initiator/")):
            continue
        tree = ast.parse((ROOT / rel).read_text())
        top = modules.setdefault(pathlib.PurePath(rel).stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            own = members.setdefault(node.name, set())
            bases.setdefault(node.name, []).extend(
                b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                if isinstance(b, (ast.Name, ast.Attribute)))
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) \
                        and item.value.id == "self" and isinstance(item.ctx, ast.Store):
                    own.add(item.attr)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
    return members, bases, modules


def has_member(cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
    members, bases, _ = code_index()
    if cls in seen or cls not in members:
        return False
    return name in members[cls] or any(has_member(b, name, seen | {cls})
                                       for b in bases.get(cls, ()))


def unknown_names(text: str) -> list[str]:
    """The ``Class``, ``Class.member``, ``module.name`` and ``_private`` names in ``text``
    that no source module defines (names of other kinds, ``os.readv``, ``READ``, config keys
    and the like, are passed)."""
    members, _, modules = code_index()
    private = set().union(*members.values(), *modules.values())
    wrong = []
    for m in CODE_RE.finditer(text):
        parts = m.group(1).split(".")
        if parts[-1] in {"py", "sh", "md", "yaml", "fio"}:
            continue                    # a file name: see test_every_file_a_doc_names_exists
        classy = parts[0].lstrip("_")[:1].isupper() and not parts[0].isupper()
        if len(parts) == 1 and classy:
            if parts[0] not in members:         # a class (CamelCase) no module defines
                wrong.append(m.group(1))
        elif len(parts) == 2 and classy and parts[0] in members:
            if not has_member(*parts):
                wrong.append(m.group(1))
        elif len(parts) == 2 and parts[0] in modules and parts[0] not in {"os", "self"}:
            if parts[1] not in modules[parts[0]]:
                wrong.append(m.group(1))
        elif len(parts) == 1 and parts[0].startswith("_") and not parts[0].startswith("__"):
            if parts[0] not in private:
                wrong.append(m.group(1))
        elif len(parts) == 2 and classy:
            wrong.append(m.group(1))
    return wrong


def test_every_name_of_the_walk_through_exists():
    wrong = unknown_names((ROOT / "docs" / "architecture.md").read_text())
    assert not wrong, f"docs/architecture.md names what the code does not define: {wrong}"


def test_the_name_checker_sees_a_wrong_name():
    assert unknown_names("`HostQueue.submit_rw` `Controller.issue_io` `reloader.Reloadable` "
                         "`_on_capsule` `os.readv` `_IoRequest.io_done` `SoftMR` `READ`") == []
    assert unknown_names("`HostQueue.submit_nothing` `reloader.Nothing` `_no_such` "
                         "`NoSuchClass.run` `NoSuchClass`") == [
        "HostQueue.submit_nothing", "reloader.Nothing", "_no_such", "NoSuchClass.run",
        "NoSuchClass"]


def test_readme_layout_names_every_module():
    """A newcomer finds every module of the three packages in the README's Layout (a new
    module without its line there fails here)."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 1)]
    missing = [rel for rel in tree_files()
               if rel.startswith(("blockfabric/", "target/", "initiator/"))
               and rel.endswith(".py") and not rel.endswith("__init__.py")
               and not re.search(rf"(?<![\w.]){re.escape(pathlib.PurePath(rel).name)}", layout)]
    assert not missing, f"README.md's Layout does not name: {sorted(missing)}"


#: a module's first docstring says why it is one module when it runs past this many lines
LONG = 500


def test_every_long_module_says_why_at_its_top():
    """Issue 15: no module over ~500 lines without a reason written at its top ("Why one
    module of ~N lines" or "Longer than ~500 lines because")."""
    silent = []
    for rel in tree_files():
        if not rel.endswith(".py") or not rel.startswith(("blockfabric/", "target/",
                                                          "initiator/", "benchmarks/")):
            continue
        text = (ROOT / rel).read_text()
        if text.count("\n") <= LONG:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not re.search(r"Why one module|Longer than ~?\d+ lines because", doc):
            silent.append(f"{rel} ({text.count(chr(10))} lines)")
    assert not silent, f"long modules that do not say why: {silent}"

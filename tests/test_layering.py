"""The sans-IO layer stays sans-IO: ``protocol`` and ``errors`` import no I/O module.

Checked twice: statically, by parsing the source of each module and of every
streamq module it imports (transitively); and at runtime, by importing
``streamq.protocol`` in a fresh interpreter without running the package's
``__init__`` (which is the public facade and imports everything on purpose).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = "streamq"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE
FORBIDDEN = frozenset({"asyncio", "socket", "sqlite3", "aiosqlite", "selectors", "threading"})
SANS_IO_MODULES = ("streamq.protocol", "streamq.errors", "streamq.filters", "streamq.resharing")


def _module_file(package_dir: Path, package: str, name: str) -> Path | None:
    """The file of module ``name`` of ``package``, whose directory is ``package_dir``."""
    parts = name.split(".")
    if parts[0] != package or len(parts) == 1:
        # Not ours, or the bare package: its __init__ is the facade, not followed.
        return None
    base = package_dir.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, module: str) -> set[str]:
    """Absolute names of every module ``path`` may import, anywhere in the file.

    ``from x import y`` yields both ``x`` and ``x.y`` (``y`` may be a submodule);
    relative imports are resolved against ``module``; literal ``__import__("x")``
    and ``importlib.import_module("x")`` calls count too.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            called = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            if called in ("__import__", "import_module") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value)
    return names


def forbidden_imports(
    package_dir: Path, package: str, start: str, forbidden: frozenset[str] = FORBIDDEN
) -> tuple[dict[str, set[str]], set[str]]:
    """Walk ``start`` and the package modules it imports, transitively.

    Returns the forbidden imports found (module -> names) and every package
    module visited.
    """
    found: dict[str, set[str]] = {}
    visited: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in visited:
            continue
        path = _module_file(package_dir, package, module)
        if path is None:
            continue
        visited.add(module)
        for name in imported_names(path, module):
            if name.split(".")[0] in forbidden:
                found.setdefault(module, set()).add(name)
            if _module_file(package_dir, package, name) is not None:
                todo.append(name)
    return found, visited


@pytest.mark.parametrize("module", SANS_IO_MODULES)
def test_sans_io_modules_import_no_io(module: str) -> None:
    found, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, module)
    assert module in visited, f"{module} was not found under {PACKAGE_DIR}"
    assert found == {}, f"I/O imports reachable from {module}: {found}"


def test_protocol_walk_follows_errors() -> None:
    """The transitive walk really reaches the streamq modules protocol imports."""
    _, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, "streamq.protocol")
    assert visited == {"streamq.protocol", "streamq.errors", "streamq.filters"}


def test_io_modules_are_detected() -> None:
    """The checker flags what it should, so a green run means something."""
    found, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, "streamq.producer")
    assert "asyncio" in found["streamq.server"]
    # reached through producer -> engines -> the SQLite engine's storage
    assert "aiosqlite" in found["streamq.engines.sqlite.storage"]
    assert {
        "streamq.server",
        "streamq.log",
        "streamq.engines.sqlite.storage",
        "streamq.protocol",
    } <= visited


def test_checker_on_a_synthetic_package(tmp_path: Path) -> None:
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import asyncio\n")  # the facade: never followed
    (pkg / "a.py").write_text("from .b import helper\nfrom . import c\nimport json\n")
    (pkg / "b.py").write_text(
        textwrap.dedent(
            """
            def helper():
                import asyncio.events
                from socket import socketpair
                return socketpair
            """
        )
    )
    (pkg / "c.py").write_text("from .sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import e\n")
    (pkg / "sub" / "d.py").write_text("import threading as t\n__import__('sqlite3')\n")
    (pkg / "e.py").write_text(
        "import importlib\nimportlib.import_module('selectors')\nfrom aiosqlite import connect\n"
    )
    found, visited = forbidden_imports(pkg, "fake", "fake.a")
    assert visited == {"fake.a", "fake.b", "fake.c", "fake.sub", "fake.sub.d", "fake.e"}
    assert found == {
        "fake.b": {"asyncio.events", "socket", "socket.socketpair"},
        "fake.sub.d": {"threading", "sqlite3"},
        "fake.e": {"selectors", "aiosqlite", "aiosqlite.connect"},
    }


def test_importing_protocol_loads_no_io_module() -> None:
    """At runtime too: a fresh interpreter imports protocol and loads none of them."""
    code = textwrap.dedent(
        f"""
        import importlib, json, sys, types
        before = set(sys.modules)
        package = types.ModuleType({PACKAGE!r})
        package.__path__ = [{str(PACKAGE_DIR)!r}]
        sys.modules[{PACKAGE!r}] = package  # skip the facade __init__
        for name in {list(SANS_IO_MODULES)!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(set(sys.modules) - before)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(result.stdout))
    assert set(SANS_IO_MODULES) <= loaded
    assert {name for name in loaded if name.split(".")[0] in FORBIDDEN} == set()


ENGINE_PACKAGES = ("streamq.engines.sqlite", "streamq.engines.postgres")


def engine_reaches(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Modules outside ``<package>.engines`` that import an engine's package directly
    (module -> the names): the engine must be chosen in one place, ``engines``."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir).with_suffix("")
        parts = [package, *relative.parts]
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        if module.startswith(f"{package}.engines"):
            continue
        names = {
            name
            for name in imported_names(path, module)
            if any(name == p or name.startswith(p + ".") for p in ENGINE_PACKAGES)
        }
        if names:
            found[module] = names
    return found


def test_the_engine_is_chosen_in_one_place() -> None:
    """Only ``streamq.engines`` (``for_target``, ``for_connection``) reaches into an
    engine's package; the rest of streamq talks to the ``Engine`` it returns."""
    assert engine_reaches(PACKAGE_DIR, PACKAGE) == {}


def test_engine_reaches_are_detected(tmp_path: Path) -> None:
    """The check flags a direct import, so a green run means something."""
    pkg = tmp_path / "streamq"
    (pkg / "engines" / "sqlite").mkdir(parents=True)
    (pkg / "engines" / "__init__.py").write_text("from .sqlite import storage\n")
    (pkg / "engines" / "sqlite" / "__init__.py").write_text("")
    (pkg / "producer.py").write_text("from .engines import for_target\n")
    (pkg / "cli.py").write_text("def f():\n    from .engines.sqlite import storage\n")
    assert engine_reaches(pkg, "streamq") == {
        "streamq.cli": {"streamq.engines.sqlite", "streamq.engines.sqlite.storage"}
    }

"""The sans-IO layer stays sans-IO: ``protocol`` and ``errors`` import no I/O module.

Checked twice: statically, by parsing the source of each module and of every
streamq module it imports (transitively); and at runtime, by importing
``streamq.protocol`` in a fresh interpreter without running the package's
``__init__`` (the public facade, which imports each module at first use).
``streamq.protocol`` is a package: every module in it is checked, whether its
``__init__`` imports it or not.
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
SANS_IO_MODULES = (
    "streamq.protocol",
    "streamq.errors",
    "streamq.filters",
    "streamq.consumer.resharing",
)
PROTOCOL_MODULES = {
    "streamq.protocol",
    "streamq.protocol.events",
    "streamq.protocol.codec",
    "streamq.protocol.state",
    "streamq.protocol.columnar",  # and its C decoder, columnar_c, which imports nothing
}


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


def package_modules(package_dir: Path, package: str, name: str) -> list[str]:
    """``name`` and, if it is a package, every module in it, subpackages included: a
    module its ``__init__`` does not import is out of the walk from ``name``, and is
    checked all the same."""
    path = _module_file(package_dir, package, name)
    if path is None or path.name != "__init__.py":
        return [name]
    modules = [name]
    for file in sorted(path.parent.rglob("*.py")):
        parts = list(file.relative_to(path.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            modules.append(".".join([name, *parts]))
    return modules


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


SANS_IO_CHECKED = [
    m for name in SANS_IO_MODULES for m in package_modules(PACKAGE_DIR, PACKAGE, name)
]


@pytest.mark.parametrize("module", SANS_IO_CHECKED)
def test_sans_io_modules_import_no_io(module: str) -> None:
    found, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, module)
    assert module in visited, f"{module} was not found under {PACKAGE_DIR}"
    assert found == {}, f"I/O imports reachable from {module}: {found}"


def test_protocol_walk_follows_errors() -> None:
    """The transitive walk really reaches the streamq modules protocol imports: the
    package's own modules through its ``__init__``'s relative imports, and beyond."""
    _, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, "streamq.protocol")
    assert visited == PROTOCOL_MODULES | {"streamq.errors", "streamq.filters"}


def test_every_protocol_module_is_checked() -> None:
    """Each module of the package is on the list the checks run over, whether its
    ``__init__`` imports it or not (``package_modules``, tried on a synthetic package)."""
    assert set(SANS_IO_CHECKED) >= PROTOCOL_MODULES


def test_io_modules_are_detected() -> None:
    """The checker flags what it should, so a green run means something."""
    found, visited = forbidden_imports(PACKAGE_DIR, PACKAGE, "streamq.producer.producer")
    assert "asyncio" in found["streamq.producer.server"]
    # reached through producer -> engines -> the SQLite engine's storage
    assert "aiosqlite" in found["streamq.engines.sqlite.storage"]
    assert {
        "streamq.producer.server",
        "streamq.producer.committed_log",
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


def test_checker_on_a_synthetic_sans_io_package(tmp_path: Path) -> None:
    """A package checked as one: the walk follows its ``__init__``'s relative imports
    into its modules, and a module it does not import is still listed for checking."""
    proto = tmp_path / "fake" / "proto"
    proto.mkdir(parents=True)
    (tmp_path / "fake" / "__init__.py").write_text("import asyncio\n")
    (proto / "__init__.py").write_text("from .state import Conn\n")
    (proto / "state.py").write_text("from .codec import encode\nfrom ..errors import Bad\n")
    (proto / "codec.py").write_text("import json\n")
    (tmp_path / "fake" / "errors.py").write_text("import socket\n")
    (proto / "loose.py").write_text("import selectors\n")  # imported by no one
    package_dir = tmp_path / "fake"
    found, visited = forbidden_imports(package_dir, "fake", "fake.proto")
    assert visited == {"fake.proto", "fake.proto.state", "fake.proto.codec", "fake.errors"}
    assert found == {"fake.errors": {"socket"}}
    modules = set(package_modules(package_dir, "fake", "fake.proto"))
    assert modules == {"fake.proto", "fake.proto.codec", "fake.proto.loose", "fake.proto.state"}
    assert forbidden_imports(package_dir, "fake", "fake.proto.loose")[0] == {
        "fake.proto.loose": {"selectors"}
    }
    assert package_modules(package_dir, "fake", "fake.errors") == ["fake.errors"]


def test_importing_protocol_loads_no_io_module() -> None:
    """At runtime too: a fresh interpreter imports protocol and loads none of them."""
    code = textwrap.dedent(
        f"""
        import importlib, json, sys, types
        before = set(sys.modules)
        package = types.ModuleType({PACKAGE!r})
        package.__path__ = [{str(PACKAGE_DIR)!r}]
        sys.modules[{PACKAGE!r}] = package  # skip the facade __init__
        for name in {SANS_IO_CHECKED!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(set(sys.modules) - before)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(result.stdout))
    assert set(SANS_IO_CHECKED) <= loaded
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


# --- no import loops, no reaching into another module's privates ------------------------


def _modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_cycles(package_dir: Path, package: str) -> list[list[str]]:
    """The package's import loops: each strongly connected group of modules (more than
    one) in the graph of every import anywhere in a file, under ``TYPE_CHECKING`` and
    inside functions too (a lazy import is coupling all the same)."""
    modules = _modules(package_dir, package)
    graph = {
        module: sorted(name for name in imported_names(path, module) if name in modules)
        for module, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while (member := stack.pop()) != module:
                group.append(member)
            if group:
                cycles.append(sorted([module, *group]))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def _within_one_engine(cycle: list[str]) -> bool:
    return any(all(m == p or m.startswith(p + ".") for m in cycle) for p in ENGINE_PACKAGES)


def test_no_import_loop_but_within_one_engine_package() -> None:
    """Modules import downwards: the features take the writing core, not the producer;
    the consumer's parts take the turn, not the consumer. Only an engine's own modules
    (its storage, append and numbering) may import each other both ways."""
    cycles = import_cycles(PACKAGE_DIR, PACKAGE)
    assert [cycle for cycle in cycles if not _within_one_engine(cycle)] == []


def test_import_loops_are_detected(tmp_path: Path) -> None:
    pkg = tmp_path / "streamq"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "producer.py").write_text("from .retention import Passes\n")
    (pkg / "retention.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .producer import Producer\n"
    )
    (pkg / "log.py").write_text("def f():\n    from . import records\n")
    (pkg / "records.py").write_text("from .log import Log\n")
    (pkg / "errors.py").write_text("from .records import x\n")
    assert sorted(import_cycles(pkg, "streamq")) == [
        ["streamq.log", "streamq.records"],
        ["streamq.producer", "streamq.retention"],
    ]


# Private names reached across modules on purpose, each with why.
ALLOWED_PRIVATE = {
    # A named tuple's own API: its methods start with "_" not to clash with fields.
    "_asdict": "namedtuple API",
    "_replace": "namedtuple API",
    "_make": "namedtuple API",
    # aiosqlite gives no public way to its sqlite3 connection or its thread: a whole
    # transaction runs there in one hop (blocking.run_on_thread).
    "_conn": "aiosqlite.Connection's sqlite3 connection",
    "_thread": "aiosqlite.Connection's thread",
    "_execute": "aiosqlite.Connection's call on its thread",
    # argparse's type of add_subparsers()' result, which has no public name.
    "_SubParsersAction": "argparse's subcommands action, as a type",
}


def private_reaches(package_dir: Path, package: str) -> dict[str, set[str]]:
    """module -> the private names (one leading underscore) it reaches in other
    modules: ``obj._name`` where ``obj`` is not ``self``/``cls`` and the module defines
    no ``_name`` itself, and ``from x import _name`` of a name (not of a private module
    such as ``_loop``)."""
    modules = _modules(package_dir, package)
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
        reached = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    reached.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.level or node.module == package):
                base = node.module or ""
                for alias in node.names:
                    submodule = any(m.endswith(f".{alias.name}") for m in modules)
                    if _private(alias.name) and not submodule:
                        reached.add(f"{base}.{alias.name}")
        reached -= ALLOWED_PRIVATE.keys()
        if reached:
            found[module] = reached
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reaches_another_modules_privates() -> None:
    """A module's private names are its own: what others need is named publicly (the
    writing core's steps, the consumer's turn), so a change behind an underscore stays
    behind it."""
    assert private_reaches(PACKAGE_DIR, PACKAGE) == {}


def test_private_reaches_are_detected(tmp_path: Path) -> None:
    pkg = tmp_path / "streamq"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_loop.py").write_text("")
    (pkg / "producer.py").write_text(
        "class P:\n    def __init__(self):\n        self._lock = 1\n"
        "    def f(self, other):\n        return other._lock, self._x\n"
    )
    (pkg / "groups.py").write_text(
        "from . import _loop\nfrom .producer import _helper\n"
        "def f(p):\n    return p._writer, p._asdict(), p.public\n"
    )
    assert private_reaches(pkg, "streamq") == {"streamq.groups": {"_writer", "producer._helper"}}


def importers(package_dir: Path, package: str, target: str) -> set[str]:
    """The modules that import ``target`` (anywhere in the file)."""
    return {
        module
        for module, path in _modules(package_dir, package).items()
        if target in imported_names(path, module)
    }


def test_only_the_facades_import_the_producer() -> None:
    """Retention, compaction, group commit, transactions, the watcher and metrics take
    the writing core (``writing.Writing``) or a small protocol, not the ``Producer``:
    it is imported by the facades alone (the package, ``SyncProducer``, the CLI and its
    demo)."""
    assert importers(PACKAGE_DIR, PACKAGE, "streamq.producer.producer") == {
        "streamq",
        "streamq.sync",
        "streamq.cli",
        "streamq.demo",
    }


def test_the_facade_lists_each_public_name_once_where_it_lives() -> None:
    """``streamq/__init__.py`` imports its names for type checkers only and finds them at
    first use in ``_MODULES``: both must say the same, and every name must be found."""
    import streamq

    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            imported.update((alias.name, node.module) for alias in node.names)
    assert imported == streamq._HOMES
    assert sorted(streamq.__all__) == sorted(imported)
    assert all(getattr(streamq, name) is not None for name in streamq.__all__)


def test_the_spark_source_loads_no_producer_consumer_or_metrics() -> None:
    """Spark starts a Python process for every streaming query (its source's runner):
    importing the source must not load the producer's or consumer's side of streamq."""
    code = textwrap.dedent(
        """
        import json, sys
        import spark_source.datasource
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("streamq"))))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "streamq.wire.client" in loaded
    sides = ("streamq.producer.", "streamq.consumer.", "streamq.groups.", "streamq.engines")
    unwanted = {m for m in loaded if m.startswith(sides) or m == "streamq.metrics"}
    assert not unwanted, unwanted


# --- the packages: who may import whom ---------------------------------------------------

# The modules at the top that every part shares: the vocabulary (errors, records, filters,
# captured changes), the application's SQL handles, consumers' metrics and their endpoint.
SHARED = frozenset(
    {"errors", "records", "filters", "captured", "sql", "metrics", "_loop", "native"}
)
# The facades: the package itself, the blocking producer, the command line and the demo.
FACADES = frozenset({"", "__main__", "sync", "cli", "demo"})
# What each part may import from the others (its own modules aside). "shared" is SHARED.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "shared": frozenset({"shared", "protocol"}),
    "protocol": frozenset({"errors", "filters"}),
    "wire": frozenset({"shared", "protocol"}),
    "engines": frozenset({"shared", "protocol"}),
    "producer": frozenset({"shared", "protocol", "wire", "engines"}),
    "consumer": frozenset({"shared", "protocol", "wire", "engines"}),
    "groups": frozenset({"shared", "protocol", "wire", "engines", "consumer"}),
    # The web console reads producers through the wire, consumer databases as the CLI does.
    "console": frozenset({"shared", "protocol", "wire", "consumer", "groups"}),
}
# The interfaces the engines implement, and the types those interfaces speak: the only
# modules of the producer's side, the consumer's and groups that an engine imports.
ENGINE_INTERFACES = {
    "producer.storage": "the producer's storage interface",
    "producer.append_rule": "which rows an append adds, the same on every engine",
    "consumer.position_store": "the consumer's position-store interface",
    "consumer.batch": "what a position store saves a position for",
    "consumer.resharing": "the moves a position store makes when shares change",
    "groups.membership": "the leases a lease table holds",
}


def part_of(module: str) -> str:
    """Which part of the package ``module`` is: a package's name, "shared", or "facade"."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in FACADES:
        return "facade"
    if parts[0] in SHARED:
        return "shared"
    return parts[0]


def layering_breaches(package_dir: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of other parts it imports and may not (``MAY_IMPORT``, the
    engines' ``ENGINE_INTERFACES``); a facade may import anything, and a part's modules each
    other. A package's bare name counts as its ``__init__``."""
    modules = _modules(package_dir, package)
    breaches: dict[str, set[str]] = {}
    for module, path in modules.items():
        part = part_of(module)
        if part == "facade":
            continue
        allowed = MAY_IMPORT.get(part, frozenset())
        for name in imported_names(path, module):
            if name not in modules or name == package:
                continue
            other = part_of(name)
            if other == part:
                continue
            inner = name.removeprefix(f"{package}.")
            if other == "shared" and "shared" in allowed:
                continue
            if other in allowed or inner in allowed:
                continue
            if part == "engines" and inner in ENGINE_INTERFACES:
                continue
            breaches.setdefault(module, set()).add(name)
    return breaches


def test_each_part_imports_only_what_it_may() -> None:
    """The consumer's side never imports the producer's, nor the reverse; groups build on
    the consumer; the wire and protocol know neither side; engines import only the
    interfaces they implement; the facades alone import across."""
    assert layering_breaches(PACKAGE_DIR, PACKAGE) == {}


def test_every_module_belongs_to_a_known_part() -> None:
    """A new package or a new module at the top is placed on purpose: added to
    ``MAY_IMPORT``, ``SHARED`` or ``FACADES`` with what it may import."""
    parts = {part_of(module) for module in _modules(PACKAGE_DIR, PACKAGE)}
    assert parts <= {"facade", *MAY_IMPORT}, parts - {"facade", *MAY_IMPORT}


def test_package_inits_import_nothing_of_streamq() -> None:
    """Importing ``streamq.producer.storage`` (an engine's interface) must not load the
    producer: each side's ``__init__`` holds its docstring and nothing to import."""
    for name in ("producer", "consumer", "groups", "wire", "console"):
        init = PACKAGE_DIR / name / "__init__.py"
        assert imported_names(init, f"{PACKAGE}.{name}") == set(), name
        assert ast.get_docstring(ast.parse(init.read_text())), f"{name} says what it owns"


def test_layering_breaches_are_detected(tmp_path: Path) -> None:
    """Each rule flags its breach, so a green run means something."""
    pkg = tmp_path / "streamq"
    for name in ("producer", "consumer", "groups", "wire", "engines", "protocol"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .producer import producer\n")  # a facade
    (pkg / "errors.py").write_text("")
    (pkg / "producer" / "storage.py").write_text("from ..errors import E\n")
    (pkg / "producer" / "producer.py").write_text(
        "from .storage import S\nfrom ..consumer import turn\n"
    )
    (pkg / "consumer" / "turn.py").write_text(
        "def f():\n    from ..producer.producer import Producer\n"
    )
    (pkg / "groups" / "member.py").write_text("from ..consumer.turn import T\n")
    (pkg / "wire" / "client.py").write_text("from ..engines import base\n")
    (pkg / "protocol" / "codec.py").write_text("from ..wire.client import C\n")
    (pkg / "engines" / "base.py").write_text(
        "from ..producer.storage import S\nfrom ..producer.producer import P\n"
    )
    assert layering_breaches(pkg, "streamq") == {
        "streamq.producer.producer": {"streamq.consumer", "streamq.consumer.turn"},
        "streamq.consumer.turn": {"streamq.producer.producer"},
        "streamq.wire.client": {"streamq.engines", "streamq.engines.base"},
        "streamq.protocol.codec": {"streamq.wire.client"},
        "streamq.engines.base": {"streamq.producer.producer"},
    }


def test_every_public_name_still_imports() -> None:
    """The public API does not move with the modules: ``streamq.X``, ``streamq.sync.X``,
    and the command line's entry point, in a fresh interpreter."""
    code = textwrap.dedent(
        """
        import streamq, streamq.sync, streamq.cli
        missing = [n for n in streamq.__all__ if getattr(streamq, n, None) is None]
        missing += [n for n in streamq.sync.__all__ if getattr(streamq.sync, n, None) is None]
        assert callable(streamq.cli.main)
        print(len(streamq.__all__), missing)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    count, missing = done.stdout.split(" ", 1)
    assert int(count) >= 70 and missing.strip() == "[]", done.stdout

"""Which path runs: streamq's hot modules compiled to native code, or pure Python.

``setup.py`` compiles the modules of ``COMPILED`` with mypyc where a C compiler is found
(``pip install``, ``make``), from the same typed sources, and writes ``native.json``
beside this file: the hash of each compiled module's source. Without a compiler, or
where the build fails, the package installs and runs as pure Python, and its
``native.json`` says why. ``build`` decides once per process, at ``import streamq``:

- ``STREAMQ_PURE=1``: pure Python, as asked;
- a pure-Python build: pure Python, and the build's reason;
- no compiled build (a checkout never built): pure Python;
- a build older than its sources (a checkout edited since ``make``): pure Python, said
  once, so that an edit is never shadowed by a stale build;
- otherwise the compiled modules.

A finder first on ``sys.meta_path`` loads streamq's other modules (all of them, for pure
Python) from their ``.py`` files. It is all or none: mypyc links the compiled modules to
each other, so one of them from source beside the others compiled would mix two versions
of the code.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

# The modules built as native code: those that measured faster compiled
# (``python -m bench.tools.builds``; docs/reference/design.md, "The compiled path").
COMPILED = (
    # Capture: every WAL message parsed (byte parsing in Python, 2.45x compiled), and the
    # change records built from them (1.52x, the two together).
    "streamq.engines.postgres.pgoutput",
    "streamq.engines.postgres.changes",
)
# Written in C, where no Python compiled by mypyc comes near (docs/reference/design.md):
# each module and its source, built beside the modules above, all or none with them.
C_EXTENSIONS = {
    # RECORDS into Arrow's column buffers for the Spark source's executors (about 10x
    # msgpack and pyarrow's builders; streamq.protocol.columnar).
    "streamq.protocol.columnar_c": "protocol/columnar_c.c",
    # A bulk publish's records encoded as stored (about 10x msgpack's packer per record;
    # streamq.protocol.codec.encode_values).
    "streamq.protocol.records_c": "protocol/records_c.c",
}
# beside this file: {"compiler": ..., "modules": {name: sha256}}, or {"pure": why}
MANIFEST = "native.json"
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Build:
    """The path a process runs: ``compiled`` or not, and why, for people."""

    compiled: bool
    why: str
    stale: bool = False  # a build older than its sources: said once in the log

    def describe(self) -> str:
        return ("compiled" if self.compiled else "pure Python") + f" ({self.why})"


def source_of(module: str, package_dir: Path = PACKAGE_DIR) -> Path:
    """The source of ``module`` (``streamq.protocol.codec``): its ``.py`` file, or its C
    file for one of ``C_EXTENSIONS``."""
    if module in C_EXTENSIONS:
        return package_dir / C_EXTENSIONS[module]
    return package_dir.joinpath(*module.split(".")[1:]).with_suffix(".py")


NATIVE_MODULES = (*COMPILED, *C_EXTENSIONS)  # every module a compiled build has


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def built(module: str, package_dir: Path = PACKAGE_DIR) -> bool:
    """An extension module of ``module`` is installed beside its source."""
    source = source_of(module, package_dir)
    stem = source.with_suffix("")
    return any(
        stem.with_name(stem.name + s).is_file() for s in importlib.machinery.EXTENSION_SUFFIXES
    )


def check(environ: Mapping[str, str], package_dir: Path = PACKAGE_DIR) -> Build:
    """Which path a process with ``environ`` runs from ``package_dir``, and why."""
    if environ.get("STREAMQ_PURE", "") not in ("", "0"):
        return Build(False, "STREAMQ_PURE is set")
    manifest = package_dir / MANIFEST
    if not manifest.is_file():
        return Build(False, "no compiled build: not built (make native, or pip install)")
    try:
        recorded: dict[str, Any] = json.loads(manifest.read_text())
        if "pure" in recorded:  # setup.py's reason, as it said it
            return Build(False, f"built without the compiled path: {recorded['pure']}")
        hashes: dict[str, str] = recorded["modules"]
        compiler = str(recorded["compiler"])
    except (OSError, ValueError, KeyError, TypeError):
        return Build(False, f"{manifest.name} is unreadable: rebuild (make, or pip install)")
    if not all(built(m, package_dir) for m in NATIVE_MODULES):
        return Build(False, "no compiled build: its extension modules are missing (rebuild)")
    for module in NATIVE_MODULES:
        if hashes.get(module) != digest(source_of(module, package_dir)):
            return Build(
                False,
                f"the compiled build is older than {module}'s source: rebuild (make, or "
                "pip install) to run the compiled path",
                stale=True,
            )
    return Build(True, f"{compiler}, {len(COMPILED)} modules, and {len(C_EXTENSIONS)} in C")


class _SourceFinder:
    """Finds streamq's modules as ``.py`` files, but those of ``compiled`` (left to the
    default finders, which take an extension module first): an extension module left
    from another build, of a module no longer compiled, is never loaded, nor a C
    extension on pure Python (its importer falls back: ``protocol.columnar``)."""

    def __init__(self, compiled: frozenset[str]) -> None:
        self.compiled = compiled
        self._finders: dict[str, importlib.machinery.FileFinder] = {}  # by folder

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if not fullname.startswith("streamq.") or not path or fullname in self.compiled:
            return None
        if fullname in C_EXTENSIONS:  # compiled code with no Python of its own: not loaded
            raise ModuleNotFoundError(f"{fullname}: this process runs pure Python", name=fullname)
        for entry in path:
            finder = self._finders.get(entry)
            if finder is None:
                sources = (
                    importlib.machinery.SourceFileLoader,
                    importlib.machinery.SOURCE_SUFFIXES,
                )
                finder = self._finders[entry] = importlib.machinery.FileFinder(entry, sources)
            spec = finder.find_spec(fullname)
            if spec is not None:
                return spec
        return None


_chosen: Build | None = None


def build() -> Build:
    """The path this process runs, decided at the first call: the compiled modules, or
    the finder that keeps them out. ``streamq/__init__.py`` calls it before importing
    any other module of streamq; ``streamq --version`` and ``streamq status`` say it."""
    global _chosen
    if _chosen is None:
        _chosen = check(os.environ)
        if not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
            compiled = frozenset(NATIVE_MODULES if _chosen.compiled else ())
            sys.meta_path.insert(0, _SourceFinder(compiled))
        if _chosen.stale:
            logging.getLogger("streamq").warning("streamq runs pure Python: %s", _chosen.why)
    return _chosen

"""Which path runs (``streamq/native.py``): the compiled modules only when their build
is there and current, pure Python otherwise, said the same by ``--version`` and status.

``check`` is tried on synthetic package folders (a build, none, a stale one, a broken
manifest); the finder and the command line in fresh interpreters of this checkout.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import streamq
from streamq import native

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def fake_build(package: Path, *, sources: bool = True, extensions: bool = True) -> None:
    """A package folder with ``native.NATIVE_MODULES``' sources, extension files beside them
    (empty: ``check`` never loads them) and the manifest of a build of those sources."""
    hashes = {}
    for module in native.NATIVE_MODULES:
        source = native.source_of(module, package)
        source.parent.mkdir(parents=True, exist_ok=True)
        if sources:
            source.write_text(f"# {module}\n")
        if extensions:
            source.with_suffix(SUFFIX).write_bytes(b"")
        hashes[module] = native.digest(source)
    (package / native.MANIFEST).write_text(json.dumps({"compiler": "mypyc 9", "modules": hashes}))


def test_a_current_build_runs_compiled(tmp_path: Path) -> None:
    fake_build(tmp_path)
    build = native.check({}, tmp_path)
    assert build.compiled
    assert build.describe() == (
        f"compiled (mypyc 9, {len(native.COMPILED)} modules, and {len(native.C_EXTENSIONS)} in C)"
    )


def test_streamq_pure_runs_pure_python_over_a_build(tmp_path: Path) -> None:
    fake_build(tmp_path)
    assert native.check({"STREAMQ_PURE": "1"}, tmp_path).describe() == (
        "pure Python (STREAMQ_PURE is set)"
    )
    assert native.check({"STREAMQ_PURE": "0"}, tmp_path).compiled


def test_no_build_runs_pure_python(tmp_path: Path) -> None:
    fake_build(tmp_path, extensions=False)
    assert "no compiled build" in native.check({}, tmp_path).why
    (tmp_path / native.MANIFEST).unlink()
    assert "no compiled build" in native.check({}, tmp_path).why


def test_a_build_that_did_not_compile_says_why(tmp_path: Path) -> None:
    """setup.py's reason, never a guess: a build fails for more than a missing compiler."""
    fake_build(tmp_path, extensions=False)
    why = "mypyc could not compile streamq/x.py: streamq/x.py:1: error: Name 'y' is not defined"
    (tmp_path / native.MANIFEST).write_text(json.dumps({"pure": why}))
    build = native.check({}, tmp_path)
    assert build.describe() == f"pure Python (built without the compiled path: {why})"


def test_an_edited_source_runs_pure_python_and_names_it(tmp_path: Path) -> None:
    """A checkout edited after its build: the edit runs, never the stale build."""
    fake_build(tmp_path)
    edited = native.COMPILED[-1]
    native.source_of(edited, tmp_path).write_text("# edited\n")
    build = native.check({}, tmp_path)
    assert not build.compiled
    assert f"older than {edited}'s source" in build.why


def test_an_unreadable_manifest_runs_pure_python(tmp_path: Path) -> None:
    fake_build(tmp_path)
    (tmp_path / native.MANIFEST).write_text("{not json")
    assert "unreadable" in native.check({}, tmp_path).why


def _run(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


LOADED_FROM = """
import streamq, streamq.native as n, importlib, sys
import streamq.protocol.columnar  # loads the C decoder on the compiled path only
files = {m: importlib.import_module(m).__file__ for m in n.COMPILED}
c = all(m in sys.modules for m in n.C_EXTENSIONS)
print(n.build().compiled, c, sorted({f.rsplit(".", 1)[-1] for f in files.values()}))
"""


def test_streamq_pure_loads_every_module_from_its_source() -> None:
    assert _run(LOADED_FROM, STREAMQ_PURE="1") == "False False ['py']"


def test_the_modules_load_as_the_build_says() -> None:
    """Compiled: every listed module from its extension, and the C extensions; else each
    from its source, and no C extension."""
    compiled, c_extensions, suffixes = _run(LOADED_FROM, STREAMQ_PURE="").split(" ", 2)
    assert c_extensions == compiled
    assert suffixes == ("['so']" if compiled == "True" else "['py']")


def test_version_says_which_path_runs() -> None:
    for pure in ("1", ""):
        out = _run("import streamq.cli; streamq.cli.main(['--version'])", STREAMQ_PURE=pure)
        build = _run("import streamq.native as n; print(n.build().describe())", STREAMQ_PURE=pure)
        assert out == f"streamq {streamq.__version__}, {build}"


@pytest.mark.parametrize("pure", ["1", ""])
def test_status_says_which_path_runs(pure: str, tmp_path: Path) -> None:
    """``streamq status`` asks a real producer process, which says its own path."""
    code = f"""
import asyncio, streamq
from streamq.wire.client import Client
def ask(address):
    with Client(address) as client:
        return client.status()
async def main():
    async with streamq.Producer({str(tmp_path / "p.db")!r}) as producer:
        print((await asyncio.to_thread(ask, producer.address))["build"])
asyncio.run(main())
"""
    build = _run("import streamq.native as n; print(n.build().describe())", STREAMQ_PURE=pure)
    assert _run(code, STREAMQ_PURE=pure) == build

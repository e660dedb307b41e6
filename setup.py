"""Builds streamq with its hot modules compiled by mypyc (``streamq/native.py`` lists
them), from the same typed sources the pure-Python path runs, and its C extensions.

Where no C compiler is found, or mypyc cannot build them, or ``STREAMQ_PURE=1`` is set
at build time, the package installs as pure Python and says why in one line. A
successful build writes ``streamq/native.json``: each compiled module's source hash, by
which ``streamq.native`` knows the build is current.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _native() -> dict[str, Any]:
    """``streamq/native.py``'s names, read without importing streamq."""
    namespace: dict[str, Any] = {"__file__": str(ROOT / "streamq" / "native.py")}
    exec(compile((ROOT / "streamq" / "native.py").read_text(), "native.py", "exec"), namespace)
    return namespace


NATIVE = _native()
SOURCES = {m: NATIVE["source_of"](m, ROOT / "streamq") for m in NATIVE["NATIVE_MODULES"]}


def _say(why: str) -> None:
    print(f"streamq: installing the pure-Python path only: {why}", flush=True)


def _extensions() -> list[Any]:
    if os.environ.get("STREAMQ_PURE", "") not in ("", "0"):
        _say("STREAMQ_PURE is set")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _say("mypyc (part of mypy) is not installed")
        return []
    sources = [str(SOURCES[m].relative_to(ROOT)) for m in NATIVE["COMPILED"]]
    c_extensions = [
        Extension(m, [str(SOURCES[m].relative_to(ROOT))], extra_compile_args=["-O3"])
        for m in NATIVE["C_EXTENSIONS"]
    ]
    try:
        # Types of what is not installed at build time (msgpack, aiosqlite, psycopg in an
        # isolated build) are taken as Any: the code compiles all the same.
        options = ["--ignore-missing-imports", *sources]
        compiled = mypycify(options, opt_level="3", group_name="streamq._compiled")
        return [*compiled, *c_extensions]
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        _say(f"mypyc could not compile {', '.join(sources)}: {exc}")
        return []


class OptionalBuildExt(build_ext):
    """Builds the compiled path if it can; otherwise leaves the pure-Python package whole.
    Writes the manifest only after every extension is built."""

    def run(self) -> None:
        # What an earlier build left (a module no longer compiled, a manifest of other
        # sources) would be installed with this one: gone first, in place and in build/.
        for base in {Path(self.build_lib), *([ROOT] if self.inplace else [])}:
            stale = [*base.glob("*.so"), *(base / "streamq").rglob("*.so")]
            for old in [*stale, base / "streamq" / NATIVE["MANIFEST"]]:
                old.unlink(missing_ok=True)
        try:
            super().run()
        except Exception as exc:  # no compiler, a missing header: pure Python it is
            _say(f"the C extension did not build ({exc})")
            return
        if not self.extensions:
            return
        import mypy.version

        manifest = {
            "compiler": f"mypyc {mypy.version.__version__}",
            "modules": {m: NATIVE["digest"](path) for m, path in SOURCES.items()},
        }
        text = json.dumps(manifest, indent=1) + "\n"
        targets = {Path(self.build_lib) / "streamq"}
        if self.inplace:
            targets.add(ROOT / "streamq")
        for target in targets:
            target.mkdir(parents=True, exist_ok=True)
            (target / NATIVE["MANIFEST"]).write_text(text)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})

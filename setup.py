"""Builds streamq with its hot modules compiled by mypyc (``streamq/native.py`` lists
them), from the same typed sources the pure-Python path runs, and its C extensions.

Where no C compiler is found, or mypyc cannot build them, or ``STREAMQ_PURE=1`` is set
at build time, the package installs as pure Python and says why in one line. A build
writes ``streamq/native.json``: each compiled module's source hash, by which
``streamq.native`` knows the build is current, or why it is pure Python (pip shows a
build's output only with ``-v``; ``streamq --version`` says it too).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _native() -> dict[str, Any]:
    """``streamq/native.py``'s names, read without importing streamq."""
    namespace: dict[str, Any] = {"__file__": str(ROOT / "streamq" / "native.py")}
    exec(compile((ROOT / "streamq" / "native.py").read_text(), "native.py", "exec"), namespace)
    return namespace


NATIVE = _native()
SOURCES = {m: NATIVE["source_of"](m, ROOT / "streamq") for m in NATIVE["NATIVE_MODULES"]}


# The type check mypyc needs to compile, not the project's (``make typecheck``): no config
# file, as pyproject's [tool.mypy] is strict, and in an isolated build (pip, build,
# cibuildwheel) the dependencies are not installed, so their types are Any, and strict
# refuses a class over prometheus_client's Collector ("subclassing Any") and a value of
# theirs returned. Errors in the modules not compiled are not the build's either.
MYPYC_OPTIONS = ["--config-file=", "--ignore-missing-imports", "--follow-imports=silent"]


def _say(why: str) -> str:
    print(f"streamq: installing the pure-Python path only: {why}", flush=True)
    return why


def _cause(output: str, exc: BaseException) -> str:
    """mypy's first error in ``output`` and how many followed it, or ``exc``'s message."""
    errors = [line for line in output.splitlines() if ": error: " in line]
    if not errors:
        return str(exc) or type(exc).__name__
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return errors[0] + more


def _extensions() -> tuple[list[Any], str | None]:
    """The extension modules to build, or none and why."""
    if os.environ.get("STREAMQ_PURE", "") not in ("", "0"):
        return [], _say("STREAMQ_PURE was set at build time")
    try:
        from mypyc.build import mypycify
    except ImportError:
        return [], _say("mypyc (part of mypy) is not installed")
    sources = [str(SOURCES[m].relative_to(ROOT)) for m in NATIVE["COMPILED"]]
    c_extensions = [
        Extension(m, [str(SOURCES[m].relative_to(ROOT))], extra_compile_args=["-O3"])
        for m in NATIVE["C_EXTENSIONS"]
    ]
    output = io.StringIO()  # mypyc prints its errors, then exits
    try:
        with contextlib.redirect_stdout(output):
            compiled = mypycify(
                [*MYPYC_OPTIONS, *sources], opt_level="3", group_name="streamq._compiled"
            )
    except (Exception, SystemExit) as exc:
        print(output.getvalue(), end="")
        cause = _cause(output.getvalue(), exc)
        return [], _say(f"mypyc could not compile {', '.join(sources)}: {cause}")
    print(output.getvalue(), end="")
    return [*compiled, *c_extensions], None


EXTENSIONS, PURE = _extensions()


def _clear(build_lib: Path, inplace: bool) -> None:
    """What an earlier build left (a module no longer compiled, a manifest of other
    sources, the reason it was pure) would be installed with this one: gone first, in
    ``build_lib`` and in place."""
    for base in {build_lib, *([ROOT] if inplace else [])}:
        stale = [*base.glob("*.so"), *(base / "streamq").rglob("*.so")]
        for old in [*stale, base / "streamq" / NATIVE["MANIFEST"]]:
            old.unlink(missing_ok=True)


def _write_manifest(targets: set[Path], manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=1) + "\n"
    for target in targets:
        target.mkdir(parents=True, exist_ok=True)
        (target / NATIVE["MANIFEST"]).write_text(text)


def _no_compiler(compiler: Any) -> str | None:
    """The C compiler's command, when it is not found."""
    command = getattr(compiler, "compiler_so", None)
    if command and shutil.which(command[0]) is None:
        return str(command[0])
    return None


class PureBuildPy(build_py):
    """A pure-Python build records why in its manifest, for ``streamq --version`` to say
    (not in place: ``make native`` builds again until it compiles)."""

    def run(self) -> None:
        super().run()
        if PURE is not None and not self.editable_mode:
            _clear(Path(self.build_lib), inplace=False)
            _write_manifest({Path(self.build_lib) / "streamq"}, {"pure": PURE})


class OptionalBuildExt(build_ext):
    """Builds the compiled path if it can; otherwise leaves the pure-Python package whole.
    Writes the manifest only after every extension is built."""

    def run(self) -> None:
        build_lib = Path(self.build_lib)
        _clear(build_lib, self.inplace)
        try:
            super().run()
        except Exception as exc:  # no compiler, a missing header: pure Python it is
            missing = _no_compiler(self.compiler)
            why = f"no C compiler ({missing} not found)" if missing else None
            why = _say(why or f"the C extensions did not build: {exc}")
            _clear(build_lib, self.inplace)  # those built before the failure
            _write_manifest({build_lib / "streamq"}, {"pure": why})
            return
        if not self.extensions:
            return
        import mypy.version

        manifest = {
            "compiler": f"mypyc {mypy.version.__version__}",
            "modules": {m: NATIVE["digest"](path) for m, path in SOURCES.items()},
        }
        _write_manifest(
            {build_lib / "streamq", *([ROOT / "streamq"] if self.inplace else [])}, manifest
        )


setup(ext_modules=EXTENSIONS, cmdclass={"build_py": PureBuildPy, "build_ext": OptionalBuildExt})

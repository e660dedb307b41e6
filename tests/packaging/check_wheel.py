"""``make wheel``: streamq built the ways its users and CI build it, each in pip's isolated
build environment (setuptools and mypy fetched from the package index, none of streamq's
dependencies), runs compiled on this machine (Linux x86_64):

- ``python -m build`` in a clean venv: the sdist, and the wheel built from it, which
  installed in another clean venv runs compiled, and publishes and consumes;
- ``pip install <checkout>`` in a clean venv: ``streamq --version`` says compiled;
- a build that cannot compile installs pure Python and says the real cause, in pip's
  output and in ``streamq --version``: no C compiler, or a type error in a compiled module.

Not collected by ``make test`` (its name is no ``test_*.py``): a few builds and venvs,
about two minutes.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from streamq import native

ROOT = Path(__file__).resolve().parents[2]
# Builds and runs as a user's: no checkout on the path, no path chosen
ENVIRON = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STREAMQ_PURE")}

ROUND_TRIP = textwrap.dedent(
    """
    import asyncio, sys, streamq, streamq.native
    from streamq.protocol import RecordColumns, codec, decode_message, encode_values, records_frame

    async def main(db: str, consumer_db: str) -> None:
        async with streamq.Producer(db) as producer:
            await producer.publish("orders", b"one")
            consumer = streamq.Consumer(producer.address, "orders", db=consumer_db, name="c")
            async with consumer as c:
                async with asyncio.timeout(30):
                    batch = await anext(c)
                async with c.transaction(batch):
                    pass
                body = records_frame(encode_values(1, 0, [b"one"]))[4:]
                frame = decode_message(body, raw_records=True, columnar=True)
                columnar = isinstance(frame, RecordColumns)  # the C decoder loaded
                native = columnar and codec.ENCODES_IN_C  # and the C encoder
                print([r.value for r in batch], native, streamq.native.build().describe())

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def run(
    *command: str | Path,
    timeout: float,
    cwd: Path | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[str, str]:
    """``command``'s output and errors, in ``ENVIRON`` and ``environ``; both in the
    failure when it fails."""
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env={**ENVIRON, **(environ or {})},
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-4000:]}{done.stderr}"
    return done.stdout, done.stderr


def clean_venv(path: Path, *install: str | Path) -> Path:
    """A new venv with ``install`` installed (from the package index): its bin folder."""
    venv.create(path, with_pip=True)
    if install:
        run(path / "bin" / "python", "-m", "pip", "install", "-q", *install, timeout=900)
    return path / "bin"


def round_trip(bindir: Path, tmp_path: Path) -> None:
    """The installed streamq, run from outside the checkout, publishes and consumes on the
    compiled path, its C extensions loaded."""
    out, _ = run(
        bindir / "python",
        "-c",
        ROUND_TRIP,
        tmp_path / "p.db",
        tmp_path / "c.db",
        cwd=tmp_path,  # not the checkout: the installed package, nothing else
        timeout=120,
    )
    values, c_extensions, build = out.strip().split(" ", 2)
    assert build.startswith("compiled (mypyc"), build
    assert c_extensions == "True"
    assert values == "[b'one']"


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with ``build``: its python. Not this checkout's venv: mypyc finds the
    building interpreter's packages (by sysconfig) from an isolated build too, and their
    types hid a build that compiled nowhere else."""
    return clean_venv(tmp_path_factory.mktemp("builder"), "build") / "python"


@pytest.fixture(scope="module")
def dist(builder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build`` of the checkout: the sdist, then the wheel built from the
    sdist, as a user without a wheel for their platform builds it."""
    out = tmp_path_factory.mktemp("dist")
    run(builder, "-m", "build", "--outdir", out, ROOT, timeout=900)
    return out


def test_python_m_build_gives_a_wheel_that_runs_compiled(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("streamq-*.whl")
    assert "linux_x86_64" in wheel.name, wheel.name  # a binary wheel, not py3-none-any
    round_trip(clean_venv(tmp_path / "venv", wheel), tmp_path)


def test_pip_install_of_the_checkout_runs_compiled(tmp_path: Path) -> None:
    bindir = clean_venv(tmp_path / "venv", ROOT)
    version, _ = run(bindir / "streamq", "--version", cwd=tmp_path, timeout=60)
    assert "compiled (mypyc" in version, version
    round_trip(bindir, tmp_path)


def build_pure(builder: Path, source: Path, out: Path, **env: str) -> tuple[str, str]:
    """A wheel of ``source`` built by pip (isolated) with ``env``: what the build said of
    its path (pip shows it with -v), and what ``streamq --version`` says of the wheel's
    package."""
    _, log = run(  # the build's output: in pip's log, on stderr
        builder,
        *("-m", "pip", "wheel", "--no-deps", "-v", "-w", out, source),
        timeout=600,
        environ=env,
    )
    said = "\n".join(line.strip() for line in log.splitlines() if "streamq: " in line)
    (wheel,) = out.glob("streamq-*.whl")
    with zipfile.ZipFile(wheel) as zipped:
        zipped.extractall(out / "unpacked")
    return said, native.check({}, out / "unpacked" / "streamq").describe()


@pytest.fixture
def sdist(dist: Path, tmp_path: Path) -> Path:
    """The sdist, unpacked: the sources a build from the package index starts from."""
    (archive,) = dist.glob("streamq-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "sdist", filter="data")
    (source,) = (tmp_path / "sdist").iterdir()
    return source


def test_a_build_without_a_c_compiler_says_so(builder: Path, sdist: Path, tmp_path: Path) -> None:
    said, version = build_pure(builder, sdist, tmp_path / "out", CC="/nonexistent/cc")
    why = "no C compiler (/nonexistent/cc not found)"
    assert f"streamq: installing the pure-Python path only: {why}" in said, said
    assert version == f"pure Python (built without the compiled path: {why})"


def test_a_build_that_cannot_compile_says_the_real_cause(
    builder: Path, sdist: Path, tmp_path: Path
) -> None:
    """Not "without a C compiler": mypyc's own first error, where pip -v and ``streamq
    --version`` show it."""
    compiled = sdist / "streamq" / "engines" / "postgres" / "pgoutput.py"
    lines = compiled.read_text().count("\n")
    with compiled.open("a") as source:
        source.write('BROKEN: int = "a str"\n')
    said, version = build_pure(builder, sdist, tmp_path / "out")
    error = (
        f"streamq/engines/postgres/pgoutput.py:{lines + 1}: error: Incompatible types in "
        'assignment (expression has type "str", variable has type "int")'
    )
    assert said.startswith("streamq: installing the pure-Python path only: mypyc could not"), said
    assert error in said, said
    assert version.startswith("pure Python (built without the compiled path: mypyc could not")
    assert error in version, version
    assert "C compiler" not in version

"""Applications on a Spark standalone cluster (``bench.spark.cluster.Cluster``), as a user
submits them: ``spark-submit`` in client mode, producers to read (``Fleet``), and what the
parquet sink committed (``read_committed``).

The executors' Python is the machine's own (``sys.base_prefix``: no streamq, no pyarrow);
an application ships streamq to them the way docs/guides/spark.md tells users: a virtual
environment packed with venv-pack, passed with ``--archives`` (``packed_environment``).
Every process here is in a process group of its own, killed whole at the end; a worker
killed with ``kill_worker`` takes its executor and the executor's Python workers with it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

import streamq
from bench.spark.cluster import BASE_PYTHON, SPARK_HOME, Cluster
from spark_source.session import LOOPBACK, PYTHON_WORKER_SOCKETS
from tests.spark.test_spark_exactly_once import committed_files

ROOT = Path(__file__).resolve().parents[2]
FLEET = Path(__file__).resolve().parent / "programs" / "fleet.py"
# What the executors' environment holds besides streamq (its wheel brings its own
# dependencies): what PySpark's Python workers need to run a Python data source.
EXECUTOR_PACKAGES = ("pyarrow>=15", "pandas>=2")


class Fleet:
    """Producers, each with its count of records of ``orders``, served by ``FLEET``:
    ``endpoints`` and, by producer id, ``records``."""

    def __init__(self, folder: Path, records: list[int]) -> None:
        self.records: dict[str, int] = {}
        for i, count in enumerate(records):
            with (
                streamq.SyncProducer(str(folder / f"p{i}.db"), serve=False) as producer,
                producer.transaction() as tx,
            ):
                tx.publish_many("orders", [b"%d-%d" % (i, n) for n in range(count)])
            self.records[producer.producer_id] = count
        self.process = subprocess.Popen(
            [sys.executable, str(FLEET), *(str(folder / f"p{i}.db") for i in range(len(records)))],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        self.endpoints: list[str] = []
        while len(self.endpoints) < len(records):
            line = self.process.stdout.readline()  # "serving producer ID (epoch N) on H:P"
            assert line and not line.startswith("exited"), line
            if line.startswith("serving producer"):
                self.endpoints.append(line.rsplit(" on ", 1)[1].strip())

    def every_record(self) -> set[tuple[str, int]]:
        return {(pid, seq) for pid, count in self.records.items() for seq in range(1, count + 1)}

    def close(self) -> None:
        self.process.terminate()  # it passes SIGTERM on to every server
        self.process.communicate(timeout=30)


def read_committed(out: Path) -> Counter[tuple[str, int]]:
    """(producer, seq) of every row the parquet sink committed (its ``_spark_metadata``:
    a killed batch's files are not among them)."""
    read: Counter[tuple[str, int]] = Counter()
    for path in committed_files(out):
        table = pq.read_table(path, columns=["producer", "seq"])
        read.update(zip(table["producer"].to_pylist(), table["seq"].to_pylist(), strict=True))
    return read


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("streamq/**/*.py"), *ROOT.glob("spark_source/*.py")]):
        digest.update(path.read_bytes())
    digest.update(repr(EXECUTOR_PACKAGES).encode())
    return digest.hexdigest()[:12]


_RUN = {"check": True, "capture_output": True, "timeout": 600}
# The environment's own commands, away from the checkout (neither the test's PYTHONPATH
# nor the working directory): there pip would find the checkout's streamq.egg-info and
# take streamq as installed already.
_OWN = {
    **_RUN,
    "env": {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    "cwd": os.sep,
}


def pure_wheel(directory: Path) -> Path:
    """streamq's pure-Python wheel (``STREAMQ_PURE=1``: one wheel for any executor, and
    importable from a zip, as ``--py-files`` needs), kept in ``directory`` under the
    sources' digest."""
    kept = directory / f"wheel-{_sources_digest()}"
    if kept.exists():
        return next(kept.glob("streamq-*.whl"))
    directory.mkdir(parents=True, exist_ok=True)
    build = directory / f"wheel-build-{os.getpid()}"
    env = {**os.environ, "STREAMQ_PURE": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(build), str(ROOT)],
        env=env, **_RUN,
    )  # type: ignore[call-overload]  # fmt: skip
    os.replace(build, kept)
    return next(kept.glob("streamq-*.whl"))


def packed_environment(directory: Path, with_streamq: bool = True) -> Path:
    """streamq's wheel and what executors need, in a virtual environment of the machine's
    Python, packed by venv-pack (``--archives env.tar.gz#environment``). Built once per
    version of the sources: kept in ``directory`` under their digest. ``with_streamq``
    False: streamq's dependencies without streamq itself, as an image that has them and
    gets streamq by ``--py-files`` would be (or a user's mistake, for the error it gets)."""
    directory = directory.resolve()  # its commands run elsewhere (``_OWN``)
    name = "streamq-env" if with_streamq else "env-streamq-deps-only"
    packed = directory / f"{name}-{_sources_digest()}.tar.gz"
    if packed.exists():
        return packed
    wheel = pure_wheel(directory)
    build = directory / f"build-{os.getpid()}"
    venv = build / "env"
    subprocess.run([str(BASE_PYTHON), "-m", "venv", str(venv)], **_OWN)  # type: ignore[call-overload]
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "install", "--quiet", str(wheel), *EXECUTOR_PACKAGES], **_OWN)  # type: ignore[call-overload]
    if not with_streamq:
        subprocess.run([*pip, "uninstall", "--quiet", "--yes", "streamq"], **_OWN)  # type: ignore[call-overload]
    where = "import importlib.util as u; print(getattr(u.find_spec('streamq'), 'origin', ''))"
    found = subprocess.run([python, "-c", where], text=True, **_OWN).stdout.strip()  # type: ignore[call-overload]
    assert found.startswith(str(venv)) if with_streamq else not found, f"streamq at {found!r}"
    partial = build / "env.tar.gz"
    subprocess.run(
        [str(Path(sys.executable).parent / "venv-pack"), "-p", str(venv), "-o", str(partial),
         "--quiet"],
        **_RUN,
    )  # type: ignore[call-overload]  # fmt: skip
    os.replace(partial, packed)
    subprocess.run(["rm", "-rf", str(build)], check=True)
    return packed


def unpacked(archive: Path) -> Path:
    """``archive`` (``packed_environment``'s) unpacked beside it, once: a Python
    environment of a driver's own, as a driver machine would have it."""
    folder = archive.with_name(archive.name.removesuffix(".tar.gz"))
    if not folder.exists():
        partial = folder.with_name(f"{folder.name}-{os.getpid()}")
        partial.mkdir()
        subprocess.run(["tar", "-xzf", str(archive), "-C", str(partial)], **_RUN)  # type: ignore[call-overload]
        os.replace(partial, folder)
    return folder


def submit(
    cluster: Cluster,
    program: Path,
    *args: str,
    archive: Path | None,
    log: Path,
    conf: Sequence[str] = (),
    py_files: Sequence[Path] = (),
    driver: Path = Path(sys.prefix),
) -> subprocess.Popen[bytes]:
    """``spark-submit --master spark://... --deploy-mode client program args``: the driver
    runs here, in the Python environment ``driver`` (by default the test's: streamq
    installed); the executors run ``archive``'s Python (or the machine's, without one),
    ``py_files`` on their path."""
    options = ["--master", cluster.master, "--deploy-mode", "client"]
    options += ["--conf", f"spark.pyspark.driver.python={driver / 'bin' / 'python'}"]
    options += ["--conf", f"spark.driver.host={LOOPBACK}"]
    options += ["--conf", "spark.executor.memory=768m", "--conf", "spark.ui.enabled=false"]
    options += ["--conf", f"{PYTHON_WORKER_SOCKETS}=true"]  # as the guide says
    if archive is not None:
        options += ["--archives", f"{archive}#environment"]
        options += ["--conf", "spark.pyspark.python=./environment/bin/python"]
        # The driver runs Python workers too (a Python data source plans there) with the
        # same relative path, from its working directory: there, the driver's own venv.
        link = log.parent / "environment"
        if not link.exists():
            link.symlink_to(driver)
    for setting in conf:
        options += ["--conf", setting]
    if py_files:
        options += ["--py-files", ",".join(map(str, py_files))]
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-submit"), *options, str(program), *args],
            env=cluster.env,
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

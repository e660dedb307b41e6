"""A Spark standalone cluster on loopback, as a user runs one: a master and workers, each
its own JVM (``spark-class`` from the pip-installed pyspark), and applications submitted
with ``spark-submit`` in client mode.

The executors' Python is the machine's own (``sys.base_prefix``: no streamq, no pyarrow);
an application ships streamq to them the way docs/guides/spark.md tells users: a virtual
environment packed with venv-pack, passed with ``--archives`` (``packed_environment``).
Every process here is in a process group of its own, killed whole at the end; a worker
killed with ``kill_worker`` takes its executor and the executor's Python workers with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import pyspark

import streamq
from spark_source.session import LOOPBACK, log4j2_file
from tests.pgserver import free_port
from tests.spark.test_spark_exactly_once import committed_files

ROOT = Path(__file__).resolve().parents[2]
FLEET = Path(__file__).resolve().parent / "programs" / "fleet.py"
SPARK_HOME = Path(pyspark.__file__).resolve().parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"  # the machine's: no streamq
# What the executors' environment holds besides streamq (its wheel brings its own
# dependencies): what PySpark's Python workers need to run a Python data source.
EXECUTOR_PACKAGES = ("pyarrow>=15", "pandas>=2")
STARTED = 60.0  # s: a JVM's start, on a loaded machine


def _wait(condition: object, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def spark_env(directory: Path) -> dict[str, str]:
    """The environment of the cluster's JVMs and of spark-submit: loopback only, quiet
    logs, and no Python of the test's (``PYTHONPATH`` cleared: executors see none of it)."""
    log4j = f"-Dlog4j2.configurationFile=file:{log4j2_file()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "PYTHON"))}
    return {
        **env,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_LOG_DIR": str(directory / "logs"),
        "SPARK_WORKER_DIR": str(directory / "work"),
        "SPARK_DAEMON_JAVA_OPTS": log4j,
        "PYSPARK_PYTHON": str(BASE_PYTHON),
    }


class Cluster:
    """``Cluster(tmp_path, workers=2)``: ``master`` is its ``spark://`` URL."""

    def __init__(self, directory: Path, workers: int = 2, cores: int = 1) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.env = spark_env(directory)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        port, ui = free_port(), free_port()
        self.master = f"spark://{LOOPBACK}:{port}"
        self.ui = f"http://{LOOPBACK}:{ui}"
        try:
            self._start(
                "master", "org.apache.spark.deploy.master.Master",
                "--host", LOOPBACK, "--port", str(port), "--webui-port", str(ui),
            )  # fmt: skip
            _wait(self._answers, "the master's web UI", STARTED)
            for i in range(workers):
                self.start_worker(i, cores)
            _wait(lambda: self.alive_workers() == workers, f"{workers} workers", STARTED)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, main_class: str, *args: str) -> None:
        log = (self.directory / f"{name}.log").open("wb")
        with log:
            self.processes[name] = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), main_class, *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_worker(self, i: int, cores: int = 1) -> None:
        """Worker ``i``: ``cores`` cores, 1 GiB for executors, its own work directory."""
        work = self.directory / f"worker{i}"
        work.mkdir(exist_ok=True)
        self._start(
            f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.master,
            "--host", LOOPBACK, "--cores", str(cores), "--memory", "1g",
            "--webui-port", str(free_port()), "--work-dir", str(work),
        )  # fmt: skip

    def _answers(self) -> bool:
        with contextlib.suppress(OSError):
            return bool(self.state())
        return False

    def state(self) -> dict[str, object]:
        """The master's view (its web UI's ``/json/``): workers, applications."""
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as answer:
            state: dict[str, object] = json.load(answer)
            return state

    def alive_workers(self) -> int:
        return int(self.state().get("aliveworkers", 0))  # type: ignore[call-overload]

    def kill_worker(self, i: int) -> None:
        """``kill -9`` of worker ``i``'s process group: the worker, its executor and the
        executor's Python workers, as when a machine dies."""
        process = self.processes.pop(f"worker{i}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for process in reversed(list(self.processes.values())):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        self.processes.clear()


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


def packed_environment(directory: Path, with_streamq: bool = True) -> Path:
    """streamq's wheel and what executors need, in a virtual environment of the machine's
    Python, packed by venv-pack (``--archives env.tar.gz#environment``). Built once per
    version of the sources: kept in ``directory`` under their digest. ``with_streamq``
    False: the same without streamq (a user's mistake, for the error it gets)."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("streamq/**/*.py"), *ROOT.glob("spark_source/*.py")]):
        digest.update(path.read_bytes())
    digest.update(repr(EXECUTOR_PACKAGES).encode())
    name = "streamq-env" if with_streamq else "env-without-streamq"
    packed = directory / f"{name}-{digest.hexdigest()[:12]}.tar.gz"
    if packed.exists():
        return packed
    directory.mkdir(parents=True, exist_ok=True)
    build = directory / f"build-{os.getpid()}"
    venv = build / "env"
    run = {"check": True, "capture_output": True, "timeout": 600}
    subprocess.run([str(BASE_PYTHON), "-m", "venv", str(venv)], **run)  # type: ignore[call-overload]
    wheels: list[str] = []
    if with_streamq:
        env = {**os.environ, "STREAMQ_PURE": "1"}  # pure Python: one wheel for any executor
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(build), str(ROOT)],
            env=env, **run,
        )  # type: ignore[call-overload]  # fmt: skip
        wheels = [str(wheel) for wheel in build.glob("streamq-*.whl")]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *wheels, *EXECUTOR_PACKAGES], **run)  # type: ignore[call-overload]
    partial = build / "env.tar.gz"
    subprocess.run(
        [str(Path(sys.executable).parent / "venv-pack"), "-p", str(venv), "-o", str(partial),
         "--quiet"],
        **run,
    )  # type: ignore[call-overload]  # fmt: skip
    os.replace(partial, packed)
    subprocess.run(["rm", "-rf", str(build)], check=True)
    return packed


def submit(
    cluster: Cluster,
    program: Path,
    *args: str,
    archive: Path | None,
    log: Path,
    conf: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``spark-submit --master spark://... --deploy-mode client program args``: the driver
    runs here, in the test's environment (streamq installed); the executors run
    ``archive``'s Python (or the machine's, without one)."""
    options = ["--master", cluster.master, "--deploy-mode", "client"]
    options += ["--conf", f"spark.pyspark.driver.python={sys.executable}"]
    options += ["--conf", f"spark.driver.host={LOOPBACK}"]
    options += ["--conf", "spark.executor.memory=768m", "--conf", "spark.ui.enabled=false"]
    if archive is not None:
        options += ["--archives", f"{archive}#environment"]
        options += ["--conf", "spark.pyspark.python=./environment/bin/python"]
        # The driver runs Python workers too (a Python data source plans there) with the
        # same relative path, from its working directory: there, the driver's own venv.
        link = log.parent / "environment"
        if not link.exists():
            link.symlink_to(sys.prefix)
    for setting in conf:
        options += ["--conf", setting]
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-submit"), *options, str(program), *args],
            env=cluster.env,
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

"""A Spark standalone cluster on loopback, as a user runs one: a master and workers, each
its own JVM (``spark-class`` from the pip-installed pyspark). The Spark benchmarks run on
it with ``python -m bench.spark.run --cluster 2``; the tests submit applications to it
(tests/spark/cluster.py). Every process is in a process group of its own, killed whole
at the end; a worker killed with ``kill_worker`` takes its executor and the executor's
Python workers with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pyspark

from spark_source.session import LOOPBACK, log4j2_file

from ..common import free_port, wait_until

SPARK_HOME = Path(pyspark.__file__).resolve().parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"  # the machine's: no streamq
STARTED = 60.0  # s: a JVM's start, on a loaded machine


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
            wait_until("answer from the master's web UI", self._answers, STARTED, every=0.1)
            for i in range(workers):
                self.start_worker(i, cores)
            wait_until(
                f"{workers} workers alive",
                lambda: self.alive_workers() == workers,
                STARTED,
                every=0.1,
            )
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
        alive = self.state().get("aliveworkers", 0)
        return alive if isinstance(alive, int) else 0

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

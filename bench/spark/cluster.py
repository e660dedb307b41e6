"""A Spark standalone cluster on loopback, as a user runs one: a master and workers, each
its own JVM (``spark-class`` from the pip-installed pyspark). The Spark benchmarks run on
it with ``python -m bench.spark.run --cluster 2``; the tests submit applications to it
(tests/spark/cluster.py). Every process is in a process group of its own, killed whole
at the end; a worker killed with ``kill_worker`` takes its executor and the executor's
Python workers with it.

Every daemon binds port 0 (any free one) and the cluster reads back, from the master's
log, the ports it bound: a port chosen ahead of time can be taken by another process
before the JVM binds it, and Spark then quietly binds the next one
(``spark.port.maxRetries``), which once left the tests reading another Spark UI's page.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pyspark

from spark_source.session import LOG4J2, LOOPBACK, log4j2_file

from ..common import wait_until

SPARK_HOME = Path(pyspark.__file__).resolve().parent
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"  # the machine's: no streamq
STARTED = 60.0  # s: a JVM's start, on a loaded machine
# The daemons' logs: errors, and the line Spark writes for each port it binds.
DAEMON_LOG4J2 = (
    LOG4J2 + "logger.ports.name = org.apache.spark.util.Utils\nlogger.ports.level = info\n"
)
BOUND = re.compile(r"Successfully started service '([^']*)' on port (\d+)\.")


def spark_env(directory: Path) -> dict[str, str]:
    """The environment of the cluster's JVMs and of spark-submit: loopback only, quiet
    logs, and no Python of the test's (``PYTHONPATH`` cleared: executors see none of it)."""
    log4j = f"-Dlog4j2.configurationFile=file:{log4j2_file(DAEMON_LOG4J2)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "PYTHON"))}
    return {
        **env,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_LOG_DIR": str(directory / "logs"),
        "SPARK_WORKER_DIR": str(directory / "work"),
        "SPARK_DAEMON_JAVA_OPTS": log4j,
        # No REST submission server: it would take port 6066 (or the next free one).
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        "PYSPARK_PYTHON": str(BASE_PYTHON),
    }


def bound_port(
    log: Path, service: str, process: subprocess.Popen[bytes], timeout: float = STARTED
) -> int:
    """The port Spark's ``process`` bound for ``service`` (``sparkMaster``, ``MasterUI``,
    ...), read from its log (its "Successfully started service" line, which
    ``DAEMON_LOG4J2`` keeps) once it is written."""

    def written() -> int | None:
        text = log.read_text(errors="replace") if log.exists() else ""
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited ({process.returncode}):\n{text[-3000:]}")
        ports = [int(port) for name, port in BOUND.findall(text) if name == service]
        return ports[0] if ports else None

    return wait_until(f"the port of {service} in {log}", written, timeout, every=0.1)


def master_state(ui: str) -> dict[str, object]:
    """A master's view (its web UI's ``/json/``, ``ui`` its URL): workers, applications."""
    with urllib.request.urlopen(f"{ui}/json/", timeout=5) as answer:
        state: dict[str, object] = json.load(answer)
        return state


def starting_master_state(ui: str) -> dict[str, object] | None:
    """``master_state`` while the master may still be starting: None until its UI answers
    JSON (it refuses connections at first, and has answered an HTML page at ``/json/``
    for a moment, twice on a loaded machine)."""
    with contextlib.suppress(OSError, ValueError):
        return master_state(ui)
    return None


class Cluster:
    """``Cluster(tmp_path, workers=2)``: ``master`` is its ``spark://`` URL, ``ui`` its
    web UI's. ``port``, ``ui_port``: the ports the master asks for, 0 (any free one) by
    default; where one is taken Spark binds a next one, and these say which."""

    def __init__(
        self, directory: Path, workers: int = 2, cores: int = 1, port: int = 0, ui_port: int = 0
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.env = spark_env(directory)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        try:
            self._start(
                "master", "org.apache.spark.deploy.master.Master",
                "--host", LOOPBACK, "--port", str(port), "--webui-port", str(ui_port),
            )  # fmt: skip
            log, process = self.directory / "master.log", self.processes["master"]
            self.master = f"spark://{LOOPBACK}:{bound_port(log, 'sparkMaster', process)}"
            self.ui = f"http://{LOOPBACK}:{bound_port(log, 'MasterUI', process)}"
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
            "--webui-port", "0", "--work-dir", str(work),
        )  # fmt: skip

    def _answers(self) -> bool:
        return bool(starting_master_state(self.ui))

    def state(self) -> dict[str, object]:
        return master_state(self.ui)

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

"""A real, single-node Apache Kafka broker for the benchmarks, on loopback only.

The broker is Apache Kafka 4.x in KRaft mode, one JVM acting as broker and controller
(``process.roles=broker,controller``), with its jars resolved from Maven Central by Maven
(``bench/kafka/pom.xml``, copied to ``bench/kafka/lib/`` on first use) or taken from
``$KAFKA_HOME/libs`` when that is set::

    from bench.kafka.broker import KafkaBroker

    with KafkaBroker() as broker:          # formats storage, starts the JVM, waits until it answers
        broker.create_topic("orders", 4)   # waits until every partition has a leader
        print(broker.bootstrap)            # "127.0.0.1:54321"
        print(broker.config)               # the server.properties settings used
    # stopped (SIGTERM, then SIGKILL after a bound), its temporary folder removed

``python -m bench.kafka.broker`` starts one, prints its settings, runs a produce/consume
self-check with confluent-kafka and stops it. ``spark_kafka_jars()`` gives the jars of
Spark's Kafka source (``format("kafka")``) for the installed pyspark.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from confluent_kafka import (  # type: ignore[import-untyped,unused-ignore]
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
)
from confluent_kafka.admin import (  # type: ignore[import-untyped,attr-defined,unused-ignore]
    AdminClient,
    NewTopic,
)

from ..locks import file_lock

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
SPARK_POM = HERE / "spark-pom.xml"
LIB = HERE / "lib"
SPARK_LIB = HERE / "spark-lib"
MARKER = ".complete.json"  # written last into a jar folder: the folder is complete

MAVEN_TIMEOUT = 900.0  # s, one `mvn dependency:copy-dependencies` (a cold download is ~15 s)
STORAGE_FORMAT_TIMEOUT = 120.0  # s
STARTUP_TIMEOUT = 60.0  # s, from launching the JVM until it answers metadata requests
STOP_TIMEOUT = 30.0  # s of SIGTERM (controlled shutdown) before SIGKILL
BIND_RETRIES = 3  # new ports if one of the chosen free ports was taken meanwhile

BROKER_MAIN = "kafka.Kafka"
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"
# What Kafka's bin/kafka-server-start.sh and kafka-run-class.sh pass by default.
JVM_PERFORMANCE_OPTS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)

# Spark's Kafka source: used when Maven Central has no connector for the installed pyspark's
# exact version (then the newest published one is taken, see spark_kafka_jars()).
SPARK_KAFKA_FALLBACK = {"spark.version": "4.2.0", "spark.token.version": "4.1.0-preview1"}

LOG4J2_PROPERTIES = """\
# Written by bench/kafka/broker.py: the broker logs to stdout, which goes to broker.log.
status = warn
name = streamq-bench-kafka
# Keep logging while Kafka's own shutdown hook runs (its controlled shutdown on SIGTERM).
shutdownHook = disable
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.controller.name = kafka.controller
logger.controller.level = WARN
logger.zookeeper.name = org.apache.zookeeper
logger.zookeeper.level = WARN
"""


class KafkaBrokerError(RuntimeError):
    """The broker (or Maven, or the storage tool) failed; the message says why."""


# --------------------------------------------------------------------------- jars


def ensure_jars() -> Path:
    """The folder of the broker's jars, for ``java -cp 'FOLDER/*'``.

    ``$KAFKA_HOME/libs`` if ``$KAFKA_HOME`` is set (an unpacked Kafka distribution);
    otherwise ``bench/kafka/lib``, filled by Maven from ``pom.xml`` if it is missing,
    incomplete or older than the pom.
    """
    home = os.environ.get("KAFKA_HOME")
    if home:
        libs = Path(home) / "libs"
        if not any(libs.glob("kafka_2.*.jar")):
            raise KafkaBrokerError(f"KAFKA_HOME={home} has no libs/kafka_2.*.jar")
        return libs
    return _maven_jars(POM, LIB, {})


def kafka_version(lib: Path | None = None) -> str:
    """The Kafka version of the broker's jars, e.g. ``"4.3.1"`` (from kafka_2.13-4.3.1.jar)."""
    folder = lib or ensure_jars()
    jars = sorted(folder.glob("kafka_2.*-*.jar"))
    names = [jar.stem.split("-", 1)[1] for jar in jars if "-test" not in jar.stem]
    if not names:
        raise KafkaBrokerError(f"no kafka_2.*.jar in {folder}")
    return names[0]


def pyspark_version() -> str:
    """The version of the installed pyspark (without importing it)."""
    return importlib.metadata.version("pyspark")


def spark_kafka_jars() -> list[Path]:
    """Jars that make ``spark.readStream.format("kafka")`` work in the installed pyspark.

    Spark's Kafka source at the version of the installed pyspark, plus what it needs that
    pyspark does not ship (its token provider, kafka-clients, commons-pool2), from Maven
    Central through ``spark-pom.xml`` into ``bench/kafka/spark-lib``. Pass them as
    ``.config("spark.jars", ",".join(map(str, jars)))``. If Maven Central has no connector
    for that exact version, the pinned ``SPARK_KAFKA_FALLBACK`` versions are used and a
    note goes to stderr; ``spark_kafka_versions()`` tells which were used.
    """
    version = pyspark_version()
    exact = {"spark.version": version, "spark.token.version": version}
    fallback = {**SPARK_KAFKA_FALLBACK, "for.pyspark": version}
    try:
        folder = _maven_jars(SPARK_POM, SPARK_LIB, exact, accept=[fallback])
    except KafkaBrokerError as exact_error:
        if "Could not" not in str(exact_error):  # not a missing artifact: a real failure
            raise
        print(
            f"bench.kafka: Maven Central has no Spark Kafka source {version} "
            f"({_first_line(exact_error)}); using {SPARK_KAFKA_FALLBACK}",
            file=sys.stderr,
        )
        folder = _maven_jars(SPARK_POM, SPARK_LIB, fallback)
    return sorted(folder.glob("*.jar"))


def spark_kafka_versions() -> dict[str, str]:
    """The Maven properties that filled ``spark-lib`` (after ``spark_kafka_jars()``)."""
    marker = SPARK_LIB / MARKER
    properties: dict[str, str] = json.loads(marker.read_text())["properties"]
    return properties


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if "Could not" in line]
    line = (lines[0] if lines else str(error)).strip()
    return line.split(": ", 2)[-1][:300] if "Failed to execute goal" in line else line[:300]


def _stamp(pom: Path, properties: Mapping[str, str]) -> str:
    digest = hashlib.sha256(pom.read_bytes())
    digest.update(json.dumps(dict(properties), sort_keys=True).encode())
    return digest.hexdigest()


def _complete(folder: Path, stamps: list[str]) -> bool:
    """``folder`` holds every jar a Maven run made for one of ``stamps``."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("stamp") not in stamps:
        return False
    return all((folder / name).is_file() for name in marker.get("jars", []))


def _maven_jars(
    pom: Path,
    folder: Path,
    properties: Mapping[str, str],
    accept: list[Mapping[str, str]] | None = None,
) -> Path:
    """Fill ``folder`` with ``pom``'s runtime dependencies unless it is already complete.

    Maven copies into a temporary sibling folder that replaces ``folder`` once complete,
    so an interrupted download is never taken for a complete one. ``accept`` lists other
    property sets whose complete folder is good enough (no Maven run then).
    """
    stamp = _stamp(pom, properties)
    stamps = [stamp] + [_stamp(pom, other) for other in accept or []]
    if _complete(folder, stamps):
        return folder
    with file_lock(folder.parent / f".{folder.name}.lock", MAVEN_TIMEOUT + 60, KafkaBrokerError):
        if _complete(folder, stamps):  # another process filled it while we waited
            return folder
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaBrokerError("Maven (mvn) is not on PATH: install it, or set KAFKA_HOME")
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # from killed runs
            shutil.rmtree(stale, ignore_errors=True)
        staging = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        command = [mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(pom), f"-Djars.dir={staging}"]
        command += [f"-D{key}={value}" for key, value in properties.items()]
        command += ["dependency:copy-dependencies"]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=MAVEN_TIMEOUT,
                stdin=subprocess.DEVNULL,
                check=False,
            )
            jars = sorted(path.name for path in staging.glob("*.jar"))
            if done.returncode != 0 or not jars:
                output = (done.stdout + done.stderr).strip()
                raise KafkaBrokerError(
                    f"{' '.join(command)} failed (exit {done.returncode}):\n{output[-4000:]}"
                )
            marker = {"stamp": stamp, "properties": dict(properties), "jars": jars}
            (staging / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        except subprocess.TimeoutExpired as error:
            raise KafkaBrokerError(f"Maven took over {MAVEN_TIMEOUT:.0f} s: {command}") from error
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


# --------------------------------------------------------------------------- broker


def java_executable() -> str:
    """``$JAVA_HOME/bin/java`` if set, else ``java`` from PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise KafkaBrokerError("java is not on PATH (Kafka needs Java 17+)")
    return java


def random_cluster_id() -> str:
    """What ``kafka-storage.sh random-uuid`` prints: 16 random bytes, URL-safe base64."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka never hands out ids that look like options
            return text


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _read_from(path: Path, offset: int, limit: int = 4_000_000) -> str:
    """The text of ``path`` from ``offset`` on (at most its last ``limit`` bytes)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(offset, handle.tell() - limit))
            return handle.read().decode(errors="replace")
    except OSError as error:
        return f"(no log: {error})"


def failure_summary(text: str, errors: int = 12, last: int = 15) -> str:
    """The ERROR/FATAL lines and their causes of a broker log, then its last lines."""
    lines = text.splitlines()
    wanted = [
        line[:400]
        for line in lines
        if " ERROR " in line or " FATAL " in line or line.startswith("Caused by:")
    ]
    shown = wanted[:errors] + (["..."] if len(wanted) > errors else [])
    return "\n".join([*shown, "--- last lines:", *(line[:400] for line in lines[-last:])])


_LIVE: set[KafkaBroker] = set()  # started and not yet stopped


@atexit.register
def _stop_leftovers() -> None:
    """A broker never leaves its JVM behind, even if its owner forgot to stop it."""
    for broker in list(_LIVE):
        broker.stop()


class KafkaBroker:
    """A single-node Kafka broker+controller (KRaft) on 127.0.0.1, as a context manager.

    ``port``: the client (PLAINTEXT) port, a free one if None; the controller listener
    always takes a free one. ``log_dir``: where ``server.properties``, ``broker.log`` (the
    JVM's stdout and stderr) and the data (``kafka-data/``) go; kept afterwards, and an
    already formatted ``kafka-data`` is reused (a restart). If None, a temporary folder is
    made and removed at stop. ``flush_every_message``: ``log.flush.interval.messages=1``,
    i.e. an fsync after every append (per produce batch and partition) instead of leaving
    durability to replication and the page cache (Kafka's default). ``extra_config``:
    more or overriding server.properties settings.
    """

    def __init__(
        self,
        port: int | None = None,
        log_dir: Path | None = None,
        flush_every_message: bool = False,
        extra_config: Mapping[str, object] | None = None,
        *,
        heap: str = "1g",
        startup_timeout: float = STARTUP_TIMEOUT,
    ) -> None:
        self.requested_port = port
        self.requested_log_dir = Path(log_dir) if log_dir is not None else None
        self.flush_every_message = flush_every_message
        self.extra_config = {key: _property(value) for key, value in (extra_config or {}).items()}
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.port = 0
        self.controller_port = 0
        self.cluster_id = random_cluster_id()
        self.config: dict[str, str] = {}
        self.command: list[str] = []
        self.startup_seconds = 0.0  # from the storage format to the first metadata answer
        self.returncode: int | None = None
        self.log_dir = Path()
        self.log_file = Path()
        self._own_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None
        self._admin: Any = None
        self._pid: int | None = None
        self._launch_offset = 0  # where this launch's output starts in broker.log

    # -- life cycle

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients: ``"127.0.0.1:PORT"``."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The broker JVM's process id (kept after it stopped)."""
        if self._pid is None:
            raise KafkaBrokerError("the broker was not started")
        return self._pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def admin(self) -> Any:
        """A confluent_kafka ``AdminClient`` connected to this broker."""
        if self._admin is None:
            raise KafkaBrokerError("the broker is not running")
        return self._admin

    def start(self) -> None:
        """Format the storage, start the JVM and wait until it answers; stop it on failure."""
        if self._proc is not None:
            raise KafkaBrokerError("the broker is already started")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        lib = ensure_jars()
        if self.requested_log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="streamq-kafka-"))
            self._own_dir = True
        else:
            self.log_dir = self.requested_log_dir.resolve()
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = self.log_dir / "broker.log"
        self._log_handle = self.log_file.open("ab")
        (self.log_dir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
        _LIVE.add(self)
        for attempt in range(1, BIND_RETRIES + 1):
            began = time.monotonic()
            self._launch(lib)
            try:
                self._wait_ready()
                break
            except KafkaBrokerError:
                if attempt < BIND_RETRIES and self._lost_a_port_race():
                    self._terminate()
                    continue
                raise
        self.startup_seconds = time.monotonic() - began

    def _launch(self, lib: Path) -> None:
        if self.requested_port is None:
            self.port, self.controller_port = free_loopback_ports(2)
        else:
            self.port = self.requested_port
            self.controller_port = next(p for p in free_loopback_ports(2) if p != self.port)
        self.config = self._properties()
        properties = self.log_dir / "server.properties"
        properties.write_text(
            "# Written by bench/kafka/broker.py\n"
            + "".join(f"{key}={value}\n" for key, value in self.config.items())
        )
        java = java_executable()
        classpath = str(lib / "*")
        logging = f"-Dlog4j2.configurationFile={self.log_dir / 'log4j2.properties'}"
        if not self._reuse_formatted_storage():
            self._format(java, classpath, logging, properties)
        self.command = [java, f"-Xms{self.heap}", f"-Xmx{self.heap}", *JVM_PERFORMANCE_OPTS]
        self.command += [logging, f"-Dkafka.logs.dir={self.log_dir}", "-cp", classpath]
        self.command += [BROKER_MAIN, str(properties)]
        assert self._log_handle is not None
        self._log_handle.write(f"\n### bench.kafka.broker: {' '.join(self.command)}\n".encode())
        self._log_handle.flush()
        self._launch_offset = self._log_handle.tell()
        self._proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            cwd=self.log_dir,
        )
        self._pid = self._proc.pid

    def _reuse_formatted_storage(self) -> bool:
        """A ``log_dir`` formatted by an earlier run is kept: the broker restarts on it."""
        meta = Path(self.config["log.dirs"].split(",")[0]) / "meta.properties"
        if not meta.is_file():
            return False
        for line in meta.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id":
                self.cluster_id = value.strip()
        return True

    def _format(self, java: str, classpath: str, logging: str, properties: Path) -> None:
        """``kafka-storage.sh format``: a new cluster id, the static quorum from the config."""
        fmt = [java, "-Xmx256m", logging, "-cp", classpath, STORAGE_TOOL_MAIN, "format"]
        fmt += ["--config", str(properties), "--cluster-id", self.cluster_id]
        try:
            done = subprocess.run(
                fmt,
                capture_output=True,
                text=True,
                timeout=STORAGE_FORMAT_TIMEOUT,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise KafkaBrokerError(f"the storage format took over {error.timeout} s") from error
        if done.returncode != 0:
            raise KafkaBrokerError(
                f"{' '.join(fmt)} failed (exit {done.returncode}):\n"
                f"{(done.stdout + done.stderr).strip()[-4000:]}"
            )

    def _properties(self) -> dict[str, str]:
        config = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.log_dir / "kafka-data"),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
        }
        if self.flush_every_message:
            config["log.flush.interval.messages"] = "1"
        config.update(self.extra_config)
        return config

    def _wait_ready(self) -> None:
        """Until the broker answers a metadata request naming itself; bounded."""
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        admin: Any = None
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._failure(f"the Kafka broker exited with code {code} while starting")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(
                    f"the Kafka broker did not answer within {self.startup_timeout:.0f} s"
                )
            if _accepts(self.port):
                if admin is None:
                    admin = AdminClient(
                        {"bootstrap.servers": self.bootstrap, "log.connection.close": False}
                    )
                try:
                    metadata = admin.list_topics(timeout=min(2.0, max(left, 0.1)))
                except KafkaException:
                    metadata = None
                if metadata is not None and int(self.config["node.id"]) in metadata.brokers:
                    self._admin = admin
                    return
            time.sleep(0.1)

    def _lost_a_port_race(self) -> bool:
        """Did the JVM fail because a port we picked was taken before it could bind it?"""
        if self._proc is None or self._proc.poll() is None:
            return False
        text = _read_from(self.log_file, self._launch_offset)
        ports = {int(port) for port in re.findall(r"failed to bind to 127\.0\.0\.1:(\d+)", text)}
        if ports:
            return self.requested_port not in ports
        return self.requested_port is None and "BindException" in text

    def _failure(self, what: str) -> KafkaBrokerError:
        text = _read_from(self.log_file, self._launch_offset)
        return KafkaBrokerError(f"{what}; from {self.log_file}:\n{failure_summary(text)}")

    def _terminate(self, timeout: float = STOP_TIMEOUT) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.terminate()  # SIGTERM: Kafka's controlled shutdown
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        except BaseException:
            proc.kill()
            proc.wait(10)
            raise
        finally:
            self.returncode = proc.returncode
            self._proc = None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL; close the log; remove a temp folder.

        Safe to call more than once, and on a broker that failed to start.
        """
        self._admin = None  # its connections close now, not noisily when the broker is gone
        try:
            self._terminate(timeout)
        finally:
            if self._log_handle is not None:
                self._log_handle.close()
                self._log_handle = None
            if self._own_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self._own_dir = False
            _LIVE.discard(self)

    # -- topics

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        config: Mapping[str, object] | None = None,
        *,
        exist_ok: bool = False,
        timeout: float = 60.0,
    ) -> None:
        """Create a topic (replication factor 1) and wait until all its partitions have a leader."""
        settings = {key: _property(value) for key, value in (config or {}).items()}
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=settings)
        futures = self.admin.create_topics(
            [topic], operation_timeout=timeout, request_timeout=timeout
        )
        try:
            futures[name].result(timeout=timeout + 5)
        except KafkaException as error:
            kafka_error = error.args[0] if error.args else None
            exists = isinstance(kafka_error, KafkaError) and (
                kafka_error.code() == KafkaError.TOPIC_ALREADY_EXISTS
            )
            if not (exist_ok and exists):
                raise
        self._wait_topic(name, partitions if not exist_ok else None, timeout)

    def delete_topic(self, name: str, timeout: float = 60.0) -> None:
        """Delete a topic and wait until the broker no longer lists it."""
        futures = self.admin.delete_topics([name], operation_timeout=timeout)
        futures[name].result(timeout=timeout + 5)
        deadline = time.monotonic() + timeout
        while name in self.admin.list_topics(timeout=timeout).topics:
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"topic {name} still listed after {timeout:.0f} s")
            time.sleep(0.05)

    def _wait_topic(self, name: str, partitions: int | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            metadata = self.admin.list_topics(topic=name, timeout=timeout)
            topic = metadata.topics.get(name)
            if (
                topic is not None
                and topic.error is None
                and topic.partitions
                and (partitions is None or len(topic.partitions) == partitions)
                and all(p.leader >= 0 and p.error is None for p in topic.partitions.values())
            ):
                return
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"topic {name} has no leader after {timeout:.0f} s")
            time.sleep(0.05)


def _property(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --------------------------------------------------------------------------- self-check


def self_check(broker: KafkaBroker, count: int = 10, timeout: float = 60.0) -> float:
    """Produce ``count`` messages over 2 partitions and read them all back; seconds taken."""
    began = time.monotonic()
    topic = f"self-check-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 2)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    sent = {f"message {i}".encode() for i in range(count)}
    for value in sorted(sent):
        producer.produce(topic, value, key=value)
    left = producer.flush(timeout)
    if left:
        raise KafkaBrokerError(f"{left} messages not delivered within {timeout:.0f} s")
    consumer = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": topic,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    received: set[bytes] = set()
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while received != sent:
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"read back {len(received)}/{count} messages")
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error():
                raise KafkaException(message.error())
            received.add(message.value() or b"")
    finally:
        consumer.close()
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kafka.broker",
        description="Start a single-node Kafka broker on 127.0.0.1, self-check it, stop it.",
    )
    parser.add_argument("--port", type=int, default=None, help="client port (default: free)")
    parser.add_argument("--log-dir", type=Path, default=None, help="kept folder (default: temp)")
    parser.add_argument("--flush-every-message", action="store_true")
    parser.add_argument(
        "--serve", type=float, default=0.0, metavar="SECONDS", help="stay up this long"
    )
    parser.add_argument(
        "--spark-jars", action="store_true", help="also fetch and list Spark's Kafka source jars"
    )
    args = parser.parse_args(argv)
    # A SIGTERM to this process unwinds the `with` below, so the broker is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.spark_jars:
        jars = spark_kafka_jars()
        print(f"spark kafka source for pyspark {pyspark_version()}: {spark_kafka_versions()}")
        for jar in jars:
            print(f"  {jar}")
    began = time.monotonic()
    lib = ensure_jars()
    seconds = time.monotonic() - began
    with KafkaBroker(args.port, args.log_dir, args.flush_every_message) as broker:
        count = len(list(lib.glob("*.jar")))
        print(f"kafka      {kafka_version(lib)}  ({count} jars in {lib}, ready in {seconds:.1f} s)")
        print(f"bootstrap  {broker.bootstrap}")
        print(f"pid        {broker.pid}")
        print(f"log        {broker.log_file}")
        print(f"started in {broker.startup_seconds:.1f} s")
        print(f"command    {' '.join(broker.command)}")
        for key, value in broker.config.items():
            print(f"  {key}={value}")
        seconds = self_check(broker)
        print(f"self-check ok: 10 messages produced and consumed in {seconds:.2f} s")
        if args.serve > 0:
            print(f"serving for {args.serve:.0f} s (Ctrl-C stops)", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(args.serve)
        pid = broker.pid
    print(f"stopped    pid {pid}, exit code {broker.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

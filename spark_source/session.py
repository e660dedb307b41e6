"""A local SparkSession for demos, tests and benchmarks, bound to loopback only."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LOOPBACK = "127.0.0.1"

# Executors talk to their Python workers over Unix sockets, not loopback TCP: over TCP a
# task's input (the partition to read) follows its command in a second small write, which
# Nagle's algorithm holds until the worker's delayed ACK, 40 ms, in every task that reads
# a Python source. Measured on a micro-batch: the worker had the partition 41 to 57 ms
# after the command over TCP, 1 ms over a Unix socket (docs/guides/spark.md, "Latency",
# also for the one cost: PySpark's daemon prints a BrokenPipeError as Spark reaps an idle
# worker).
PYTHON_WORKER_SOCKETS = "spark.python.unix.domain.socket.enabled"

# Read by the JVM as it starts (-Dlog4j2.configurationFile): Spark's own default profile
# would log its start-up warnings (native-hadoop, hostname) before setLogLevel could run.
# Errors still reach stderr.
LOG4J2 = """\
rootLogger.level = error
# PySpark's JVM starts as a shell, which announces the level it picks unless this sets it.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


def log4j2_file(text: str = LOG4J2) -> Path:
    """``text`` (``LOG4J2``) in a file the JVM can read; named by its content, so it is
    written once per version and concurrent sessions never see it half written."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"streamq-spark-log4j2-{digest}.properties"
    if not path.exists():
        fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, path)
    return path


def local_spark(
    app: str,
    *,
    driver_memory: str = "1g",
    jars: list[str] | None = None,
    master: str = "local[2]",
) -> SparkSession:
    """``local[2]`` Spark (or ``master``'s: a standalone cluster on this machine) with the
    ``streamq`` source registered, quiet, on 127.0.0.1."""
    from pyspark.sql import SparkSession

    from .datasource import StreamQDataSource

    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this environment
    # Read by the JVM before any configuration: without it Spark looks up the hostname,
    # finds loopback and warns that it picked another interface.
    os.environ["SPARK_LOCAL_IP"] = LOOPBACK
    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.driver.host", LOOPBACK)  # loopback only
        .config("spark.driver.bindAddress", LOOPBACK)
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log4j2_file()}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", driver_memory)
        # Filters on key and seq reach the producers (StreamQBatchReader.pushFilters).
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config(PYTHON_WORKER_SOCKETS, "true")
    )
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    spark = builder.getOrCreate()
    spark.dataSource.register(StreamQDataSource)
    return spark

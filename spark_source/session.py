"""A local SparkSession for demos, tests and benchmarks, bound to loopback only."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def local_spark(
    app: str, *, driver_memory: str = "1g", jars: list[str] | None = None
) -> SparkSession:
    """``local[2]`` Spark with the ``streamq`` source registered, quiet, on 127.0.0.1."""
    from pyspark.sql import SparkSession

    from .datasource import StreamQDataSource

    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this environment
    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.driver.host", "127.0.0.1")  # loopback only
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", driver_memory)
        # Filters on key and seq reach the producers (StreamQBatchReader.pushFilters).
        .config("spark.sql.python.filterPushdown.enabled", "true")
    )
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(StreamQDataSource)
    return spark

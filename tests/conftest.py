"""Shared fixtures: real SQLite files in a temporary folder, real loopback sockets.

Every async test runs twice, on asyncio's default loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import uvloop

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local Spark for every Spark test: 2 cores, as small as it gets."""
    from pyspark.sql import SparkSession

    from spark_source import StreamQDataSource

    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this environment
    session = (
        SparkSession.builder.master("local[2]")
        .appName("streamq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")  # loopback only
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(StreamQDataSource)
    yield session
    session.stop()


@pytest.fixture
def producer_db(tmp_path: Path) -> str:
    return str(tmp_path / "producer.db")


@pytest.fixture
def consumer_db(tmp_path: Path) -> str:
    return str(tmp_path / "consumer.db")


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = ""
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result: Any = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.01)

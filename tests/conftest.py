"""Shared fixtures: real SQLite files in a temporary folder, real loopback sockets, a real
PostgreSQL server (``tests/pgserver.py``) with a fresh database per test.

Every async test runs twice, on asyncio's default loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import itertools
import os
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

from bench.common import reserved_port

from .children import KEPT, running_children
from .pgserver import PostgresMissingError, PostgresServer

# Property tests check what the code does, never how fast: no per-example deadline and no
# "too slow" health check, which a loaded machine (two test workers, a Spark JVM) trips.
# Speed lives in bench/.
settings.register_profile("streamq", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("streamq")

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from bench.kafka.broker import KafkaBroker
    from bench.nats.server import NatsServer


def pytest_sessionstart(session: pytest.Session) -> None:
    """``STREAMQ_TEST_BUILD=compiled`` (``make test``) or ``pure`` (``make test-pure``): the
    run stops at once if this process, and so the processes it starts, would run the other
    path, so that a green run says which code it tested."""
    import streamq.native

    wanted = os.environ.get("STREAMQ_TEST_BUILD")
    build = streamq.native.build()
    if wanted is not None and wanted != ("compiled" if build.compiled else "pure"):
        raise pytest.UsageError(f"STREAMQ_TEST_BUILD={wanted}, but streamq runs {build.describe()}")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# Tests sharing a server a session fixture keeps run in one xdist worker (``make test``
# runs ``--dist loadgroup``), so that it starts once, not once in each worker.
SERVER_GROUPS = {"spark": "spark", "kafka_broker": "kafka"}


def pytest_itemcollected(item: pytest.Item) -> None:  # before xdist reads the groups
    for fixture in set(getattr(item, "fixturenames", ())) & SERVER_GROUPS.keys():
        item.add_marker(pytest.mark.xdist_group(SERVER_GROUPS[fixture]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests and the server groups first: a long test handed out last would keep
    one worker busy while the other has nothing left."""
    items.sort(key=lambda item: not any(map(item.get_closest_marker, ("slow", "xdist_group"))))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local Spark for every Spark test."""
    from spark_source.session import local_spark

    before = set(running_children())
    session = local_spark("streamq-tests")
    KEPT.update(set(running_children()) - before)  # its JVM
    yield session
    session.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """One real Kafka broker for the benchmarks' tests, as ``python -m bench`` shares one
    between its workloads (each makes its own topics)."""
    from bench.kafka.broker import KafkaBroker

    with KafkaBroker() as broker:
        KEPT.add(broker.pid)
        yield broker


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    """A real nats-server (default sync interval) for a module's tests; built first if
    needed (``make test`` starts that build in the background)."""
    from bench.nats import server

    try:
        server.ensure_binary()
    except server.NatsServerError as error:
        pytest.fail(str(error), pytrace=False)
    with server.NatsServer() as started:
        yield started


def started_server(settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server, stopped and removed afterwards (for a fixture to
    ``yield from``). Missing binaries fail the tests that need it, with how to install
    them: never a skip."""
    try:
        server = PostgresServer(settings=settings)
    except PostgresMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One server for the session's PostgreSQL tests."""
    yield from started_server()


_DATABASES = itertools.count(1)


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """A fresh, empty database on the session's server, as a postgresql:// URL."""
    name = f"test_{next(_DATABASES)}"
    url = postgres.create_database(name)
    yield url
    postgres.drop_database(name)


@pytest.fixture(scope="session")
def logical_postgres() -> Iterator[PostgresServer]:
    """A server whose WAL can be decoded (``wal_level = logical``), for capture's tests."""
    yield from started_server({"wal_level": "logical", "max_replication_slots": "20"})


@pytest.fixture
def capture_url(logical_postgres: PostgresServer) -> Iterator[str]:
    """A fresh database on the logical server; its replication slots go with it."""
    name = f"capture_{next(_DATABASES)}"
    url = logical_postgres.create_database(name)
    yield url
    logical_postgres.drop_database(name, slots=True)


@pytest.fixture
def producer_db(tmp_path: Path) -> str:
    return str(tmp_path / "producer.db")


@pytest.fixture(params=["sqlite", "postgresql"])
def either_producer_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A producer database of either engine: a SQLite file, or a fresh PostgreSQL
    database on the session's server. Modules whose behaviour must not depend on the
    engine run their tests on both by overriding ``producer_db`` with this."""
    if request.param == "sqlite":
        return str(tmp_path / "producer.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def either_consumer_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A consumer database of either engine (made by the consumer): a SQLite file's path,
    or a fresh PostgreSQL database on the session's server."""
    if request.param == "sqlite":
        return str(tmp_path / "consumer.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def consumer_db(tmp_path: Path) -> str:
    return str(tmp_path / "consumer.db")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[str]:
    """Python's http.server on loopback, serving an empty folder, as ``python -m
    http.server`` does (in a thread): its address. It reads a request up to a line feed
    before it answers anything."""
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join(10)


@pytest.fixture
def reserve_port() -> Iterator[Callable[[], int]]:
    """``reserve_port()``: a loopback port held for the test, for a server told to listen
    on it (again after a restart) or for nothing to listen on (``reserved_port``)."""
    with contextlib.ExitStack() as held:
        yield lambda: held.enter_context(reserved_port())


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


# --- figures of the reliability suites ---------------------------------------------

_FIGURES = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FIGURES] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Report what a fault suite did (runs, faults injected, records checked, anomalies);
    the lines are printed together at the end of the pytest run."""
    lines = request.config.stash[_FIGURES]
    return lambda line: lines.append(f"{request.node.name}: {line}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_FIGURES, [])
    if lines:
        terminalreporter.section("reliability figures")
        for line in lines:
            terminalreporter.write_line(line)

"""A consumer pointed at a port that is not a streamq producer's says so in one line: a
PostgreSQL server's port or a web server's (each answers the handshake with bytes that
are no streamq frame; one that waits for a line feed first is probed for an answer) at
once, never retried even with a reconnect timeout, for the ``Consumer``, the
``FanInConsumer`` and the ``GroupConsumer`` alike; a port that accepts and says nothing,
once the connect timeout has passed, naming what it waited for."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import streamq
from bench.common import reserved_port
from streamq import Consumer, FanInConsumer, GroupConsumer
from streamq.wire.transport import parse_address

from ..conftest import wait_for
from ..faultproxy import FaultProxy
from ..pgserver import PostgresServer

# A consumer that retried would fail after its reconnect timeout, 30 s: this bound is only
# generous, for a loaded machine.
AT_ONCE = 10.0


@pytest.mark.parametrize("kind", ["consumer", "fan-in", "group"])
async def test_a_database_port_is_named_not_a_producer(
    postgres: PostgresServer, tmp_path: Path, kind: str
) -> None:
    address = f"127.0.0.1:{postgres.port}"
    options = {"db": str(tmp_path / "billing.db"), "name": "billing", "reconnect_timeout": 30}
    consumers = {
        "consumer": lambda: Consumer(address, "orders", **options),
        "fan-in": lambda: FanInConsumer([address], "orders", **options),
        "group": lambda: GroupConsumer(address, "orders", shares=2, **options),
    }
    await refused_at_once(consumers[kind](), address)


async def refused_at_once(consumer: Consumer | FanInConsumer | GroupConsumer, address: str) -> None:
    """Starting ``consumer`` and asking for its first batch (a group's members connect
    in the background) fails with "not a streamq producer", in one line with nothing of
    the decoder's reason, and not retried for the reconnect timeout the consumer has."""

    async def first_batch() -> None:
        await consumer.start()
        await anext(consumer)

    try:
        with pytest.raises(streamq.RemoteProtocolError) as refused:
            await asyncio.wait_for(first_batch(), AT_ONCE)
    finally:
        await consumer.close()
    assert str(refused.value) == (
        f"the peer at {address} is not a streamq producer: it answered with no SERVER_HELLO"
    )


@contextlib.asynccontextmanager
async def web_server() -> AsyncIterator[int]:
    """A real uvicorn (h11: it waits for a request line's end) serving an ASGI app on
    loopback; its port, once it accepts connections."""
    app = "async def app(scope, receive, send):\n    pass\n"
    with reserved_port() as port:
        process = subprocess.Popen(
            [sys.executable, "-c", app + f"import uvicorn; uvicorn.run(app, port={port})"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def accepting() -> bool:
            assert process.poll() is None, "uvicorn exited"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                return True
            return False

        try:
            await wait_for(accepting, 30, "uvicorn to listen")
            yield port
        finally:
            process.terminate()
            process.wait(10)


async def test_a_web_server_is_named_not_a_producer() -> None:
    """uvicorn answers the handshake's bytes with an HTTP error at once."""
    async with web_server() as port:
        address = f"127.0.0.1:{port}"
        await refused_at_once(Consumer(address, "orders", reconnect_timeout=30), address)


async def test_a_web_server_that_waits_for_a_line_is_probed_and_named(http_server: str) -> None:
    """Python's http.server answers nothing before a line feed, and a consumer's CLIENT_HELLO
    has none: the consumer, given no SERVER_HELLO, sends a frame that has one (its
    LIST_STREAMS), and the web server's answer names it, on the first connection."""
    async with FaultProxy(*parse_address(http_server)) as counting:
        consumer = Consumer(counting.address, "orders", reconnect_timeout=30)
        await refused_at_once(consumer, counting.address)
    assert counting.stats["connections"] == 1


async def test_a_silent_peer_is_named_once_the_connect_timeout_passes() -> None:
    """A port that accepts connections and says nothing (a listening socket nobody
    serves): the consumer retries until its reconnect timeout, then says what it waited
    for and what the port may be."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        consumer = Consumer(address, "orders", connect_timeout=0.5, reconnect_timeout=1.0)
        try:
            with pytest.raises(streamq.ConnectionLostError) as lost:
                await asyncio.wait_for(consumer.start(), 60)
        finally:
            await consumer.close()
    message = str(lost.value)
    assert message.startswith(f"no connection to {address} within 1 s: no SERVER_HELLO from ")
    assert "within 0.5 s: is a streamq producer listening there, or another service" in message

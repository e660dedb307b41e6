"""Backpressure is TCP flow control: a stalled consumer costs the producer a bounded buffer."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

from streamq import Client, Consumer, Producer, ServerSettings, SyncProducer
from streamq.protocol import (
    PROTOCOL_VERSION,
    ClientConnection,
    ClientHello,
    Records,
    Subscribe,
)

from ..conftest import wait_for
from ..waiting import wait_until

RECORD = b"r" * 1000
TRANSACTIONS = 100
PER_TRANSACTION = 1000  # 100 MB in all


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_stalled_consumer_is_held_back_by_tcp_alone(producer_db: str) -> None:
    settings = ServerSettings()
    async with Producer(producer_db, settings=settings, tail_bytes=4 * 1024 * 1024) as producer:
        await producer.create_stream("orders")
        host, port = producer.address.rsplit(":", 1)
        loop = asyncio.get_running_loop()

        # The stalled consumer: subscribes, then reads nothing until told to.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        stalled.setblocking(False)
        await loop.sock_connect(stalled, (host, int(port)))
        protocol = ClientConnection()
        await loop.sock_sendall(stalled, protocol.send(ClientHello(PROTOCOL_VERSION, "stalled")))
        await loop.sock_sendall(stalled, protocol.send(Subscribe("orders", 1, "stalled", None)))
        server = producer.server
        assert server is not None
        await wait_for(lambda: len(server.subscriptions) == 1, what="the stalled subscription")
        (subscription,) = server.subscriptions

        async with Consumer(producer.address, "orders") as healthy:
            received = 0

            async def drain_healthy() -> None:
                nonlocal received
                async for batch in healthy:
                    received = batch.last_seq
                    if received == TRANSACTIONS * PER_TRANSACTION:
                        return

            draining = asyncio.create_task(drain_healthy())
            baseline = rss_bytes()
            peak_buffered = peak_rss = 0
            for _ in range(TRANSACTIONS):
                async with producer.transaction() as tx:
                    await tx.publish_many("orders", [RECORD] * PER_TRANSACTION)
                peak_buffered = max(peak_buffered, subscription.buffered)
                peak_rss = max(peak_rss, rss_bytes())
            await asyncio.wait_for(draining, 60)

        total = TRANSACTIONS * PER_TRANSACTION
        # Every commit went through and the healthy consumer got everything,
        # while the stalled one took almost nothing.
        assert producer.head("orders") == received == total
        assert subscription.sent < total // 10, subscription.sent
        # What the producer holds for it: the transport buffer, at most one frame over.
        assert peak_buffered <= settings.write_buffer_high + settings.max_batch_bytes
        growth = peak_rss - baseline
        assert growth < 40 * 1024 * 1024, f"RSS grew {growth / 2**20:.0f} MiB for 100 MB committed"

        # Once it reads again, it catches up from SQLite, in order, with nothing missing.
        next_seq = 1
        async with asyncio.timeout(60):
            while next_seq <= total:
                data = await loop.sock_recv(stalled, 1024 * 1024)
                assert data, "producer closed the stalled connection"
                protocol.receive_data(data)
                while (message := protocol.next_event()) is not None:
                    if isinstance(message, Records) and message.records:
                        assert message.records[0].seq == next_seq
                        next_seq = message.records[-1].seq + 1
        stalled.close()
        assert next_seq == total + 1


def test_a_stalled_consumer_does_not_hold_the_producers_close(tmp_path: Path) -> None:
    """A consumer that reads nothing: closing the producer writes SHUTTING_DOWN into a
    socket that takes nothing more, and must not wait for it to be read (uvloop's loop
    close waits for every transport to flush): the connection is aborted after a grace
    second, and close returns."""
    producer = SyncProducer(str(tmp_path / "p.db"))
    stalled = socket.socket()
    try:
        with producer.transaction() as tx:
            tx.publish_many("orders", [RECORD] * 20_000)  # 20 MB: more than any buffer here
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        host, port = producer.address.rsplit(":", 1)
        stalled.connect((host, int(port)))
        protocol = ClientConnection()
        stalled.sendall(protocol.send(ClientHello(PROTOCOL_VERSION, "stalled")))
        stalled.sendall(protocol.send(Subscribe("orders", 1, "stalled", None)))

        # The socket's buffers full: what the producer sent it stops growing. Closing then
        # writes SHUTTING_DOWN into a socket that takes nothing more.
        last = [-1]

        def full() -> bool:
            with Client(producer.address) as client:
                (subscription,) = client.status()["consumers"]
            sent, before, last[0] = subscription["sent"], last[0], subscription["sent"]
            return sent > 0 and sent == before

        wait_until(full, "the stalled consumer's socket buffers to fill", timeout=30)
        closing = threading.Thread(target=producer.close)
        closing.start()
        closing.join(60)
        assert not closing.is_alive(), (
            "the producer's close waited for a consumer that reads nothing"
        )
    finally:
        stalled.close()
        producer.close()

"""Fan-out: the subscribers at the head share one read and one frame per commit round;
one that stops reading is handed back to read for itself, and costs the others nothing."""

from __future__ import annotations

import asyncio
import socket

from streamq import Consumer, Filter, Producer, ServerSettings
from streamq.filters import share_of
from streamq.protocol import (
    PROTOCOL_VERSION,
    ClientConnection,
    ClientHello,
    Records,
    Subscribe,
)

from ..conftest import wait_for

CONSUMERS = 30
COMMITS = 40


async def collect(consumer: Consumer, last: int) -> list[int]:
    seqs: list[int] = []
    async for batch in consumer:
        seqs += [record.seq for record in batch]
        if batch.last_seq >= last:
            return seqs
    raise AssertionError("the consumer ended")


async def test_consumers_at_the_head_share_each_rounds_read_and_frame(producer_db: str) -> None:
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"first")
        consumers = [Consumer(producer.address, "orders") for _ in range(CONSUMERS)]
        for consumer in consumers:
            await consumer.start()
        try:
            tasks = [asyncio.create_task(collect(c, 1 + COMMITS)) for c in consumers]
            server = producer.server
            assert server is not None
            stream = producer.log.streams["orders"]
            await wait_for(
                lambda: (
                    stream in server.fanouts and len(server.fanouts[stream].following) == CONSUMERS
                ),
                what="every consumer at the head",
            )
            fanout = server.fanouts[stream]
            rounds, framed = fanout.rounds, fanout.framed
            for i in range(COMMITS):
                await producer.publish("orders", b"order %d" % i)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            for consumer in consumers:
                await consumer.close()
        assert all(seqs == list(range(1, 2 + COMMITS)) for seqs in results)
        # One read and one frame a round, whatever the number of consumers; commits made
        # while a round was due share it.
        assert 1 <= fanout.rounds - rounds <= COMMITS
        assert fanout.framed - framed == fanout.rounds - rounds


async def test_filters_and_shares_at_the_head_each_get_exactly_their_records(
    producer_db: str,
) -> None:
    keys = [b"k%d" % i for i in range(60)]
    filters = [Filter(share=(i, 3)) for i in range(3)] + [Filter(key_prefix=b"k1"), None]
    async with Producer(producer_db) as producer:
        await producer.create_stream("orders")
        consumers = [Consumer(producer.address, "orders", filter=f) for f in filters for _ in "ab"]
        for consumer in consumers:
            await consumer.start()
        try:
            server = producer.server
            assert server is not None
            stream = producer.log.streams["orders"]
            await wait_for(
                lambda: (
                    stream in server.fanouts
                    and len(server.fanouts[stream].following) == len(consumers)
                ),
                what="every consumer at the head",
            )
            tasks = [asyncio.create_task(collect(c, len(keys))) for c in consumers]
            for key in keys:
                await producer.publish("orders", key, key=key)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            for consumer in consumers:
                await consumer.close()
    for i, seqs in enumerate(results):
        wanted = filters[i // 2]
        expected = [
            seq
            for seq, key in enumerate(keys, 1)
            if wanted is None
            or (wanted.share is not None and share_of(key, 3) == wanted.share[0])
            or (wanted.key_prefix is not None and key.startswith(wanted.key_prefix))
        ]
        # A filtered consumer's last batch may carry only progress (no record) up to the head.
        assert [s for s in seqs if s] == expected, (wanted, seqs)


async def test_a_stalled_consumer_among_consumers_at_the_head_costs_them_nothing(
    producer_db: str,
) -> None:
    settings = ServerSettings(write_buffer_high=64 * 1024, max_batch_bytes=64 * 1024)
    record = b"r" * 1000
    per_commit, commits = 200, 100  # 20 MB: far beyond both sockets' buffers
    async with Producer(producer_db, settings=settings) as producer:
        await producer.create_stream("orders")
        host, port = producer.address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        stalled.setblocking(False)
        await loop.sock_connect(stalled, (host, int(port)))
        protocol = ClientConnection()
        await loop.sock_sendall(stalled, protocol.send(ClientHello(PROTOCOL_VERSION, "stalled")))
        await loop.sock_sendall(stalled, protocol.send(Subscribe("orders", 1, "stalled", None)))
        healthy = [Consumer(producer.address, "orders") for _ in range(5)]
        for consumer in healthy:
            await consumer.start()
        server = producer.server
        assert server is not None
        stream = producer.log.streams["orders"]
        await wait_for(
            lambda: stream in server.fanouts and len(server.fanouts[stream].following) == 6,
            what="every consumer at the head",
        )
        (sub,) = [s for s in server.subscriptions if s.consumer == "stalled"]
        fanout = server.fanouts[stream]
        try:
            total = per_commit * commits
            tasks = [asyncio.create_task(collect(c, total)) for c in healthy]
            peak = 0
            for _ in range(commits):
                async with producer.transaction() as tx:
                    await tx.publish_many("orders", [record] * per_commit)
                peak = max(peak, sub.buffered)
                await asyncio.sleep(0)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(seqs == list(range(1, total + 1)) for seqs in results)
            # Handed back at its high-water mark, with at most one frame more held for it.
            assert sub not in fanout.following
            assert sub.sent < total // 2
            assert peak <= settings.write_buffer_high + settings.max_batch_bytes + 4096

            # It reads again: it catches up on its own, then is served at the head again.
            seqs: list[int] = []
            while len(seqs) < total:
                data = await asyncio.wait_for(loop.sock_recv(stalled, 1 << 20), 10)
                assert data, "the producer closed the stalled connection"
                protocol.receive_data(data)
                while (event := protocol.next_event()) is not None:
                    if isinstance(event, Records):
                        seqs += [r.seq for r in event.records]
            assert seqs == list(range(1, total + 1))
            await wait_for(lambda: sub in fanout.following, what="the stalled one at the head")
        finally:
            stalled.close()
            for consumer in healthy:
                await consumer.close()

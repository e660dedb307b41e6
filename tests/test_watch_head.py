"""WATCH_HEAD (docs/protocol.md, "WATCH_HEAD → STREAM_INFO"): a request answered once the
stream's head moves beyond the head the client knows, at once when another request
follows it, and at the latest after the heartbeat interval; what lets the Spark driver
learn of new records without asking every producer at every trigger."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import streamq
from streamq import ServerSettings, UnknownStreamError
from streamq.protocol import GetHead, StreamInfo

from .waiting import producer_connections, wait_until


def test_a_head_beyond_is_answered_at_once(tmp_path: Path) -> None:
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        producer.publish("orders", b"2")
        with streamq.Client(producer.address, timeout=10) as client:
            client.watch_head("orders", 1)
            assert client.watched() == StreamInfo("orders", 2, 1)
            assert client.watching is None


def test_a_commit_answers_the_watch(tmp_path: Path) -> None:
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=10) as client:
            client.watch_head("orders", 1)
            assert client.watching is not None
            assert not client.answer_ready  # the heartbeat interval is 5 s
            producer.publish("orders", b"2")
            wait_until(lambda: client.answer_ready, "the watch's answer")
            assert client.watched().head == 2
            # Watched again at the new head: the client's own commit in another process
            # counts the same (the producer's watcher finds it).
            client.watch_head("orders", 2)
            with streamq.SyncProducer(str(tmp_path / "a.db"), serve=False) as writer:
                writer.publish("orders", b"3")
            assert client.watched().head == 3


def test_a_request_after_the_watch_ends_it_and_is_answered(tmp_path: Path) -> None:
    """Requests pipelined after WATCH_HEAD: its answer comes at once, head as it is, then
    theirs; the client's other requests read past it on their own."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=10) as client:
            client.watch_head("orders", 1)
            client.send_requests(GetHead("orders"))
            assert client.next_answer() == StreamInfo("orders", 1, 1)  # GET_HEAD's
            assert client.watched() == StreamInfo("orders", 1, 1)  # kept as it came
            client.watch_head("orders", 1)
            batches = list(client.read_range("orders", 1, 2))
            assert batches[0][0].value == b"1"
            assert client.watching is None
            assert client.watched().head == 1


def test_an_idle_watch_is_answered_after_the_heartbeat_interval(tmp_path: Path) -> None:
    settings = ServerSettings(heartbeat_interval=0.2)
    with streamq.SyncProducer(str(tmp_path / "a.db"), settings=settings) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=10) as client:
            for _ in range(2):
                client.watch_head("orders", 1)
                since = time.monotonic()
                assert client.watched() == StreamInfo("orders", 1, 1)  # blocks until then
                assert time.monotonic() - since >= 0.15


def test_an_unknown_stream_is_an_error(tmp_path: Path) -> None:
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=10) as client:
            client.watch_head("ordres", 0)
            with pytest.raises(UnknownStreamError, match="unknown stream 'ordres'"):
                client.watched()
            assert client.closed


def test_a_client_that_closes_while_watched_leaves_nothing_behind(tmp_path: Path) -> None:
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        address = producer.address
        for _ in range(3):
            with streamq.Client(address, timeout=10) as client:
                client.watch_head("orders", 1)
                wait_until(lambda: producer_connections(address) == 2, "the watch served")
            wait_until(lambda: producer_connections(address) == 1, "the watch's end")
        producer.publish("orders", b"2")
        assert producer.head("orders") == 2

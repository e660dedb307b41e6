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
from streamq.protocol import GetHead, ReportPosition, StreamInfo
from streamq.wire.client import answers_ready

from ..waiting import producer_connections, wait_until


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


def test_requests_told_before_a_watch_are_not_waited_for(tmp_path: Path) -> None:
    """``watch_head(stream, head, *told)``: requests whose answers nobody reads (a position
    report) go first, in the same write; the watch waiting before is replaced, its answer
    dropped with theirs, and the new watch's is the one read. An ERROR among them raises
    from the next read."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=10) as client:
            client.send_requests(GetHead("orders"))
            with pytest.raises(RuntimeError, match="answers still to read"):
                client.watch_head("orders", 1)
            assert client.next_answer() == StreamInfo("orders", 1, 1)
            client.watch_head("orders", 1)
            client.watch_head("orders", 1, ReportPosition("orders", "spark", 1))
            with streamq.Client(producer.address, timeout=10) as status:

                def applied() -> list[int]:
                    return [p["applied"] for p in status.status()["positions"]]

                wait_until(lambda: applied() == [1], "the told report applied")
            # The dropped answers have come (the producer answered both at once); the new
            # watch's has not, and is read once a commit moves the head.
            assert not client.watch_answered()
            producer.publish("orders", b"2")
            wait_until(client.watch_answered, "the new watch's answer")
            assert client.watched() == StreamInfo("orders", 2, 1)
            client.watch_head("orders", 2, ReportPosition("ordres", "spark", 1))
            with pytest.raises(UnknownStreamError, match="unknown stream 'ordres'"):
                client.watched()
            assert client.closed


def test_an_idle_watch_is_answered_after_the_heartbeat_interval(tmp_path: Path) -> None:
    """Between half the interval and the whole, at random: watches sent together come
    back spread out (a Spark driver's to hundreds of producers after a batch)."""
    settings = ServerSettings(heartbeat_interval=0.4)
    with streamq.SyncProducer(str(tmp_path / "a.db"), settings=settings) as producer:
        producer.publish("orders", b"1")
        clients = [streamq.Client(producer.address, timeout=10) for _ in range(8)]
        try:
            for client in clients:
                client.watch_head("orders", 1)
            since, answered = time.monotonic(), {}
            while len(answered) < len(clients) and time.monotonic() - since < 10:
                for client in answers_ready(clients, time.monotonic() + 0.001):
                    answered.setdefault(id(client), time.monotonic() - since)
            assert len(answered) == len(clients)
            assert min(answered.values()) >= 0.15
            assert max(answered.values()) - min(answered.values()) >= 0.02
            for client in clients:
                assert client.watched() == StreamInfo("orders", 1, 1)
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize(
    ("idle_timeout", "wait", "within"),
    [(40.0, 0.3, 10.0), (2.0, None, 20.0), (2.0, 60.0, 20.0)],
    ids=["wait_ms", "capped-heartbeat", "capped-wait_ms"],
)
def test_a_watch_waits_as_long_as_the_client_asks_within_the_idle_timeout(
    tmp_path: Path, idle_timeout: float, wait: float | None, within: float
) -> None:
    """``wait_ms`` in place of the heartbeat interval (60 s here): answered at once would
    be too soon, and after the interval, or half the idle timeout, too late. Never
    beyond half the idle timeout, which would close a connection that only waits."""
    settings = ServerSettings(heartbeat_interval=60, idle_timeout=idle_timeout)
    with streamq.SyncProducer(str(tmp_path / "a.db"), settings=settings) as producer:
        producer.publish("orders", b"1")
        with streamq.Client(producer.address, timeout=30) as client:
            client.watch_head("orders", 1, wait=wait)
            since = time.monotonic()
            wait_until(client.watch_answered, "the watch's answer", timeout=within)
            expected = min(wait or 60, idle_timeout / 2)
            assert time.monotonic() - since >= expected / 2 - 0.05
            assert client.watched() == StreamInfo("orders", 1, 1)
            assert not client.closed


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

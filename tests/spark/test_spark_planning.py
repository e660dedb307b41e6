"""The Spark source's driver-side planning, as plain functions (no Spark, real producers)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import socketserver
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable

import streamq
import streamq.producer.server
from bench.spark.streamq import Fleet, _fill_producers
from bench.tools import discovery, triggers
from spark_source import datasource, planning
from spark_source.datasource import StreamQStreamReader, _Settings
from spark_source.planning import Connect, ProducerState, Range, StreamQSourceError
from streamq.errors import MalformedFrameError
from streamq.wire.transport import parse_address

from ..hosted import hosted, unread
from ..waiting import producer_connections, wait_until

STATES = {
    "a": ProducerState("a", "h:1", head=100, low=1),
    "b": ProducerState("b", "h:2", head=10, low=5),
}


@given(
    backlog=st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 10_000), max_size=8),
    max_rows=st.integers(1, 20_000),
)
def test_limit_shares_max_rows_in_proportion(backlog: dict[str, int], max_rows: int) -> None:
    start = {pid: 7 for pid in backlog}
    end = {pid: 7 + b for pid, b in backlog.items()}
    limited = planning.limit(start, end, max_rows)
    taken = {pid: limited[pid] - start[pid] for pid in backlog}
    total = sum(backlog.values())
    assert sum(taken.values()) == min(total, max_rows)
    for pid, b in backlog.items():
        assert 0 <= taken[pid] <= b
        if total > max_rows:  # within one record of the exact proportional share
            assert abs(taken[pid] - max_rows * b / total) < 1


@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    min_partitions=st.integers(1, 16),
    max_per_partition=st.integers(1, 3000),
)
def test_plan_covers_every_seq_once_and_balances(
    sizes: list[int], min_partitions: int, max_per_partition: int
) -> None:
    ranges = [Range(f"p{i}", f"h:{i}", 10, 10 + size) for i, size in enumerate(sizes)]
    planned = planning.plan(ranges, min_partitions, max_per_partition)
    for r in ranges:
        pieces = sorted((p.start, p.end) for p in planned if p.producer_id == r.producer_id)
        covered = [seq for a, b in pieces for seq in range(a, b)]
        assert covered == list(range(r.start, r.end))
        if pieces:  # equal pieces: sizes differ by at most one
            lengths = [b - a for a, b in pieces]
            assert max(lengths) - min(lengths) <= 1
            assert max(lengths) <= max(max_per_partition, 1) or len(pieces) == r.size
    total = sum(sizes)
    if total:
        assert len(planned) >= min(min_partitions, total) - len(sizes)


@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40),
    min_partitions=st.integers(1, 16),
    max_per_partition=st.integers(1, 20000),
)
def test_pack_reads_every_piece_once_in_few_balanced_partitions(
    sizes: list[int], min_partitions: int, max_per_partition: int
) -> None:
    ranges = [Range(f"p{i:02}", f"h:{i}", 10, 10 + size) for i, size in enumerate(sizes)]
    pieces = planning.plan(ranges, min_partitions, max_per_partition)
    packed = planning.pack(pieces, min_partitions, max_per_partition)

    def order(r: Range) -> tuple[str, int]:
        return r.producer_id, r.start

    assert sorted((r for task in packed for r in task), key=order) == sorted(pieces, key=order)
    total = sum(sizes)
    if not total:
        assert packed == []
        return
    assert all(packed)
    wanted = max(min_partitions, -(-total // max_per_partition))
    assert len(packed) == min(wanted, len(pieces))
    loads = [sum(r.size for r in task) for task in packed]
    assert max(loads) - min(loads) <= max(p.size for p in pieces)
    for task in packed:  # in producer order within a partition
        assert task == sorted(task, key=order)


def test_resolve_offsets() -> None:
    assert planning.resolve("earliest", STATES, "startingOffsets") == {"a": 1, "b": 5}
    assert planning.resolve("latest", STATES, "startingOffsets") == {"a": 101, "b": 11}
    spec = json.dumps({"a": 50, "b": -1})
    assert planning.resolve(spec, STATES, "startingOffsets") == {"a": 50, "b": 11}
    assert planning.resolve('{"a": -2}', STATES, "x") == {"a": 1, "b": 5}
    with pytest.raises(StreamQSourceError, match="names producers no endpoint serves"):
        planning.resolve('{"zzz": 3}', STATES, "startingOffsets")
    with pytest.raises(StreamQSourceError, match="must be 'earliest', 'latest' or a JSON map"):
        planning.resolve("first", STATES, "startingOffsets")


def test_vanished_or_regressed_producers_are_errors() -> None:
    planning.check_producers({"a": 101, "b": 5}, STATES)
    with pytest.raises(StreamQSourceError, match=r"producer zzz, read up to seq 8, is at none"):
        planning.check_producers({"zzz": 9}, STATES)
    with pytest.raises(StreamQSourceError, match="has head 10, but the query already read up to"):
        planning.check_producers({"b": 20}, STATES)


def test_endpoints_from_list_and_file(tmp_path: Path) -> None:
    listing = tmp_path / "endpoints.txt"
    listing.write_text("# producers\nh:3\n\nh:1  # again\n")
    assert planning.parse_endpoints("h:1, h:2", str(listing)) == ["h:1", "h:2", "h:3"]
    with pytest.raises(StreamQSourceError, match="set option 'endpoints'"):
        planning.parse_endpoints(None, None)
    # Read anew at every call (each text parsed once): a producer added joins, a bad line
    # fails the call even after the same file parsed well.
    listing.write_text("h:3\nh:4\n")
    assert planning.parse_endpoints("h:1, h:2", str(listing)) == ["h:1", "h:2", "h:3", "h:4"]
    listing.write_text("h:3\nh\n")
    for _ in range(2):
        with pytest.raises(StreamQSourceError, match="endpoints: "):
            planning.parse_endpoints("h:1", str(listing))


def test_discover_real_producers(tmp_path: Path) -> None:
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
    ):
        a.publish("orders", b"x")
        b.create_stream("orders")
        states = planning.discover([a.address, b.address], "orders", Connect(timeout=10))
        assert states == {
            a.producer_id: ProducerState(a.producer_id, a.address, 1, 1),
            b.producer_id: ProducerState(b.producer_id, b.address, 0, 1),  # nothing published
        }
        with pytest.raises(StreamQSourceError, match="serve the same producer"):
            planning.discover(
                [a.address, a.address.replace("127.0.0.1", "localhost")], "orders", Connect(10)
            )
    with pytest.raises(StreamQSourceError, match=f"producer at {a.address}: cannot connect"):
        planning.discover([a.address], "orders", Connect(timeout=10))


def test_discovery_asks_all_at_once_and_an_error_costs_only_its_producer(tmp_path: Path) -> None:
    """Kept connections, questions pipelined to every producer: one producer whose answer
    is an ERROR (the query's position beyond its head: lost commits) goes on over a new
    connection, and the others' answers in the same round stand."""
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
        streamq.SyncProducer(str(tmp_path / "c.db")) as c,
    ):
        for producer in (a, b, c):
            producer.publish("orders", b"x")
        endpoints = [a.address, b.address, c.address]
        kept = planning.Connections(Connect(timeout=10))
        try:
            first = planning.discover(endpoints, "orders", kept, {})
            epoch = first[b.producer_id].epoch
            assert epoch is not None
            positions = {
                a.producer_id: planning.Position(2, first[a.producer_id].epoch),  # at the head
                b.producer_id: planning.Position(9, epoch),  # beyond it: 2..8 lost
                c.producer_id: planning.Position(1),  # nothing read yet
            }
            states = planning.discover(endpoints, "orders", kept, positions)
            assert [states[p.producer_id].lost for p in (a, b, c)] == [None, range(2, 9), None]
            assert all(states[p.producer_id].head == 1 for p in (a, b, c))
            taken = [kept.take(e) for e in endpoints]  # every connection kept, b's anew
            for client in taken:
                assert client is not None
                kept.keep(client.address, client)
        finally:
            kept.close()


def test_an_idle_trigger_asks_no_producer_whose_watch_is_quiet(tmp_path: Path) -> None:
    """Streaming discovery leaves each kept connection watching its producer's head
    (WATCH_HEAD): while no answer comes, a trigger asks that producer nothing and its
    state stands; a commit answers the watch, and that producer alone is asked again."""
    with watched_pair(tmp_path) as (a, b, kept, first, positions):
        endpoints = [a.address, b.address]
        armed = {e: kept.watches[e].since for e in endpoints}
        for _ in range(3):
            assert planning.discover(endpoints, "orders", kept, positions) == first
            assert {e: kept.watches[e].since for e in endpoints} == armed  # none sent
        a.publish("orders", b"new")
        wait_until(
            lambda: (
                planning.discover(endpoints, "orders", kept, positions)[a.producer_id]
                == ProducerState(a.producer_id, a.address, 2, 1, first[a.producer_id].epoch)
            ),
            "the new head",
        )
        assert kept.watches[b.address].since == armed[b.address]
        assert kept.watches[a.address].since > armed[a.address]  # asked, watched anew


def test_the_watches_are_one_poll_that_names_what_can_be_read(tmp_path: Path) -> None:
    """``Connections.answered``: the kept connections watching their producers' heads are
    polled at once, and name the endpoints with something to read: a watch's answer until
    a discovery reads it, a connection the producer ended."""
    with watched_pair(tmp_path) as (a, b, kept, first, positions):
        endpoints = [a.address, b.address]
        assert kept.answered() == set()
        a.publish("orders", b"new")
        wait_until(lambda: kept.answered() == {a.address}, "a's watch to answer")
        assert kept.answered() == {a.address}  # until it is read
        states = planning.discover(endpoints, "orders", kept, positions)
        assert states[a.producer_id].head == 2 and states[b.producer_id] == first[b.producer_id]
        assert kept.answered() == set()  # read, and watching again
        b.close()  # its connections end
        wait_until(lambda: kept.answered() == {b.address}, "b's end to show")


@contextlib.contextmanager
def watched_pair(
    tmp_path: Path,
) -> Iterator[
    tuple[
        streamq.SyncProducer,
        streamq.SyncProducer,
        planning.Connections,
        dict[str, ProducerState],
        dict[str, planning.Position],
    ]
]:
    """Two producers with a record each, found by a streaming query's discovery: (a, b,
    the connections it keeps, watching each head, the states, the query's positions)."""
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
    ):
        for producer in (a, b):
            producer.publish("orders", b"x")
        kept = planning.Connections(Connect(timeout=10))
        try:
            first = planning.discover([a.address, b.address], "orders", kept, {})
            positions = {pid: planning.Position(2, s.epoch) for pid, s in first.items()}
            yield a, b, kept, first, positions
        finally:
            kept.close()


def test_a_watch_is_believed_for_a_while_then_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch that stays unanswered past ``WATCH_TRUST`` (a producer answers within its
    heartbeat interval) is not believed: the producer is asked, which finds a peer that
    went away without a word."""
    monkeypatch.setattr(planning, "WATCH_TRUST", 0.0)
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"x")
        kept = planning.Connections(Connect(timeout=10))
        try:
            first = planning.discover([a.address], "orders", kept, {})
            positions = {a.producer_id: planning.Position(2, first[a.producer_id].epoch)}
            armed = kept.watches[a.address].since
            assert planning.discover([a.address], "orders", kept, positions) == first
            assert kept.watches[a.address].since > armed
        finally:
            kept.close()


def test_a_producer_restarted_while_watched_is_asked_on_a_new_connection(tmp_path: Path) -> None:
    db = str(tmp_path / "a.db")
    with streamq.SyncProducer(db) as a:
        address, pid = a.address, a.producer_id
        port = parse_address(address)[1]
        a.publish("orders", b"1")
        kept = planning.Connections(Connect(timeout=10))
        first = planning.discover([address], "orders", kept, {})
        positions = {pid: planning.Position(2, first[pid].epoch)}
    try:
        with streamq.SyncProducer(db, port=port) as restarted:
            restarted.publish("orders", b"2")
            wait_until(
                lambda: planning.discover([address], "orders", kept, positions)[pid].head == 2,
                "the restarted producer's head",
            )
            assert producer_connections(address) == 2  # this one and the driver's new one
    finally:
        kept.close()


def test_a_producer_that_refuses_watches_is_asked_every_trigger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer of a version before WATCH_HEAD answers it MALFORMED_FRAME (an unknown
    message type) and closes: the driver stops watching it, and asks it at every trigger
    on one kept connection, as before."""

    def refuse(*args: object) -> None:
        raise MalformedFrameError("unknown message type 21")

    monkeypatch.setattr(streamq.producer.server._HeadWatch, "wait", refuse)
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        address, pid = a.address, a.producer_id
        kept = planning.Connections(Connect(timeout=10))
        try:
            for head in range(1, 5):
                a.publish("orders", b"x")
                positions = {pid: planning.Position(head)}  # behind the head: two rounds
                assert planning.discover([address], "orders", kept, positions)[pid].head == head
            assert kept.unwatchable == {address}
            assert kept.watches == {}
            assert producer_connections(address) == 2  # this one and the driver's
        finally:
            kept.close()


def test_a_known_producer_that_is_down_is_its_known_state_until_it_is_back(
    tmp_path: Path,
) -> None:
    """A running query's producer that cannot be reached is its last known state, marked
    ``down`` (the query goes on with the others), tried again after 1 s, then 2, 4...; once
    back, it is asked as before. One the query never reached is an error, as ever."""
    db = str(tmp_path / "b.db")
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"x")
        kept = planning.Connections(Connect(timeout=10))
        try:
            with streamq.SyncProducer(db) as b:
                b.publish("orders", b"x")
                endpoints, port = [a.address, b.address], parse_address(b.address)[1]
                known = planning.discover(endpoints, "orders", kept, {})
            positions = {pid: planning.Position(2, s.epoch) for pid, s in known.items()}
            states = planning.discover(endpoints, "orders", kept, positions, known=known)
            down = states[b.producer_id].down
            assert down is not None and f"producer at {b.address}" in down
            assert states == {**known, b.producer_id: replace(known[b.producer_id], down=down)}
            assert kept.retry[b.address][1] == planning.RETRY_FIRST
            due = kept.retry[b.address][0]
            # Not due yet: not asked (the wait stays); due: asked, and the wait doubles.
            states = planning.discover(endpoints, "orders", kept, positions, known=states)
            assert states[b.producer_id].down and kept.retry[b.address][0] == due
            kept.retry[b.address] = (0.0, kept.retry[b.address][1])
            planning.discover(endpoints, "orders", kept, positions, known=states)
            assert kept.retry[b.address][1] == 2 * planning.RETRY_FIRST
            with streamq.SyncProducer(db, port=port) as restarted:
                restarted.publish("orders", b"more")
                kept.retry[b.address] = (0.0, kept.retry[b.address][1])
                states = planning.discover(endpoints, "orders", kept, positions, known=states)
                back, before = states[b.producer_id], known[b.producer_id]
                assert (back.head, back.down, back.lost) == (2, None, None)
                assert back.epoch is not None and before.epoch is not None
                assert back.epoch > before.epoch  # a restart's epoch wrote seq 2
                assert b.address not in kept.retry
            with pytest.raises(StreamQSourceError, match=f"producer at {b.address}: cannot"):
                planning.discover(endpoints, "orders", kept, positions, known={})
        finally:
            kept.close()


def test_a_known_producer_slow_to_answer_is_passed_over_until_it_answers(
    tmp_path: Path,
) -> None:
    """A running query's producer that is connected but does not answer within
    ``Connect.patience`` (paused: SIGSTOP) is its known state marked ``down`` after that
    wait, not the request timeout, and the others are read; its connection keeps owing
    the answers, and once they come a later trigger reads them and asks it again. One
    that does not even say hello in that time is down (tried again later)."""
    db = str(tmp_path / "b.db")
    with streamq.SyncProducer(db, serve=False) as b:
        b.publish("orders", b"x")
    connect = Connect(timeout=20, patience=0.5)
    kept = planning.Connections(connect)
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a, hosted(db) as (b_id, address, b):
        try:
            a.publish("orders", b"x")
            endpoints = [a.address, address]
            known = planning.discover(endpoints, "orders", kept, {})
            positions = {pid: planning.Position(2, s.epoch) for pid, s in known.items()}
            a.publish("orders", b"y")
            with sqlite3.connect(db) as conn:  # another process's commit: b's watch answers
                streamq.publish(conn, "orders", b"y")
            wait_until(lambda: kept._open[address].answer_ready, "b's watch to answer")
            b.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            states = planning.discover(endpoints, "orders", kept, positions, known=known)
            assert time.monotonic() - began < connect.timeout / 2
            assert states[a.producer_id].head == 2
            late = states[b_id]
            assert late.down == f"producer at {address}: no answer within 0.5 s"
            assert late == replace(known[b_id], down=late.down)
            assert set(kept.late) == {address}
            # Still paused: passed over at once, not waited for again.
            states = planning.discover(endpoints, "orders", kept, positions, known=states)
            assert states[b_id].down == late.down and set(kept.late) == {address}
            b.send_signal(signal.SIGCONT)
            wait_until(lambda: kept.late[address].client.answer_ready, "b's late answers")
            states = planning.discover(endpoints, "orders", kept, positions, known=states)
            assert (states[b_id].head, states[b_id].down) == (2, None)
            assert kept.late == {} and address in kept._open
            # Paused before its hello: down, and tried again after RETRY_FIRST.
            b.send_signal(signal.SIGSTOP)
            fresh = planning.Connections(connect)
            try:
                states = planning.discover(endpoints, "orders", fresh, positions, known=states)
                down = states[b_id].down
                assert down is not None and "cannot connect" not in down, down
                assert f"no SERVER_HELLO from {address} within" in down, down
                assert fresh.retry[address][1] == planning.RETRY_FIRST
            finally:
                fresh.close()
        finally:
            kept.close()


def test_a_trigger_goes_on_without_a_producer_that_is_down_but_not_under_available_now(
    tmp_path: Path,
) -> None:
    """The stream reader, driven as Spark drives it: a trigger after a producer stopped
    carries that producer's offset forward and reads the other's new records; a
    ``Trigger.AvailableNow`` run fails naming it, having promised what was there at its
    start."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"x")
        with streamq.SyncProducer(str(tmp_path / "b.db")) as b:
            b.publish("orders", b"x")
            options = {"endpoints": f"{a.address},{b.address}", "stream": "orders"}
            running = StreamQStreamReader(_Settings({**options, "startingOffsets": "earliest"}))
            available_now = StreamQStreamReader(_Settings(options))
            start = running.initialOffset()
            first = running.latestOffset(start, ReadAllAvailable())
            assert planning.split_offset(first)[0] == {a.producer_id: 2, b.producer_id: 2}
            available_now.prepareForTriggerAvailableNow()
            now_start = available_now.initialOffset()
        a.publish("orders", b"y")
        watching = running.connections()._open[a.address]
        wait_until(watching.watch_answered, "a's watch to answer")
        try:
            seqs = planning.split_offset(running.latestOffset(first, ReadAllAvailable()))[0]
            assert seqs == {a.producer_id: 3, b.producer_id: 2}
            with pytest.raises(StreamQSourceError, match=f"producer at {b.address}: cannot"):
                available_now.latestOffset(now_start, ReadAllAvailable())
        finally:
            running.stop()
            available_now.stop()


def test_reports_told_in_one_trigger_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``TOLD_PER_TRIGGER``, reports to producers a trigger does not ask wait for a
    later one: the trigger after a batch over a thousand producers writes to a few."""
    monkeypatch.setattr(planning, "TOLD_PER_TRIGGER", 1)
    with watched_pair(tmp_path) as (a, b, kept, known, positions):
        endpoints = [a.address, b.address]
        unreported = {pid: 1 for pid in known}
        for _ in range(2):
            reports = planning.Reports("spark", dict(unreported))
            assert planning.discover(endpoints, "orders", kept, positions, reports) == known
            assert len(reports.sent) == 1 and reports.told == 1
            del unreported[reports.sent.pop()]
        assert unreported == {}
        wait_until(lambda: [applied(a.address), applied(b.address)] == [[1], [1]], "reports")


def test_the_initial_offset_is_found_once(tmp_path: Path) -> None:
    """Spark asks for it again as it plans the first batch: with ``latest`` and a commit
    in between, a second discovery would start the query after that commit, never read."""
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"x")
        reader = StreamQStreamReader(_Settings({"endpoints": a.address, "stream": "orders"}))
        try:
            first = reader.initialOffset()
            a.publish("orders", b"y")
            assert reader.initialOffset() == first
            assert planning.split_offset(first)[0] == {a.producer_id: 2}
        finally:
            reader.stop()


def counted_discoveries(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The endpoints of each ``planning.discover`` from now on, in a list kept up to date."""
    discoveries = []
    real = planning.discover

    def counted(*args: Any, **kwargs: Any) -> dict[str, ProducerState]:
        discoveries.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "discover", counted)
    return discoveries


TRUST = 3.0  # s a watch is believed, for the test below


def test_an_idle_trigger_repeats_without_a_pass_over_the_producers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a trigger finds every producer's watch quiet and nothing moved, the next ones
    at the same position are answered without a discovery, until something could have
    changed: a commit (the watch answers), a producer listed anew, a watch past belief."""
    discoveries = counted_discoveries(monkeypatch)
    monkeypatch.setattr(planning, "WATCH_TRUST", TRUST)
    listed = tmp_path / "endpoints"
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
    ):
        for producer in (a, b):
            producer.publish("orders", b"x")
        listed.write_text(a.address + "\n")
        options = {"endpointsFile": str(listed), "stream": "orders", "startingOffsets": "latest"}
        reader = StreamQStreamReader(_Settings(options))
        try:
            start = reader.initialOffset()

            def trigger(offset: dict[str, Any]) -> bool:
                """Whether a trigger at ``offset`` (finding it unmoved) asked the producers."""
                asked = len(discoveries)
                assert reader.latestOffset(dict(offset), ReadAllAvailable()) == offset
                return len(discoveries) > asked

            def settled(offset: dict[str, Any]) -> None:
                """Asked until the watches are quiet (answers read, reports sent: a few
                triggers after a change), then repeated."""
                wait_until(lambda: not any(trigger(offset) for _ in range(3)), "repeats")

            assert trigger(start)  # asks, watches
            settled(start)
            a.publish("orders", b"y")  # its watch answers: the next trigger asks
            kept = reader.connections().peek(a.address)
            assert kept is not None
            wait_until(lambda: kept.answer_ready, "a's watch to answer")
            moved = reader.latestOffset(start, ReadAllAvailable())
            assert planning.split_offset(moved)[0] == {a.producer_id: 3}
            settled(moved)

            listed.write_text(f"{a.address}\n{b.address}\n")  # b listed: asked at once
            both = reader.latestOffset(moved, ReadAllAvailable())
            assert planning.split_offset(both)[0] == {a.producer_id: 3, b.producer_id: 2}
            settled(both)
            wait_until(lambda: trigger(both), "a watch past belief to be asked", TRUST + 10)
        finally:
            reader.stop()


def test_an_idle_query_repeats_through_watches_renewed_and_reports_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query idle at the head goes on repeating its idle triggers (no discovery) as its
    producers answer their watches at the wait's end, the head unchanged: only those
    connections are read and watch again, with the query's position told again on the
    way once it was heard long enough ago. A commit still moves the next offset."""
    discoveries = counted_discoveries(monkeypatch)
    monkeypatch.setattr(planning, "WATCH_WAIT", 0.4)  # answered within 0.2 to 0.4 s
    monkeypatch.setattr(datasource, "_REPORT_AGAIN", 0.3)
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
    ):
        for producer in (a, b):
            producer.publish("orders", b"x")
        options = {
            "endpoints": f"{a.address},{b.address}",
            "stream": "orders",
            "startingOffsets": "earliest",
        }
        reader = StreamQStreamReader(_Settings(options))
        try:
            read = reader.latestOffset(reader.initialOffset(), ReadAllAvailable())
            assert planning.split_offset(read)[0] == {a.producer_id: 2, b.producer_id: 2}

            def trigger() -> bool:
                """Whether an idle trigger at ``read`` asked the producers."""
                asked = len(discoveries)
                assert reader.latestOffset(dict(read), ReadAllAvailable()) == read
                return len(discoveries) > asked

            wait_until(lambda: not any(trigger() for _ in range(3)), "idle triggers to repeat")
            kept = reader.connections()
            since = {e: kept.watches[e].since for e in (a.address, b.address)}
            heard = {e: heard_of(e) for e in since}
            asked = len(discoveries)

            def renewed_and_heard() -> bool:
                trigger()
                return all(
                    kept.watches[e].since > since[e] and heard_of(e)[1] > heard[e][1] for e in since
                )

            wait_until(renewed_and_heard, "watches renewed and positions told again")
            assert len(discoveries) == asked
            assert all(heard_of(e)[0] == 1 for e in since)
            a.publish("orders", b"y")
            wait_until(lambda: reader.latestOffset(dict(read), ReadAllAvailable()) != read, "a")
            assert len(discoveries) > asked
        finally:
            reader.stop()


def test_a_query_starting_under_available_now_asks_its_producers_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``initialOffset`` and ``prepareForTriggerAvailableNow`` share one discovery: where
    ``latest`` starts is what Trigger.AvailableNow promises to read, so the first batch
    is empty; a record committed after it is not in the run."""
    discoveries = counted_discoveries(monkeypatch)
    with streamq.SyncProducer(str(tmp_path / "a.db")) as a:
        a.publish("orders", b"x")
        reader = StreamQStreamReader(_Settings({"endpoints": a.address, "stream": "orders"}))
        try:
            reader.prepareForTriggerAvailableNow()
            start = reader.initialOffset()
            assert len(discoveries) == 1
            assert planning.split_offset(start)[0] == {a.producer_id: 2}
            a.publish("orders", b"y")
            end = reader.latestOffset(start, ReadAllAvailable())
            assert planning.split_offset(end)[0] == {a.producer_id: 2}  # the promise's end
            assert len(discoveries) == 2
        finally:
            reader.stop()


def heard_of(address: str) -> tuple[int, int]:
    """What the producer last heard of the query: (the seq it applied, when, in ms since
    the epoch)."""
    with streamq.Client(address) as client:
        (position,) = client.status()["positions"]
    return int(position["applied"]), int(position["updated_at"])


def test_a_watching_connection_has_tcp_keepalive(tmp_path: Path) -> None:
    """A producer whose machine crashed never answers its watch: the kernel's keepalive
    probes end the connection instead, for the next trigger's poll to find."""
    with watched_pair(tmp_path) as (a, b, kept, _, _):
        for endpoint in (a.address, b.address):
            client = kept.peek(endpoint)
            assert client is not None
            sock = socket.socket(fileno=os.dup(client.fileno()))
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                idle, interval, probes = planning.KEEP_ALIVE
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == interval
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == probes
            finally:
                sock.close()


def test_the_discovery_tool_measures_a_fleet(tmp_path: Path) -> None:
    fleet = Fleet(_fill_producers(tmp_path, 3, 30))
    try:
        figures = discovery.measure(fleet, 2)
    finally:
        fleet.stop()
    assert [case for case in figures] == [
        f"{case} {figure}" for case in ("idle", "behind") for figure in ("median", "max", "cpu")
    ]
    assert all(value > 0 for value in figures.values())


def test_the_triggers_tool_measures_a_fleet(tmp_path: Path) -> None:
    fleet = Fleet(_fill_producers(tmp_path, 3, 30))
    try:
        walls = triggers.measure(fleet.endpoints, 3, 0.0)
    finally:
        fleet.stop()
    assert list(walls) == list(triggers.STEPS)
    assert all(len(w) == 3 and all(t > 0 for t in w) for w in walls.values())
    assert all(walls["trigger"][i] >= walls["latestOffset"][i] for i in range(3))


def test_a_stream_missing_on_any_producer_is_an_error_naming_each(tmp_path: Path) -> None:
    """A misspelt stream, or one a producer lacks, is no empty read: the error names the
    stream asked for, and each producer lacking it with the streams it has (only those
    the query's token may read)."""
    secret = b"planning-test-secret-0123"
    secured = streamq.ServerSettings(auth=streamq.TokenAuth(secret, {"analytics": ["sale*"]}))
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
        streamq.SyncProducer(str(tmp_path / "c.db"), settings=secured) as c,
        streamq.SyncProducer(str(tmp_path / "d.db")) as d,
    ):
        a.publish("sales", b"x")
        b.create_stream("sales")
        b.create_stream("returns")
        c.publish("sales", b"y")
        c.publish("secret", b"z")
        connect = Connect(timeout=10)
        with pytest.raises(StreamQSourceError) as one:
            planning.discover([a.address], "sale", connect)
        assert str(one.value).startswith(
            f"producer at {a.address}: unknown stream 'sale'; this producer has ['sales'] "
            "(every producer the query reads must have the stream"
        )
        with pytest.raises(StreamQSourceError) as some:
            planning.discover([a.address, b.address, d.address], "returns", connect)
        assert str(some.value).startswith(
            f"unknown stream 'returns' at 2 of 3 producers: the producer at {a.address} has "
            f"['sales']; the producer at {d.address} has no streams ("
        )
        token = Connect(timeout=10, token=streamq.make_token(secret, "analytics"))
        with pytest.raises(StreamQSourceError) as granted:
            planning.discover([c.address], "sale", token)
        assert "this producer lets this query's token read ['sales'] (" in str(granted.value)
        states = planning.discover([a.address, b.address], "sales", connect)
        assert {pid: s.head for pid, s in states.items()} == {a.producer_id: 1, b.producer_id: 0}
        assert planning.seek_time(states, "sales", 0, connect) == {
            a.producer_id: 1,
            b.producer_id: 1,
        }


def test_wrong_endpoints_are_errors_naming_the_address(reserve_port: Callable[[], int]) -> None:
    """Nothing listening, another service's port, a port that never answers, an endpoint
    not of the form host:port: each an error naming the address, within ``timeout``."""
    nothing = f"127.0.0.1:{reserve_port()}"
    with pytest.raises(StreamQSourceError, match=f"producer at {nothing}: cannot connect"):
        planning.discover([nothing], "orders", Connect(timeout=10))

    class Banner(socketserver.BaseRequestHandler):
        def handle(self) -> None:  # a service that speaks first, as SMTP or SSH do
            self.request.sendall(b"220 mail.example.com ESMTP ready\r\n")

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Banner) as smtp:
        threading.Thread(target=smtp.serve_forever, daemon=True).start()
        other = f"127.0.0.1:{smtp.server_address[1]}"
        try:
            with pytest.raises(
                StreamQSourceError,
                match=f"the peer at {other} is not a streamq producer: it answered with no "
                "SERVER_HELLO",
            ):
                planning.discover([other], "orders", Connect(timeout=10))
        finally:
            smtp.shutdown()

    with socket.socket() as silent:  # connections complete in its backlog, unanswered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(
            StreamQSourceError,
            match=f"no SERVER_HELLO from {mute} within 0.5 s: is a streamq producer listening",
        ):
            planning.discover([mute], "orders", Connect(timeout=0.5))
        assert time.monotonic() - started < 5

    for bad in ("localhost", "127.0.0.1:http"):
        with pytest.raises(
            StreamQSourceError, match=f"endpoints: address must be HOST:PORT, not '{bad}'"
        ):
            planning.parse_endpoints(f"127.0.0.1:7400,{bad}", None)


def test_the_driver_keeps_one_connection_per_producer_for_discovery_and_reports(
    tmp_path: Path,
) -> None:
    """Discovery and position reports share one connection per producer, kept across
    triggers, made anew once when the producer closed it (restarted, here on the same
    port). A report rides only on a connection kept from the last discovery."""
    db = str(tmp_path / "a.db")
    with streamq.SyncProducer(db) as a:
        address, pid = a.address, a.producer_id
        port = parse_address(address)[1]
        a.publish("orders", b"1")
        kept = planning.Connections(Connect(timeout=10))
        reports = planning.Reports("spark", {pid: 1})
        assert planning.discover([address], "orders", kept, {}, reports)[pid].head == 1
        assert reports.sent == set()  # a new connection
        for head in (1, 2):
            reports = planning.Reports("spark", {pid: head})
            assert planning.discover([address], "orders", kept, {}, reports)[pid].head == head
            assert reports.sent == {pid}
            # A status client and the driver's kept connection: no others. (The server
            # counts a closed connection out once it has read its end.)
            wait_until(lambda: producer_connections(address) == 2, "two connections")
            wait_until(applied_is(address, [head]), f"position {head} applied")
            a.publish("orders", b"more")
            wait_until(kept._open[address].watch_answered, "the watch's answer")
    with streamq.SyncProducer(db, port=port) as restarted:
        for sent in (set(), {pid}):  # made anew first: no report on that connection
            reports = planning.Reports("spark", {pid: 3})
            assert planning.discover([address], "orders", kept, {}, reports)[pid].head == 3
            assert reports.sent == sent
        kept.close()
        wait_until(
            lambda: producer_connections(address) == 1, "only the status client's connection"
        )
        assert applied(address) == [3]
        assert restarted.producer_id == pid


def applied(address: str) -> list[int]:
    """The positions the producer at ``address`` holds as applied by its consumers."""
    with streamq.Client(address) as client:
        return [p["applied"] for p in client.status()["positions"]]


def applied_is(address: str, positions: list[int]) -> Callable[[], bool]:
    return lambda: applied(address) == positions


def test_a_report_to_a_producer_whose_head_has_not_moved_waits_for_no_answer(
    tmp_path: Path,
) -> None:
    """A position report to a producer a trigger need not ask (its watch quiet) goes in one
    write with a new watch, not a round trip: a trigger reports to a paused producer and
    goes on at once, not taking it as down; it applies the report once it runs again, and
    its next commit answers the new watch as before."""
    db = str(tmp_path / "b.db")
    with streamq.SyncProducer(db, serve=False) as b:
        b.publish("orders", b"x")
    kept = planning.Connections(Connect(timeout=20, patience=5))
    with hosted(db) as (pid, address, process):
        try:
            known = planning.discover([address], "orders", kept, {})
            positions = {pid: planning.Position(2, known[pid].epoch)}
            process.send_signal(signal.SIGSTOP)
            asked = unread(address)
            reports = planning.Reports("spark", {pid: 1})
            states = planning.discover([address], "orders", kept, positions, reports, known)
            assert states == known and reports.sent == {pid}  # not down: not asked
            assert unread(address) > asked  # written, its answer not waited for
            process.send_signal(signal.SIGCONT)
            wait_until(lambda: applied(address) == [1], "the report applied")
            with sqlite3.connect(db) as conn:  # another process's commit: the watch answers
                streamq.publish(conn, "orders", b"y")
            wait_until(kept._open[address].watch_answered, "the new watch's answer")
            states = planning.discover([address], "orders", kept, positions, known=states)
            assert states[pid].head == 2 and states[pid].down is None
        finally:
            kept.close()


def registry() -> list[str]:
    """An endpoints provider, as a service registry lookup would be."""
    return ["r:1", "r:2"]


def test_endpoints_from_a_provider() -> None:
    found = planning.parse_endpoints("h:1", None, "tests.spark.test_spark_planning:registry")
    assert found == ["h:1", "r:1", "r:2"]
    with pytest.raises(StreamQSourceError, match="must be module:function"):
        planning.parse_endpoints(None, None, "no_colon")
    with pytest.raises(StreamQSourceError, match="No module named"):
        planning.parse_endpoints(None, None, "no_such_module_xyz:f")


def test_time_seek_and_key_reads_over_tls_with_a_token(tmp_path: Path) -> None:
    """startingTimestamp's seeks and a pushed-down key filter's history reads go through
    ``Connect`` (TLS and token), and the key reads still report records retention deleted."""
    from spark_source.datasource import StreamQPartition, read_partition

    from ..certs import make_certs

    certs = make_certs(tmp_path)
    secret = b"planning-test-secret-0123"
    auth = streamq.TokenAuth(secret, {"analytics": ["orders"]})
    settings = streamq.ServerSettings(tls=certs.server, auth=auth)
    with streamq.SyncProducer(str(tmp_path / "p.db"), settings=settings) as producer:
        with producer.transaction() as tx:
            for n in range(1, 11):
                tx.publish("orders", b"%d" % n, key=b"k%d" % (n % 2), timestamp=1000 * n)
        connect = Connect(10, certs.client, streamq.make_token(secret, "analytics"))
        states = planning.discover([producer.address], "orders", connect)
        assert planning.seek_time(states, "orders", 4500, connect) == {producer.producer_id: 5}
        rng = Range(producer.producer_id, producer.address, 3, 9)
        keys = frozenset({b"k0"})
        batches = list(read_partition(StreamQPartition(rng, "orders", True, connect, keys)))
        assert [seq for batch in batches for seq in batch.column("seq").to_pylist()] == [4, 6, 8]
        producer.truncate("orders", 5)
        with pytest.raises(StreamQSourceError, match=r"seqs 3\.\.4 are gone"):
            list(read_partition(StreamQPartition(rng, "orders", True, connect, keys)))
        lenient = read_partition(StreamQPartition(rng, "orders", False, connect, keys))
        assert [seq for batch in lenient for seq in batch.column("seq").to_pylist()] == [6, 8]


def test_executors_pause_the_collector_only_while_they_build_a_batch(tmp_path: Path) -> None:
    """A range read in many frames comes back whole and in order, in batches of about a
    frame; the garbage collector is on whenever Spark holds control, after a failed read
    too, and a caller's own choice to turn it off stands."""
    from spark_source.datasource import StreamQPartition, read_partition

    settings = streamq.ServerSettings(max_batch_records=1000)
    with streamq.SyncProducer(str(tmp_path / "p.db"), settings=settings) as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"%d" % n for n in range(1, 20_001)])
        connect = Connect(10)

        def read(start: int, end: int, fail_on_data_loss: bool = True) -> list[int]:
            rng = Range(producer.producer_id, producer.address, start, end)
            collecting, seqs = gc.isenabled(), []
            for batch in read_partition(
                StreamQPartition(rng, "orders", fail_on_data_loss, connect)
            ):
                assert gc.isenabled() == collecting
                assert 0 < batch.num_rows <= 9000  # whole frames: 1,000 records each here
                seqs += batch.column("seq").to_pylist()
            return seqs

        assert read(1, 20_001) == list(range(1, 20_001))
        with pytest.raises(StreamQSourceError, match="lost commits"):
            read(19_000, 20_010)  # beyond the head: refused once the read has begun
        assert gc.isenabled()
        assert read(19_000, 20_010, fail_on_data_loss=False) == list(range(19_000, 20_001))
        gc.disable()
        try:
            assert read(5, 9) == [5, 6, 7, 8]
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_a_planned_read_waits_for_its_producer_to_restart_and_reads_each_record_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer that stops while a task reads its planned range (a restart, after the
    batch was planned) is tried again, and the read goes on from the first seq it has not
    handed Spark once the producer is back: every record once. One that stays down fails
    the task once ``unreachableTimeoutMs`` has passed, naming it and the option."""
    from spark_source.datasource import StreamQPartition, read_partition

    total = 60_000

    db, settings = str(tmp_path / "p.db"), streamq.ServerSettings(max_batch_records=1000)
    with streamq.SyncProducer(db, settings=settings) as producer:
        with producer.transaction() as tx:
            # More than the kernel's socket buffers hold (32 + 4 MiB here): still unsent
            # when the producer stops.
            tx.publish_many("orders", [b"%1000d" % n for n in range(1, total + 1)])
        producer_id, address = producer.producer_id, producer.address
        rng = Range(producer_id, address, 1, total + 1)
        connect = Connect(timeout=10, unreachable=60)
        batches = read_partition(StreamQPartition(rng, "orders", True, connect))
        read = next(batches).column("seq").to_pylist()  # the rest is read after the restart
    assert 0 < len(read) < total
    failed: list[BaseException] = []

    def read_the_rest() -> None:
        try:
            for batch in batches:
                read.extend(batch.column("seq").to_pylist())
        except BaseException as exc:  # the test's thread reports it below
            failed.append(exc)

    reader = threading.Thread(target=read_the_rest)
    with caplog.at_level("WARNING", logger="spark_source"):
        reader.start()
        wait_until(lambda: "trying again" in caplog.text, "the read to find its producer gone")
        with streamq.SyncProducer(db, port=parse_address(address)[1], settings=settings):
            reader.join(timeout=60)
    assert not reader.is_alive() and not failed
    assert read == list(range(1, total + 1))
    assert f"producer {producer_id} at {address}" in caplog.text

    gone = StreamQPartition(rng, "orders", True, Connect(timeout=10, unreachable=0.3))
    host = re.escape(socket.gethostname())  # the executor's, named with the producer
    unreachable = (
        rf"unreachable from {host} \(this executor's host\) for 0.3 s \(unreachableTimeoutMs\)"
    )
    with pytest.raises(StreamQSourceError, match=unreachable):
        list(read_partition(gone))


def test_a_range_whose_connection_idled_out_waiting_its_turn_is_read_on_a_new_one(
    tmp_path: Path,
) -> None:
    """A task's connections open together, and a range's request goes out only as the one
    before it is read: a task slow over its first ranges (a busy executor) leaves the
    later connections idle past the producer's ``idle_timeout``, which closes them. Such a
    range is read on a new connection, every record once, in order."""
    from spark_source.datasource import StreamQPartition, StreamQTask, read_task

    settings = streamq.ServerSettings(idle_timeout=0.2)
    with streamq.SyncProducer(str(tmp_path / "p.db"), settings=settings) as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"%d" % n for n in range(1, 31)])
        ranges = [Range(producer.producer_id, producer.address, n, n + 10) for n in (1, 11, 21)]
        task = StreamQTask([StreamQPartition(r, "orders", True, Connect(10)) for r in ranges])
        values: list[bytes] = []
        for batch in read_task(task):
            values += batch.column("value").to_pylist()
            if len(values) == 10:
                time.sleep(1.0)  # the task busy: the third range's connection idles out
    assert values == [b"%d" % n for n in range(1, 31)]


def test_a_task_reads_each_range_once_in_order_asked_ahead_in_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor's task over many ranges (``read_task``): connections opened a group at a
    time, each range asked for while the one before it is read; every record once, in the
    task's order, whatever the groups' bounds. A range planned for a producer whose address
    now serves another fails naming both."""
    from spark_source.datasource import StreamQPartition, StreamQTask, read_task

    monkeypatch.setattr("spark_source.datasource.OPENED_TOGETHER", 2)
    with contextlib.ExitStack() as stack:
        producers = [
            stack.enter_context(streamq.SyncProducer(str(tmp_path / f"p{i}.db"))) for i in range(3)
        ]
        for i, producer in enumerate(producers):
            with producer.transaction() as tx:
                tx.publish_many("orders", [b"%d:%d" % (i, n) for n in range(1, 11)])
        ranges = [
            Range(producers[0].producer_id, producers[0].address, 1, 6),
            Range(producers[0].producer_id, producers[0].address, 6, 11),  # a split range
            Range(producers[1].producer_id, producers[1].address, 3, 11),
            Range(producers[2].producer_id, producers[2].address, 1, 4),
            Range(producers[2].producer_id, producers[2].address, 4, 11),
        ]

        def task(*chosen: Range) -> StreamQTask:
            return StreamQTask([StreamQPartition(r, "orders", True, Connect(10)) for r in chosen])

        table = pa.Table.from_batches(list(read_task(task(*ranges))))
        expected = [
            b"%d:%d" % (i, n) for i, first in ((0, 1), (1, 3), (2, 1)) for n in range(first, 11)
        ]
        assert table.column("value").to_pylist() == expected
        before = producer_connections(producers[1].address)

        swapped = Range(producers[0].producer_id, producers[1].address, 1, 11)
        with pytest.raises(StreamQSourceError, match=f"{producers[1].address} now serves producer"):
            list(read_task(task(ranges[3], swapped, ranges[2])))
        # The task's connections end with it, the failed one's included.
        wait_until(
            lambda: producer_connections(producers[1].address) <= before, "connections closed"
        )

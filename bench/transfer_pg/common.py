"""What the PostgreSQL transfer workload's processes share: the services' schema and SQL,
and the payments service's writers, which emit a streamq record or an outbox row."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import psycopg

import streamq

from ..common import say
from ..measure import Latencies
from ..transfer.common import (
    ACCOUNTS,
    OPENING_BALANCE,
    STREAM,
    Control,
    Transfer,
    make_transfers,
    paced_transfers,
    payloads,
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
        say("DONE", time.time(), committed, commits.encode())
        control.wait_stop()


def credit_rows(conn: Any, deposits: Sequence[tuple[int, int, int, float]]) -> None:
    """Credit ``deposits`` (transfer id, to account, amount, due) in ``conn``'s transaction."""
    conn.execute(CREDIT, ([d[1] for d in deposits], [d[2] for d in deposits]))
    conn.execute(RECORD_CREDITS, ([d[0] for d in deposits], [d[2] for d in deposits]))

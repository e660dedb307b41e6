"""Another writer process for the crash tests (tests/crashrun.py): orders published into
the producer's stream through the application's own connection, with ``streamq.publish``.

    writer_proc.py DB NUMBER TOTAL [--allow FILE] [--seed S] [--journal FILE] [--pace R]
                   [--survive-db-outages S] [--max-seconds S]

Writer NUMBER (1 to 63) runs transactions on its own psycopg (or sqlite3) connection,
concurrently with the serving producer (producer_proc.py) and the other writers: each
publishes 1 to 5 orders to stream ``orders`` and, in the same transaction, inserts them
into ``orders`` and adds them to ``totals``, as the producer does. Its order ids are
negative and its own (``-(64 * m + NUMBER)``, m growing), so writers never collide on
them; a restarted writer goes on after its last committed id.

Seqs never go beyond the allowance (``--allow FILE``, as the producer) or TOTAL. A
publish takes no lock and, on PostgreSQL, says no seq (it returns a ``Receipt``: the
serving producer numbers the records after the commit), so the stream's length is
counted where the application counts its orders: every publishing transaction (the
producer's too) adds its records to ``totals`` (``UPDATE ... RETURNING n``, the row
locked until its COMMIT). A transaction publishes what fits as far as the writer knows,
and rolls back if that count, with its records, goes beyond the allowance (other writers
committed meanwhile); the next one publishes what fits then. Once the stream is found at
TOTAL the writer prints ``COMPLETE`` and exits 0. ``--journal FILE``: every record
published and every transaction committed, for the oracle: on SQLite with their seqs
(``publish``, ``commit``); on PostgreSQL without seqs (producer_proc's ``UNNUMBERED``;
a commit as ``COMMIT_UNNUMBERED``), one line per transaction, which the harness finds in
the log (or still pending) by their values (order ids are unique).

Fault point (``STREAMQ_FAULT=mid-tx:N``, see faults.py): the N-th transaction kills the
process after its publishes and business SQL, before COMMIT; so does one that would
have to wait for the allowance once it is ``--kill-waiting-from`` or more (it grows no
further until the test's kills are over), whatever the allowance. ``STREAMQ_HOLD=mid-tx:N``
stops the N-th transaction there instead, until the test continues it (or, whatever the
allowance, one run at once when it would have to wait as above: it cannot commit, the
test kills the server under it).

``--survive-db-outages S``: as producer_proc.py, a transaction failing because the server
went away is dropped (a failed COMMIT's records stay attempted) and the writer connects
again, for up to S seconds of consecutive failures, printing ``DBERROR <error>``.

Prints ``READY m=<its last m> head=<records committed>`` once connected and, after each
commit, ``COMMIT <n> head=<records committed> last=<seq>`` (SQLite) or ``... xid=<its
transaction id>`` (PostgreSQL).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from typing import Any

import streamq
from tests.crash.faults import FAULTS, HOLDS
from tests.crash.producer_proc import (
    ADD_ORDERS,
    COMMIT_UNNUMBERED,
    COUNT_ORDERS,
    STREAM,
    allowance,
    outage_errors,
    unnumbered,
)
from tests.oracle import Dialect, Journal, dialect

STRIDE = 64  # writer NUMBER's ids: -(STRIDE * m + NUMBER)
MAX_RECORDS = 5
POLL = 0.01  # seconds between looks at the allowance while it is used up


class Writer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.d: Dialect = dialect(args.db)
        self.rng = random.Random(args.seed)
        self.journal = Journal(args.journal)
        self.conn: Any = None
        self.m = 0  # the m of this writer's last order id
        self.head = 0  # the stream's records committed, as this writer last saw them
        self.commits = 0

    def connect(self) -> None:
        if self.d.engine == "postgres":
            import psycopg

            self.conn = psycopg.connect(self.args.db, connect_timeout=5)
        else:
            import sqlite3

            # Autocommit: each transaction is begun by ``begin``.
            self.conn = sqlite3.connect(self.args.db, timeout=10, isolation_level=None)
        row = self.conn.execute(
            self.d.sql("SELECT COALESCE(MAX(-id), 0) FROM orders WHERE id < 0 AND (-id) % ? = ?"),
            (STRIDE, self.args.number),
        ).fetchone()
        self.m = int(row[0]) // STRIDE
        self.head = int(self.conn.execute(COUNT_ORDERS).fetchone()[0])
        self.conn.rollback()

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

    def begin(self) -> None:
        if self.d.engine == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")  # psycopg begins at the first statement

    def transaction(self, limit: int, kill: bool, hold: bool) -> bool:
        """One transaction; False if the stream had no room for it (rolled back). With
        ``kill`` or ``hold``, whatever the room: it dies or stops before COMMIT."""
        count = self.rng.randint(1, MAX_RECORDS)
        if not (kill or hold):  # what fits as far as this writer knows (checked below)
            count = max(1, min(count, limit - self.head))
        m = self.m
        orders = []
        for _ in range(count):
            m += self.rng.randint(1, 3)
            orders.append((-(STRIDE * m + self.args.number), self.rng.randint(1, 9_999)))
        values = [b"order-%d:%d" % order for order in orders]
        self.begin()
        published = [
            streamq.publish(self.conn, STREAM, value, key=b"%d" % order[0])
            for order, value in zip(orders, values, strict=True)
        ]
        receipts = [r for r in published if isinstance(r, streamq.Receipt)]
        seqs = [seq for seq in published if isinstance(seq, int)]
        # This transaction's attempts, in one line (the last, if it dies before COMMIT).
        if receipts:  # PostgreSQL: numbered after the commit, one transaction's
            assert len(receipts) == count and len({r.xid for r in receipts}) == 1, receipts
            self.journal.write("publish", unnumbered(values))
            done = f"xid={receipts[0].xid}"
        else:
            self.journal.write("publish", zip(seqs, values, strict=True))
            done = f"last={seqs[-1]}"
        self.conn.cursor().executemany(
            self.d.sql("INSERT INTO orders (id, amount) VALUES (?, ?)"), orders
        )
        row = self.conn.execute(
            self.d.sql(ADD_ORDERS), (count, sum(amount for _, amount in orders))
        ).fetchone()
        committed = int(row[0])  # the stream's records with these (under the row's lock)
        self.head = committed - count
        # Where seqs are known at publish (SQLite), they end at that count.
        assert not seqs or seqs[-1] == committed, (seqs, committed)
        if committed > limit and not (kill or hold):  # others committed meanwhile
            self.conn.rollback()
            return False
        if hold or HOLDS.due("mid-tx"):
            HOLDS.hold("mid-tx", f"{done} records={count}")
        if kill:
            FAULTS.fire("mid-tx", f"{done} records={count}")
        self.conn.commit()
        if receipts:
            self.journal.write(COMMIT_UNNUMBERED, unnumbered(values))
        else:
            self.journal.write("commit", zip(seqs, values, strict=True))
        self.m = -orders[-1][0] // STRIDE
        self.head = committed
        self.commits += 1
        print(f"COMMIT {self.commits} head={committed} {done}", flush=True)
        return True

    def run(self) -> int:
        args = self.args
        outages = outage_errors(args.db) if args.survive_db_outages else ()
        deadline = time.monotonic() + args.max_seconds
        failing_since: float | None = None
        while time.monotonic() < deadline:
            kill = False
            try:
                if self.conn is None:
                    self.connect()
                    print(f"READY m={self.m} head={self.head}", flush=True)
                limit = allowance(args.allow, args.total)
                waiting = self.head >= limit
                if waiting and self.head >= args.total and not FAULTS.armed("mid-tx"):
                    print(f"COMPLETE head={self.head}", flush=True)
                    return 0
                # The N-th transaction is killed; so is one that would have to wait once
                # the allowance grows no more until the kills are over. A transaction to
                # hold does not wait then either (the server is killed under it).
                at_cap = waiting and limit >= args.kill_waiting_from
                kill = FAULTS.armed("mid-tx") and at_cap
                hold = HOLDS.pending("mid-tx") and at_cap and not kill
                if waiting and not (kill or hold):
                    time.sleep(POLL)  # until the allowance grows: bounded by the deadline
                    continue
                kill = FAULTS.due("mid-tx") or kill
                if self.transaction(limit, kill, hold) and args.pace:
                    time.sleep(self.rng.uniform(0.5, 1.5) / args.pace)
                failing_since = None
            except outages as exc:
                if kill:  # it failed before its fault point: the next one dies there
                    FAULTS.again("mid-tx")
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > args.survive_db_outages:
                    raise
                print(f"DBERROR {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)
                self.close()
                time.sleep(0.05)  # the server is being restarted: bounded above
        print(f"GAVE UP after {args.max_seconds} s", flush=True)
        return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("number", type=int, choices=range(1, STRIDE))
    parser.add_argument("total", type=int)
    parser.add_argument("--allow", default=None)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--pace", type=float, default=0.0, help="transactions per second")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--survive-db-outages", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--kill-waiting-from", type=int, default=0, metavar="ALLOWANCE")
    sys.exit(Writer(parser.parse_args()).run())

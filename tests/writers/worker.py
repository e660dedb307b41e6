"""A worker process of a service: commits orders, each with its record, into the producer
database it shares with other workers, starting when told to on stdin, then prints how
many it committed and how many transactions were refused (``tests/producer/test_many_writers.py``).

``--via``: ``publish`` (``streamq.publish`` on a plain sqlite3 connection, BEGIN
IMMEDIATE), ``legacy`` (the same in sqlite3's default transaction handling),
``sqlalchemy`` (a SQLAlchemy Session) or ``sync`` (``SyncProducer(serve=False)``).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from collections.abc import Callable

import streamq

ORDERS = "CREATE TABLE IF NOT EXISTS orders (worker TEXT NOT NULL, n INTEGER NOT NULL)"
INSERT = "INSERT INTO orders (worker, n) VALUES (?, ?)"


def committer(db: str, via: str, name: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A function committing order ``n`` with its record, and one closing what it opened."""
    value = name.encode() + b":%d"
    if via in ("publish", "legacy"):
        conn = sqlite3.connect(db, timeout=30, isolation_level=None if via == "publish" else "")

        def commit(n: int) -> None:
            if via == "publish":
                conn.execute("BEGIN IMMEDIATE")
            conn.execute(INSERT, (name, n))
            streamq.publish(conn, "orders", value % n, key=name.encode())
            conn.commit()

        return commit, conn.close
    if via == "sqlalchemy":
        from sqlalchemy import create_engine, text
        from sqlalchemy.orm import Session

        engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": 30})

        def commit_session(n: int) -> None:
            with Session(engine) as session, session.begin():
                session.execute(
                    text("INSERT INTO orders (worker, n) VALUES (:w, :n)"), {"w": name, "n": n}
                )
                streamq.publish(session, "orders", value % n, key=name.encode())

        return commit_session, engine.dispose
    producer = streamq.SyncProducer(db, serve=False)

    def commit_sync(n: int) -> None:
        with producer.transaction() as tx:
            tx.execute(INSERT, (name, n))
            tx.publish("orders", value % n, key=name.encode())

    return commit_sync, producer.close


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("name")
    parser.add_argument("--via", choices=["publish", "legacy", "sqlalchemy", "sync"])
    parser.add_argument("--transactions", type=int, default=200)
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between transactions, as requests come"
    )
    args = parser.parse_args()
    run(*committer(args.db, args.via, args.name), args.transactions, args.pause)


def run(
    commit: Callable[[int], None], close: Callable[[], None], transactions: int, pause: float = 0
) -> None:
    """Say READY, wait for the word on stdin, commit ``transactions`` orders, say DONE with
    how many committed and how many were refused."""
    print("READY", flush=True)
    sys.stdin.readline()  # all start together, when told to: their transactions overlap
    committed = refused = 0
    try:
        for n in range(transactions):
            try:
                commit(n)
                committed += 1
            except Exception as exc:  # counted: the figure the test checks
                refused += 1
                print(f"refused: {exc!r}", flush=True)
            time.sleep(pause)
    finally:
        close()
    print(f"DONE committed={committed} refused={refused}", flush=True)


if __name__ == "__main__":
    main()

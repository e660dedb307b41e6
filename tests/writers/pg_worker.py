"""A worker process committing orders into PostgreSQL, each with its record, starting when
told to on stdin; then prints how many it committed and how many were refused
(``tests/engines/test_pg_publish.py``).

``--via``: ``psycopg`` (a plain psycopg connection: the transaction begins at the first
statement), ``autocommit`` (an autocommit connection inside ``conn.transaction()``) or
``sqlalchemy`` (a SQLAlchemy Session on ``postgresql+psycopg://``).

``--times FILE``: for each committed order, a line ``n started ended``: ``time.monotonic_ns()``
(one clock for every process of the machine) before the transaction's first statement was
sent, and after its COMMIT returned. So if one transaction's ``ended`` is below another's
``started``, the first committed before the second began.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import psycopg

import streamq

from .worker import run

INSERT = "INSERT INTO orders (worker, n) VALUES (%s, %s)"


def committer(url: str, via: str, name: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A function committing order ``n`` with its record, and one closing what it opened."""
    value = name.encode() + b":%d"
    if via == "sqlalchemy":
        from sqlalchemy import create_engine, text
        from sqlalchemy.orm import Session

        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))

        def commit_session(n: int) -> None:
            with Session(engine) as session, session.begin():
                session.execute(
                    text("INSERT INTO orders (worker, n) VALUES (:w, :n)"), {"w": name, "n": n}
                )
                streamq.publish(session, "orders", value % n, key=name.encode())

        return commit_session, engine.dispose
    conn = psycopg.connect(url, autocommit=via == "autocommit")

    def commit(n: int) -> None:
        if via == "autocommit":
            with conn.transaction():
                conn.execute(INSERT, (name, n))
                streamq.publish(conn, "orders", value % n, key=name.encode())
            return
        try:
            conn.execute(INSERT, (name, n))
            streamq.publish(conn, "orders", value % n, key=name.encode())
            conn.commit()
        except BaseException:
            conn.rollback()
            raise

    return commit, conn.close


def timed(
    commit: Callable[[int], None], close: Callable[[], None], path: str
) -> tuple[Callable[[int], None], Callable[[], None]]:
    """``commit`` and ``close``, noting when each committed transaction started and ended,
    written to ``path`` at the close."""
    times: list[tuple[int, int, int]] = []

    def commit_timed(n: int) -> None:
        started = time.monotonic_ns()
        commit(n)  # a refused one (it raises) is not noted
        times.append((n, started, time.monotonic_ns()))

    def close_timed() -> None:
        try:
            close()
        finally:
            with open(path, "w") as f:
                f.writelines(f"{n} {started} {ended}\n" for n, started, ended in times)

    return commit_timed, close_timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("--via", choices=["psycopg", "autocommit", "sqlalchemy"])
    parser.add_argument("--transactions", type=int, default=300)
    parser.add_argument("--times", default=None, help="file to note each commit's times in")
    args = parser.parse_args()
    commit, close = committer(args.url, args.via, args.name)
    if args.times:
        commit, close = timed(commit, close, args.times)
    run(commit, close, args.transactions)


if __name__ == "__main__":
    main()

"""What the per-stream lock of the PostgreSQL engine costs (``streamq/engines/postgres/``).

Writer processes commit transactions of one business row plus either a
``streamq.publish`` into one stream (which holds the stream's row lock until the commit,
fsync included) or a plain outbox INSERT (a bigserial id: no lock, commits group). Prints
transactions/s for each, with 1 and 8 writers.

    python -m bench.tools.pg_lock                  # a throwaway server (tests/pgserver.py)
    python -m bench.tools.pg_lock --url postgresql://user@host/db --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import psycopg

import streamq

TABLES = (
    "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, sku text, n integer)",
    "CREATE TABLE IF NOT EXISTS outbox (id bigserial PRIMARY KEY, topic text, payload bytea)",
)
RESET = "TRUNCATE orders, outbox, streamq_log, streamq_time, streamq_epochs"
PAYLOAD = b"x" * 100


def writer(url: str, mode: str, seconds: float, go: Event, ready: Event, out: Queue[int]) -> None:
    """Commit transactions for ``seconds`` once ``go`` is set; put the count in ``out``."""
    with psycopg.connect(url) as conn:
        publish: Callable[[int], None]
        if mode == "streamq":

            def publish(n: int) -> None:
                streamq.publish(conn, "orders", PAYLOAD, key=b"%d" % n)
        else:

            def publish(n: int) -> None:
                conn.execute(
                    "INSERT INTO outbox (topic, payload) VALUES ('orders', %s)", (PAYLOAD,)
                )

        ready.set()
        go.wait(60)
        count = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.execute("INSERT INTO orders (sku, n) VALUES ('a1', %s)", (count,))
            publish(count)
            conn.commit()
            count += 1
    out.put(count)


def measure(url: str, mode: str, writers: int, seconds: float) -> float:
    """Transactions/s of ``writers`` processes committing at once."""
    with psycopg.connect(url) as conn:
        conn.execute(RESET)
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    out: Queue[int] = context.Queue()
    readies = [context.Event() for _ in range(writers)]
    processes = [
        context.Process(target=writer, args=(url, mode, seconds, go, ready, out))
        for ready in readies
    ]
    try:
        for process in processes:
            process.start()
        for ready in readies:
            if not ready.wait(60):
                raise RuntimeError("a writer did not start")
        go.set()
        counts = [out.get(timeout=seconds + 60) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    return sum(counts) / seconds


@contextmanager
def database(url: str | None) -> Iterator[str]:
    """``url``, or a database on a throwaway server removed afterwards."""
    if url:
        yield url
        return
    from tests.pgserver import PostgresServer

    server = PostgresServer()
    try:
        server.start()
        yield server.create_database("bench")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a database to use (default: a throwaway server)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    with database(args.url) as url:
        with psycopg.connect(url) as conn:
            streamq.create_tables(conn)
            for statement in TABLES:
                conn.execute(statement)
        print(f"{'writers':>7} {'streamq tx/s':>13} {'outbox tx/s':>12} {'ratio':>6}")
        for writers in args.writers:
            streamq_rate = measure(url, "streamq", writers, args.seconds)
            outbox_rate = measure(url, "outbox", writers, args.seconds)
            ratio = streamq_rate / outbox_rate
            print(f"{writers:>7} {streamq_rate:>13,.0f} {outbox_rate:>12,.0f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()

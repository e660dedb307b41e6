"""The shares workload's driver: 1, 2, 4 and 8 worker processes splitting one stream by key.

Each worker is a ``streamq.Consumer(..., share=(i, n))`` process (``bench/shares/streamq.py``)
whose apply is deliberately slow: it waits 0.2 ms per record (standing for a call to
another service), then inserts one row per record into a PostgreSQL database shared by
all workers (a throwaway server, fsync on), in one transaction with its share's
position. The producer holds COUNT records over 1,000 keys, committed before the
workers start; it serves each worker only its share. Measured: records/s from GO to the
commit of the last batch holding records, against one worker's rate times n. After
every run the ``effects`` table is checked: every seq applied once, by the worker of its
key's share, and each key's records applied in seq order.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import Progress
from rich.table import Table

from ..common import Child, Reporting, console, machine, save, workload_main
from .streamq import EFFECTS

if TYPE_CHECKING:
    from tests.pgserver import PostgresServer

WORKERS = (1, 2, 4, 8)
APPLY_MS = 0.2
KEYS = 1000
FULL_COUNT = 40_000
QUICK_COUNT = 4_000
PROGRAMS = "bench.shares.streamq"


@contextlib.contextmanager
def postgres() -> Iterator[PostgresServer]:
    from tests.pgserver import PostgresServer

    server = PostgresServer(settings={"max_connections": "100"})
    try:
        server.start()
        yield server
    finally:
        server.stop()


def run_once(
    server: PostgresServer, address: str, shares: int, count: int, name: str
) -> dict[str, Any]:
    """One run of ``shares`` workers over a fresh database; its figures, checked."""
    import psycopg

    url = server.create_database(name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(EFFECTS)
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(Child(PROGRAMS, "worker", address, url, i, shares, count, APPLY_MS))
            for i in range(shares)
        ]
        for w in workers:
            w.expect("READY")
        for w in workers:
            w.send("GO")
        done = [w.expect("DONE", timeout=600) for w in workers]
    return figures(done, url, shares, count)


def run_group_once(
    server: PostgresServer, address: str, members: int, shares: int, count: int, name: str
) -> dict[str, Any]:
    """``run_once`` by ``members`` members of a consumer group split into ``shares``: GO
    once every share is held, STOP once every record is applied; its figures, checked."""
    import psycopg

    from ..common import wait_until
    from ..groups.common import balanced

    url = server.create_database(name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(EFFECTS)
        with contextlib.ExitStack() as stack:
            group = [
                stack.enter_context(Reporting(PROGRAMS, "member", address, url, shares, APPLY_MS))
                for _ in range(members)
            ]
            wait_until("balanced group", lambda: balanced(group, shares))
            for m in group:
                m.send("GO")

            def applied() -> bool:
                row = conn.execute("SELECT count(*) FROM effects").fetchone()
                return row is not None and row[0] >= count

            wait_until(f"{count:,} records applied", applied, timeout=600, every=0.1)
            for m in group:
                m.send("STOP")
            done = [m.expect("DONE", timeout=60) for m in group]
    return figures(done, url, shares, count)


def figures(done: list[list[str]], url: str, shares: int, count: int) -> dict[str, Any]:
    """A run's figures from each worker's DONE (start, end, records), once checked."""
    starts = [float(d[0]) for d in done]
    ends = [float(d[1]) for d in done]
    records = [int(d[2]) for d in done]
    check(url, shares, count)
    seconds = max(ends) - min(starts)
    return {"seconds": seconds, "rate": count / seconds, "records_per_worker": records}


def check(url: str, shares: int, count: int) -> None:
    """Every seq once, by its key's share, each key's records in seq order."""
    import psycopg

    from streamq import share_of

    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT seq, key, worker FROM effects ORDER BY n").fetchall()
    seqs = sorted(seq for seq, _, _ in rows)
    if seqs != list(range(1, count + 1)):
        raise AssertionError(f"{len(seqs)} effects for {count} records, or seqs missing")
    last: dict[bytes, int] = {}
    for seq, key, worker in rows:
        key = bytes(key)
        expected = share_of(key, shares) if shares > 1 else 0
        if worker != expected:
            raise AssertionError(f"seq {seq} applied by worker {worker}, not {expected}")
        if last.get(key, 0) > seq:
            raise AssertionError(f"key {key!r}: seq {seq} applied after {last[key]}")
        last[key] = seq


def run(broker: Any, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    """Kafka plays no part here (``broker`` is ignored): the figure is how streamq's
    shares scale with a slow apply, against the ideal of one worker's rate times n."""
    count = QUICK_COUNT if quick else FULL_COUNT
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in WORKERS}
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = stack.enter_context(postgres())
        producer = stack.enter_context(Child(PROGRAMS, "producer", folder / "p.db", count, KEYS))
        (address,) = producer.expect("READY", timeout=300)
        progress = stack.enter_context(Progress(console=console, transient=True))
        task = progress.add_task("shares", total=repeats * len(WORKERS))
        for r in range(repeats):
            for n in WORKERS:
                runs[n].append(run_once(server, address, n, count, f"shares_{n}_{r}"))
                progress.advance(task)
    rates = {n: statistics.median(x["rate"] for x in runs[n]) for n in WORKERS}
    table = Table(
        title=f"shares: {count:,} records over {KEYS:,} keys, apply {APPLY_MS} ms per record "
        f"+ one PostgreSQL row each; medians of {repeats}"
    )
    for column in ("workers", "records/s", "min..max", "x one worker", "apply-bound limit"):
        table.add_column(column, justify="right")
    for n in WORKERS:
        values = [x["rate"] for x in runs[n]]
        table.add_row(
            str(n),
            f"{rates[n]:,.0f}",
            f"{min(values):,.0f}..{max(values):,.0f}",
            f"{rates[n] / rates[1]:.2f}",
            f"{n * 1000 / APPLY_MS:,.0f}",
        )
    console.print(table)
    results = {
        "count": count,
        "keys": KEYS,
        "apply_ms": APPLY_MS,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": {str(n): runs[n] for n in WORKERS},
        "median_rate": {str(n): rates[n] for n in WORKERS},
    }
    save("shares", results, quick)
    return results


if __name__ == "__main__":
    raise SystemExit(workload_main("python -m bench.shares.run", __doc__, run, None))

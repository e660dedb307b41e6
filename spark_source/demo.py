"""``make demo``, part two: a Spark query aggregating several producers while they commit.

Three shops each run their own producer (their own SQLite database, their own
server) and commit sales. One Spark streaming query reads all three directly
(no broker), keeps revenue per shop and region, and the table below updates as
micro-batches land. At the end, Spark's counts are checked against each
producer's head: every sale counted once.
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

import streamq

from .session import local_spark

REGIONS = ("north", "south", "east", "west")


def _sell(producer: streamq.SyncProducer, shop: int, until: float) -> None:
    """A shop's service: record each sale and publish it in the same transaction."""
    rng = random.Random(shop)
    with producer.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS sales (region TEXT, amount INTEGER)")
    while time.monotonic() < until:
        with producer.transaction() as tx:
            sales = [(rng.choice(REGIONS), rng.randrange(1, 100)) for _ in range(50)]
            for region, amount in sales:
                tx.execute("INSERT INTO sales VALUES (?, ?)", (region, amount))
                tx.publish("sales", f"{region},{amount}".encode(), key=region.encode())
        time.sleep(0.02)  # a steady trickle: about 2,500 sales/s per shop


def run(seconds: float = 20.0, shops: int = 3) -> int:
    console = Console()
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        producers = [
            stack.enter_context(streamq.SyncProducer(str(folder / f"shop{i}.db")))
            for i in range(shops)
        ]
        for producer in producers:
            producer.create_stream("sales")
        names = {p.producer_id: f"shop {i}" for i, p in enumerate(producers)}
        spark = local_spark("streamq demo")
        stack.callback(spark.stop)
        sales = (
            spark.readStream.format("streamq")
            .option("endpoints", ",".join(p.address for p in producers))
            .option("stream", "sales")
            .option("startingOffsets", "earliest")
            .load()
            .selectExpr("producer", "split(cast(value AS STRING), ',') AS sale")
            .selectExpr("producer", "sale[0] AS region", "CAST(sale[1] AS INT) AS amount")
        )
        totals = sales.groupBy("producer", "region").agg({"amount": "sum", "*": "count"})
        query = (
            totals.writeStream.outputMode("complete")
            .format("memory")
            .queryName("totals")
            .trigger(processingTime="1 second")
            .start()
        )
        until = time.monotonic() + seconds
        shops_selling = [
            threading.Thread(target=_sell, args=(p, i, until), daemon=True)
            for i, p in enumerate(producers)
        ]
        for thread in shops_selling:
            thread.start()

        def spark_totals() -> dict[tuple[str, str], tuple[int, int]]:
            rows = spark.sql("SELECT * FROM totals").collect()
            return {(names[r.producer], r.region): (r["count(1)"], r["sum(amount)"]) for r in rows}

        with Live(console=console, refresh_per_second=2) as live:
            while any(t.is_alive() for t in shops_selling):
                live.update(_table(spark_totals()))
                time.sleep(0.5)
            published = sum(p.head("sales") for p in producers)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                counted = spark_totals()
                live.update(_table(counted))
                if sum(n for n, _ in counted.values()) >= published:
                    break
                time.sleep(0.5)
        query.stop()
        expected = {
            (f"shop {i}", region): (n, revenue)
            for i, p in enumerate(producers)
            for region, n, revenue in p.query(
                "SELECT region, count(*), sum(amount) FROM sales GROUP BY region"
            )
        }
    console.print()
    ok = counted == expected
    mark = "[green]ok  [/]" if ok else "[red]FAIL[/]"
    console.print(
        f"{mark} Spark's totals per shop and region equal each shop's own database "
        f"({sum(n for n, _ in expected.values()):,} sales, each counted once)"
    )
    return 0 if ok else 1


def _table(totals: dict[tuple[str, str], tuple[int, int]]) -> Table:
    view = Table(title="Spark: revenue per shop and region, read from 3 producers")
    for column in ("shop", "region", "sales", "revenue"):
        view.add_column(column, justify="right")
    for (shop, region), (count, revenue) in sorted(totals.items()):
        view.add_row(shop, region, f"{count:,}", f"{revenue:,}")
    return view


if __name__ == "__main__":
    sys.exit(run(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0))

"""``make demo``: money moves between two services' databases, exactly once, through crashes.

A payments service (this process) debits an account and publishes the matching
deposit in one SQLite transaction. A ledger service (a separate process)
credits each deposit in its own database, storing its position in the same
transaction. The demo kills the ledger with SIGKILL while money moves, restarts
it, and at the end checks that every cent debited was credited exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import _loop
from .consumer.consumer import Consumer
from .producer.producer import Producer

ACCOUNTS = 100
OPENING_BALANCE = 1_000_000
TRANSFERS_PER_TRANSACTION = 20


@dataclass
class _Progress:
    transfers: int = 0
    applied: int = 0
    kills: int = 0
    started: float = 0.0
    producing: bool = True


async def _payments(producer: Producer, until: float, progress: _Progress) -> None:
    """Debit and publish the deposit in the same transaction, as fast as it goes."""
    rng = random.Random(7)
    async with producer.transaction() as tx:
        await tx.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)")
        await tx.executemany(
            "INSERT INTO accounts VALUES (?, ?)", [(i, OPENING_BALANCE) for i in range(ACCOUNTS)]
        )
    while time.monotonic() < until:
        async with producer.transaction() as tx:
            debits = []
            for _ in range(TRANSFERS_PER_TRANSACTION):
                account, amount = rng.randrange(ACCOUNTS), rng.randrange(1, 500)
                debits.append((amount, account))
                deposit = msgpack.packb({"to": (account + 1) % ACCOUNTS, "amount": amount})
                await tx.publish("deposits", deposit, key=b"%d" % account)
            await tx.executemany("UPDATE accounts SET balance = balance - ? WHERE id = ?", debits)
        progress.transfers += TRANSFERS_PER_TRANSACTION
        await asyncio.sleep(0)  # let the server push between commits


async def consumer_main(address: str, db: str) -> None:
    """The ledger service: credit each deposit once, position stored with the credit."""
    async with Consumer(address, "deposits", db=db, name="ledger") as consumer:
        async for batch in consumer:
            async with consumer.transaction(batch) as tx:
                await tx.execute(
                    "CREATE TABLE IF NOT EXISTS credits (seq INTEGER, account INTEGER, amount INT)"
                )
                rows = []
                for record in batch:
                    deposit = msgpack.unpackb(record.value)
                    rows.append((record.seq, deposit["to"], deposit["amount"]))
                await tx.executemany("INSERT INTO credits VALUES (?, ?, ?)", rows)


def _table(progress: _Progress, producer: Producer) -> Table:
    head = producer.head("deposits") if "deposits" in producer.log.streams else 0
    elapsed = max(time.monotonic() - progress.started, 1e-9)
    table = Table(title="streamq demo: payments -> ledger, exactly once", min_width=60)
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("transfers committed (debit + deposit, one tx)", f"{progress.transfers:,}")
    table.add_row("deposit stream head (seq)", f"{head:,}")
    table.add_row("ledger applied (its own DB, acked)", f"{progress.applied:,}")
    table.add_row("lag (records)", f"{head - progress.applied:,}")
    table.add_row("throughput (transfers/s)", f"{progress.transfers / elapsed:,.0f}")
    table.add_row("ledger killed with SIGKILL", str(progress.kills))
    phase = "producing" if progress.producing else "catching up"
    if not progress.producing and head == progress.applied:
        phase = "done"
    table.add_row("phase", phase)
    return table


async def _start_ledger(address: str, db: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamq", "demo-consumer", address, db
    )


async def _demo(seconds: float, kills: int, folder: Path) -> bool:
    console = Console()
    producer_db, ledger_db = str(folder / "payments.db"), str(folder / "ledger.db")
    progress = _Progress(started=time.monotonic())
    async with Producer(producer_db) as producer:
        await producer.create_stream("deposits")
        server = producer.server
        assert server is not None
        ledger = await _start_ledger(producer.address, ledger_db)
        kill_times = [progress.started + seconds * (i + 1) / (kills + 1) for i in range(kills)]
        payments = asyncio.create_task(_payments(producer, progress.started + seconds, progress))
        try:
            with Live(_table(progress, producer), console=console, refresh_per_second=8) as live:
                deadline = progress.started + seconds + 60
                while time.monotonic() < deadline:
                    acked = [s.acked for s in server.subscriptions if s.consumer == "ledger"]
                    progress.applied = max([progress.applied, *acked])
                    if kill_times and time.monotonic() >= kill_times[0]:
                        kill_times.pop(0)
                        ledger.kill()
                        await ledger.wait()
                        progress.kills += 1
                        ledger = await _start_ledger(producer.address, ledger_db)
                    if payments.done():
                        payments.result()
                        progress.producing = False
                        if progress.applied == producer.head("deposits"):
                            break
                    live.update(_table(progress, producer))
                    await asyncio.sleep(0.1)
                live.update(_table(progress, producer))
        finally:
            payments.cancel()
            with contextlib.suppress(ProcessLookupError):
                ledger.terminate()
            await ledger.wait()
        head = producer.head("deposits")
    return _verify(console, producer_db, ledger_db, head)


def _verify(console: Console, producer_db: str, ledger_db: str, head: int) -> bool:
    console.print()
    with contextlib.closing(sqlite3.connect(producer_db)) as db:
        (debited,) = db.execute(
            "SELECT ? * count(*) - sum(balance) FROM accounts", (OPENING_BALANCE,)
        ).fetchone()
    with contextlib.closing(sqlite3.connect(ledger_db)) as db:
        credited, count, distinct = db.execute(
            "SELECT sum(amount), count(*), count(DISTINCT seq) FROM credits"
        ).fetchone()
        (position,) = db.execute("SELECT seq FROM streamq_positions").fetchone()
    checks = {
        f"money debited {debited:,} == money credited {credited:,}": debited == credited,
        f"deposits credited {count:,} == published {head:,}": count == head,
        f"no deposit credited twice ({distinct:,} distinct)": distinct == count,
        f"ledger position {position:,} == stream head {head:,}": position == head,
    }
    for text, ok in checks.items():
        console.print(("[green]ok  [/]" if ok else "[red]FAIL[/]") + " " + text)
    return all(checks.values())


def run_demo(seconds: float, kills: int, folder: str | None) -> int:
    with contextlib.ExitStack() as stack:
        path = Path(folder) if folder else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path.mkdir(parents=True, exist_ok=True)
        for name in ("payments.db", "ledger.db"):
            for suffix in ("", "-wal", "-shm"):
                (path / (name + suffix)).unlink(missing_ok=True)
        ok = _loop.run(_demo(seconds, kills, path))
    return 0 if ok else 1

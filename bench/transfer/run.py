"""The transfer workload's driver: the motivating case (the package's docstring).

Three systems (processes in ``bench/transfer/streamq.py`` and ``bench/transfer/kafka.py``):

- **streamq**: the debit and ``tx.publish("deposits", ...)`` commit in one transaction of the
  payments database; the ledger is a ``streamq.Consumer`` storing its position with the credits.
- **Kafka + outbox**, as careful practitioners do it: the debit and an outbox row commit
  together; a relay process produces outbox rows (idempotent producer, ``acks=all``), waits
  for delivery, then records the last relayed id (at least once); the ledger stores its
  offsets with the credits and dedupes by transfer id.
- **Kafka, naive dual write**: commit the debit, then produce the deposit.

Measured without kills, for streamq and Kafka + outbox: transfers/s end to end (from GO until
the ledger has credited all N; one writer, also for the floor, ``floor.py``: the same SQL
with no framework) and the latency from each transfer's commit (its due time,
at a fixed rate) to the commit of its credit. Then, for every system, a crash run: K
``kill -9`` of the producer, (the relay,) and the consumer while transfers flow, half at a
random moment and half at each process's worst moment (right after a commit; the relay:
after delivery and before recording), each process restarted; once everything has
drained (a condition on the files and the topic, not a timer), the SQLite files are
checked: money conserved, no deposit lost, none applied twice.

``python -m bench.transfer.run [--quick] [--repeats N] [--no-kafka] [--seed N]`` runs it
alone.
"""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.progress import Progress, TaskID
from rich.table import Table

from streamq.engines.sqlite.storage import HEAD_QUERY

from ..common import (
    LatencyRuns,
    Series,
    alternating,
    comparison_table,
    console,
    latency_table,
    percentile_series,
    reserved_port,
    save,
    workload_main,
)
from .common import ACCOUNTS, OPENING_BALANCE, STREAM
from .deployment import FULL, QUICK, ROLES, STARTUP_TIMEOUT, Deployment, Sizes, flow
from .floor import floor_flow
from .kafka import KAFKA_CONSUMER, KAFKA_PRODUCER, RELAY_POLL, warm_up

LABELS = {
    "streamq": "streamq",
    "kafka-outbox": "Kafka + outbox",
    "kafka-naive": "Kafka, naive dual write",
}
SHORT = {"streamq": "streamq", "kafka-outbox": "kafka outbox", "kafka-naive": "kafka naive"}

DRAIN_TIMEOUT = 180.0  # s, after the producer's last commit, for the ledger to catch up

HANDLERS = 32  # concurrent request handlers of the payments service (its full-durability case)


def kill_plan(system: str, kills: int) -> list[tuple[str, str]]:
    """(role, how) for each kill: the roles in turn, each alternating armed and random.

    A producer's or relay's first kill is armed (the naive dual write then loses deposits
    for certain), a consumer's first is random.
    """
    roles = ROLES[system]
    done: Counter[str] = Counter()
    plan = []
    for i in range(kills):
        role = roles[i % len(roles)]
        armed = (done[role] % 2 == 0) == (role != "consumer")
        done[role] += 1
        plan.append((role, "armed" if armed else "random"))
    return plan


def crash_run(
    system: str,
    broker: Any,
    folder: Path,
    total: int,
    kills: int,
    rate: float,
    seed: int,
    *,
    dedupe: bool = True,
    on_kill: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """K kill -9 while ``total`` transfers flow at ``rate``/s; then drain and check the files."""
    if rate <= 0:
        raise ValueError("a crash run is paced: rate must be > 0 transfers/s")
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    delivered: Counter[str] = Counter()
    events: list[dict[str, Any]] = []
    with (
        reserved_port() as port,  # the producer's, through its kills and restarts
        Deployment(
            system, folder, total, rate, broker=broker, port=port, dedupe=dedupe, seed=seed
        ) as deployment,
    ):
        deployment.start_all()
        deployment.go()
        for i, (role, how) in enumerate(kill_plan(system, kills)):
            # Spread over the flow, the last one well before its end.
            threshold = max(1, total * (i + 1) // (kills + 2))
            deployment.wait_committed(threshold, STARTUP_TIMEOUT + 3 * total / rate)
            if how == "random":
                time.sleep(rng.uniform(0.0, 0.3))
            at = deployment.committed()
            landed = deployment.kill(role, how)
            delivered[role] += 1
            events.append(
                {"role": role, "how": landed, "committed": at, "s": time.monotonic() - began}
            )
            if on_kill is not None:
                on_kill(i + 1)
        left = total - deployment.committed()
        # A guard against a hang, not a speed check: generous, since a producer restarted
        # just before (a Python start, its imports, the broker's session) may share two
        # cores with a loaded machine.
        deployment.children["producer"].expect("DONE", 3 * STARTUP_TIMEOUT + 3 * left / rate)
        drained = deployment.wait(deployment.drained, DRAIN_TIMEOUT)
    result = check(deployment.producer_db, deployment.consumer_db)
    result.update(
        system=system,
        label=LABELS[system],
        seed=seed,
        kills=dict(delivered),
        kills_delivered=sum(delivered.values()),
        kill_events=events,
        drained=drained,
        seconds=time.monotonic() - began,
        dedupe=dedupe if system != "streamq" else None,
    )
    return result


def check(producer_db: Path, consumer_db: Path) -> dict[str, Any]:
    """The invariants, from the two services' SQLite files (every process stopped)."""
    with contextlib.closing(sqlite3.connect(producer_db, timeout=30)) as conn:
        conn.execute("ATTACH DATABASE ? AS ledger", (str(consumer_db),))
        payments = {r[0] for r in conn.execute("SELECT name FROM main.sqlite_master")}
        published: int | None = None
        if "streamq_streams" in payments:
            published = int(conn.execute(HEAD_QUERY, (STREAM,)).fetchone()[0] or 0)
        elif "outbox" in payments:
            published = int(conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
        return check_books(conn, published)


def check_books(conn: sqlite3.Connection, published: int | None) -> dict[str, Any]:
    """The invariants, in SQL, on a connection with the payments service's ``transfers``
    and ``accounts`` in ``main`` and the ledger's tables attached as ``ledger``.

    ``published``: the deposits in the payments service's log or outbox (None: it has
    neither), which must equal the transfers it committed.
    """

    def one(sql: str) -> int:
        row = conn.execute(sql).fetchone()
        return int(row[0] or 0)

    ledger = {r[0] for r in conn.execute("SELECT name FROM ledger.sqlite_master")}
    committed = one("SELECT COUNT(*) FROM transfers")
    debited = one("SELECT SUM(amount) FROM transfers")
    credited = one("SELECT SUM(amount) FROM ledger.credits")
    lost, lost_money = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM transfers "
        "WHERE transfer_id NOT IN (SELECT transfer_id FROM ledger.credits)"
    ).fetchone()
    result: dict[str, Any] = {
        "transfers_checked": committed,
        "published": published,
        "credited_transfers": one("SELECT COUNT(DISTINCT transfer_id) FROM ledger.credits"),
        "lost": int(lost),
        "lost_money": int(lost_money),
        "applied_twice": one(
            "SELECT COUNT(*) FROM (SELECT transfer_id FROM ledger.credits "
            "GROUP BY transfer_id HAVING COUNT(*) > 1)"
        ),
        "extra_credit_rows": one(
            "SELECT COUNT(*) - COUNT(DISTINCT transfer_id) FROM ledger.credits"
        ),
        "phantom": one(
            "SELECT COUNT(DISTINCT transfer_id) FROM ledger.credits "
            "WHERE transfer_id NOT IN (SELECT transfer_id FROM transfers)"
        ),
        "wrong_amount": one(
            "SELECT COUNT(*) FROM ledger.credits AS c JOIN transfers AS t "
            "USING (transfer_id) WHERE c.amount != t.amount"
        ),
        "debited": debited,
        "credited": credited,
        "money_difference": debited - credited,
        # Each service's own books: balances agree with its journal.
        "payments_books_ok": ACCOUNTS * OPENING_BALANCE - one("SELECT SUM(balance) FROM accounts")
        == debited,
        "ledger_books_ok": one("SELECT SUM(balance) FROM ledger.balances") == credited,
        # Kafka: deliveries of a transfer id already delivered (the relay re-sent it).
        "redelivered": (
            one("SELECT COUNT(*) - COUNT(DISTINCT transfer_id) FROM ledger.received")
            if "received" in ledger
            else None
        ),
    }
    result["anomalies"] = (
        result["lost"]
        + result["extra_credit_rows"]
        + result["phantom"]
        + result["wrong_amount"]
        + (result["money_difference"] != 0)
        + (not result["payments_books_ok"])
        + (not result["ledger_books_ok"])
        + (published is not None and published != committed)
    )
    return result


# --- the workload -----------------------------------------------------------------


TITLE = (
    "transfer: debit + deposit, credited exactly once: transfers/s from GO until the "
    "ledger credited the last one (end to end) and until the payments service "
    "committed it (producer commits); kafka = transactional outbox + relay + "
    f"deduping consumer; full, {HANDLERS} handlers: one transfer per transaction, "
    "synchronous=FULL, the broker flushing every message"
)


def measure_handlers(
    systems: list[str],
    flushing: Any | None,
    transfers: int,
    repeats: int,
    after_run: Callable[[str], None] = lambda system: None,
) -> tuple[list[Series], list[Series]]:
    """Money at full durability: ``HANDLERS`` request handlers, one transfer per
    transaction, ``synchronous=FULL``, against ``flushing`` (a broker that flushes every
    message); each system's runs alternating with the others'. Transfers/s end to end,
    and as the producer committed them."""
    case = f"{transfers:,}, full, {HANDLERS} handlers"
    handled = {s: Series(_series_name(s), f"{case}, end to end", "tr/s") for s in systems}
    commits = {s: Series(_series_name(s), f"{case}, producer commits", "tr/s") for s in systems}
    for system in alternating(systems, repeats):
        with _folder() as folder:
            measured = flow(system, flushing, folder, transfers, 0, HANDLERS, "full")
        handled[system].values.append(transfers / measured.seconds)
        commits[system].values.append(transfers / measured.producer_seconds)
        after_run(system)
    return list(handled.values()), list(commits.values())


@contextlib.contextmanager
def flushing_broker() -> Iterator[Any]:
    """A second broker, ``log.flush.interval.messages=1``, warmed up."""
    from ..kafka.broker import KafkaBroker

    with KafkaBroker(flush_every_message=True) as broker:
        warm_up(broker)
        yield broker


def _series_name(system: str) -> str:
    return "kafka" if system == "kafka-outbox" else system  # comparison_table's ratio column


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="streamq-transfer-") as folder:
        yield Path(folder)


def _anomaly_table(crashes: list[dict[str, Any]]) -> Table:
    table = Table(
        title="transfer under kill -9, checked from the SQLite files: kills of producer/"
        "relay/consumer; transfers committed and checked; deposits lost; applied twice; "
        "re-sent by the relay (deduped by the ledger); money debited - credited; other: "
        "each side's books, drained, log == journal, no phantom or wrong credit"
    )
    table.add_column("system", no_wrap=True)
    for column in ("kills p/r/c", "checked", "lost", "twice", "re-sent", "money"):
        table.add_column(column, justify="right")
    table.add_column("other")
    for r in crashes:
        kills = r["kills"]
        relay = str(kills.get("relay", 0)) if r["system"] == "kafka-outbox" else "-"
        problems = [
            *([] if r["payments_books_ok"] and r["ledger_books_ok"] else ["books"]),
            *([] if r["drained"] else ["not drained"]),
            *(["log != journal"] if r["published"] not in (None, r["transfers_checked"]) else []),
            *(["phantom"] if r["phantom"] else []),
            *(["amounts"] if r["wrong_amount"] else []),
        ]
        red = "[bold red]" if r["anomalies"] else ""
        table.add_row(
            SHORT[r["system"]],
            f"{kills.get('producer', 0)}/{relay}/{kills.get('consumer', 0)}",
            f"{r['transfers_checked']:,}",
            f"{red}{r['lost']:,}",
            f"{red}{r['extra_credit_rows']:,}",
            "-" if r["redelivered"] is None else f"{r['redelivered']:,}",
            f"{red}{r['money_difference']:,}",
            "[bold red]" + ", ".join(problems) if problems else "ok",
        )
    return table


def run(broker: Any | None, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    seed = random.randrange(2**31) if seed is None else seed
    flow_systems = ["streamq"] + (["kafka-outbox"] if broker is not None else [])
    crash_systems = ["streamq"] + (["kafka-outbox", "kafka-naive"] if broker is not None else [])
    latency: LatencyRuns = {}
    console.print(
        f"[bold]transfer[/] kafka relay/naive producer {json.dumps(KAFKA_PRODUCER)}; "
        f"consumer {json.dumps(KAFKA_CONSUMER)}; relay polls the outbox every "
        f"{RELAY_POLL * 1000:g} ms (PRAGMA data_version); seed {seed}"
    )
    if broker is not None:
        warm_up(broker)
    steps = 3 * repeats * len(flow_systems) + repeats + sizes.kills * len(crash_systems)
    with contextlib.ExitStack() as stack, Progress(console=console, transient=True) as progress:
        task: TaskID = progress.add_task("transfer", total=steps)
        fast = _throughput_runs(progress, task, broker, flow_systems, sizes, repeats, latency)
        _paced_runs(progress, task, broker, flow_systems, sizes, repeats, latency)
        # Money at full durability: a broker that flushes every message, against streamq's
        # synchronous=FULL, both payments databases FULL too.
        flushing = None if broker is None else stack.enter_context(flushing_broker())
        progress.update(task, description=f"transfer: {HANDLERS} handlers, full")
        handled, handled_commits = measure_handlers(
            flow_systems,
            flushing,
            sizes.handler_transfers,
            repeats,
            lambda _: progress.advance(task),
        )
        crashes = _crash_runs(progress, task, broker, crash_systems, sizes, seed)
    series = [*fast, *handled, *handled_commits]
    console.print(comparison_table(TITLE, series))
    console.print(
        latency_table(
            "transfer latency, microseconds, from each transfer's commit (at a fixed rate: its "
            "due time) to the commit of its credit; max rate: the throughput runs, "
            f"{sizes.latency_rate:,}/s: {sizes.latency_seconds:g} s paced",
            latency,
        )
    )
    console.print(_anomaly_table(crashes))
    latency_series = percentile_series(latency)
    results = {
        "sizes": sizes.__dict__,
        "seed": seed,
        "kafka_producer": KAFKA_PRODUCER,
        "kafka_consumer": KAFKA_CONSUMER,
        "series": [asdict(s) for s in series + latency_series],
        "crash": crashes,
    }
    save("transfer", results, quick, partial=broker is None)
    return results


def _throughput_runs(
    progress: Progress,
    task: TaskID,
    broker: Any | None,
    systems: list[str],
    sizes: Sizes,
    repeats: int,
    latency: LatencyRuns,
) -> list[Series]:
    """Each system and the floor ``repeats`` times, alternating, as fast as they can; their
    latencies go into ``latency``. Returns transfers/s end to end per system, the floor's,
    then as each system's producer committed them."""
    throughput = {
        s: Series(_series_name(s), f"{sizes.transfers:,}, end to end", "tr/s") for s in systems
    }
    committing = {
        s: Series(_series_name(s), f"{sizes.transfers:,}, producer commits", "tr/s")
        for s in systems
    }
    # The same SQL with no framework (floor.py): what 1.5x the outbox asks for, in this run.
    floor = Series("floor", f"{sizes.transfers:,}, end to end", "tr/s")
    for system in alternating([*systems, "floor"], repeats):
        progress.update(task, description=f"transfer: throughput, {system}")
        if system == "floor":
            with _folder() as folder:
                floor.values.append(floor_flow(folder, sizes.transfers)[0])
            progress.advance(task)
            continue
        with _folder() as folder:
            measured = flow(system, broker, folder, sizes.transfers, 0)
        throughput[system].values.append(sizes.transfers / measured.seconds)
        committing[system].values.append(sizes.transfers / measured.producer_seconds)
        latency.setdefault((_series_name(system), "max rate"), []).append(measured.latency)
        progress.advance(task)
    return [*throughput.values(), floor, *committing.values()]


def _paced_runs(
    progress: Progress,
    task: TaskID,
    broker: Any | None,
    systems: list[str],
    sizes: Sizes,
    repeats: int,
    latency: LatencyRuns,
) -> None:
    """Each system ``repeats`` times, alternating, at ``sizes.latency_rate``: their
    latencies go into ``latency``."""
    paced_case = f"{sizes.latency_rate:,}/s"
    for system in alternating(systems, repeats):
        progress.update(task, description=f"transfer: latency, {system}")
        count = int(sizes.latency_rate * sizes.latency_seconds)
        with _folder() as folder:
            measured = flow(system, broker, folder, count, sizes.latency_rate)
        latency.setdefault((_series_name(system), paced_case), []).append(measured.latency)
        progress.advance(task)


def _crash_runs(
    progress: Progress,
    task: TaskID,
    broker: Any | None,
    systems: list[str],
    sizes: Sizes,
    seed: int,
) -> list[dict[str, Any]]:
    """One crash run per system, each with its own seed from ``seed``."""
    crashes = []
    for number, system in enumerate(systems):
        progress.update(task, description=f"transfer: kill -9, {system}")
        with _folder() as folder:
            crashes.append(
                crash_run(
                    system,
                    broker,
                    folder,
                    sizes.crash_transfers,
                    sizes.kills,
                    sizes.crash_rate,
                    seed + number,
                    on_kill=lambda _: progress.advance(task),
                )
            )
    return crashes


def main(argv: list[str] | None = None) -> int:
    return workload_main("python -m bench.transfer.run", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())

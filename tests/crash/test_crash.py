"""Exactly-once under kill -9 and SIGSTOP, with real processes (harness: tests/crashrun.py).

A few dozen kills of consumers (at random moments, before the transaction, after
applying but before COMMIT, right after COMMIT) and of producers (at random moments,
mid-transaction, mid-push), and a pause of each side longer than every timeout; the
oracle checks the history after every kill and at the end. ``make soak`` runs the same
harness for at least 1,000 kill cycles (``SOAK_ENGINE=postgres`` for the PostgreSQL run).

The same run on PostgreSQL: both databases on a throwaway server of the test's own, the
same kills, plus kill -9 of the server itself four times (while the producer, the
consumer and another writer are each held in the middle of a transaction, and once at a
random moment; restarted on its data directory and port, the programs carry on through
it) and two other writer processes publishing into the stream with ``streamq.publish``,
killed at random and mid-transaction too. There records are numbered after the commit,
by the serving producer (a publish returns a ``Receipt``): the writers journal their
commits by value, and the harness finds each in the log (or still pending) once, whole,
at consecutive seqs and in the order each writer committed them, with nothing left
pending at the end; the stream's length is counted in the business table every
publishing transaction updates.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ..crashrun import (
    CONSUMER_FAULTS,
    SERVER_KILL_MOMENTS,
    CrashRun,
    Figures,
    Plan,
    describe,
    seed_from_env,
)
from ..pgserver import PostgresMissingError, find_bindir

# Fewer records and consumer kills than the SQLite run (10,000 and 20, five at each kind
# of moment; the consumer's code is the same on both engines), the same 6 producer lives,
# to which the engine's defaults add 4 server kills and 2 other writers with 4 lives.
POSTGRES_PLAN = Plan(total=10_000, consumer_kills=20)


def check_delivered(run: CrashRun, result: Figures) -> None:
    """Every planned fault was delivered, and the oracle found nothing."""
    plan, context, faults = run.plan, run.context(), result.faults
    assert result.anomalies == 0 and result.records == plan.total, context
    assert run.consumer_kills() >= plan.consumer_kills, context
    for point in CONSUMER_FAULTS[1:]:
        assert faults[f"consumer {point}"] >= 3, context
    assert faults["consumer random"] >= 3, context
    producer_kills = sum(n for kind, n in faults.items() if kind.startswith("producer "))
    assert producer_kills - faults["producer pause"] >= len(plan.producer_lives), context
    assert faults["producer mid-tx"] >= 1 and faults["producer mid-push"] >= 1, context
    assert faults["producer pause"] == faults["consumer pause"] == 1, context
    assert result.checks > plan.consumer_kills, context


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_exactly_once_under_kill_9_and_pauses(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    run = CrashRun(tmp_path, seed_from_env(), Plan(), engine="sqlite")
    result = run.run()
    check_delivered(run, result)
    figures("runs 1, " + describe(result))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["table", "wal"])
def test_exactly_once_on_postgresql_under_kill_9_of_everything_and_other_writers(
    tmp_path: Path, figures: Callable[[str], None], path: str
) -> None:
    """Either publishing path: the pending table (``wal_level = replica``), or the WAL
    (``logical``: the serving producer killed mid-round, the server mid-commit, writers
    between INSERT and COMMIT, while records wait in the slot)."""
    try:
        find_bindir()
    except PostgresMissingError as exc:  # never a skip: the install hint
        pytest.fail(str(exc), pytrace=False)
    run = CrashRun(tmp_path, seed_from_env(), POSTGRES_PLAN, engine="postgres", wal=path == "wal")
    result = run.run()
    check_delivered(run, result)
    context, faults = run.context(), result.faults
    # The server killed once in the middle of each kind of transaction, once at random.
    for moment in SERVER_KILL_MOMENTS:
        assert faults[f"postgres kill {moment}"] == 1, context
    writer_lives = POSTGRES_PLAN.writer_lives
    assert faults["writer mid-tx"] == writer_lives.count("mid-tx") >= 1, context
    assert faults["writer random"] == writer_lives.count("external") >= 1, context
    assert result.writer_records > 0, context  # the other writers' records were applied too
    # The kills in the middle of their transactions: each of them failed and carried on.
    for program in ("producer", "consumer", "writer"):
        assert result.recoveries[f"{program} DBERROR"] >= 1, context
    figures("runs 1, " + describe(result))

"""Exactly-once under kill -9 and SIGSTOP, with real processes (harness: tests/crashrun.py).

A few dozen kills of consumers (at random moments, before the transaction, after
applying but before COMMIT, right after COMMIT) and of producers (at random moments,
mid-transaction, mid-push), and a pause of each side longer than every timeout; the
oracle checks the history after every kill and at the end. ``make soak`` runs the same
harness for at least 1,000 kill cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .crashrun import CONSUMER_FAULTS, CrashRun, Plan, describe, seed_from_env


@pytest.mark.timeout(150)
def test_exactly_once_under_kill_9_and_pauses(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    plan = Plan()
    run = CrashRun(tmp_path, seed_from_env(), plan)
    result = run.run()
    context = run.context()
    faults = result.faults

    # Every planned fault was delivered, and the oracle found nothing.
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
    figures("runs 1, " + describe(result))

"""The groups workload cannot rot: its quick mode, streamq's group against a Kafka consumer
group on a real broker, every kill's takeover measured and every table checked.

Run by ``make bench-smoke`` (not ``make test``): beside the other Kafka smoke tests on two
pytest workers it starved the transfer workload's crash run past its deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import charts
from bench.groups import run as groups

from .children import running_children


def our_programs() -> list[int]:
    """Pids of this process's children still running a benchmark program."""
    return [pid for pid, cmdline in running_children().items() if "-m bench." in cmdline]


@pytest.mark.timeout(240)
def test_quick_mode_measures_takeover_resharing_and_scaling(tmp_path: Path) -> None:
    try:
        results = groups.measure(True, groups.QUICK, seed=5)
    finally:
        assert our_programs() == []

    takeover = {r["system"]: r for r in results["takeover"]}
    assert list(takeover) == ["streamq", "kafka"]
    for r in takeover.values():
        context = f"{r['system']}: {r}"
        assert len(r["takeover_s"]) == groups.QUICK.kills, context
        assert r["drained"] and r["checks"]["records"] > 1000, context
        checks = r["checks"]
        assert checks["duplicates"] == checks["lost"] == checks["out_of_order"] == 0, context
        assert r["ok"] and r["expelled_alive"] == 0, context
    # streamq sees a killed member's lock go at its next look, not at lease_timeout (10 s);
    # Kafka only once the session ends, from the last heartbeat before the kill.
    assert max(takeover["streamq"]["takeover_s"]) < 5.0, takeover["streamq"]
    assert min(takeover["kafka"]["takeover_s"]) > groups.SESSION_MS / 2000, takeover["kafka"]

    reshare = results["reshare"]
    assert reshare["ok"], reshare
    assert sorted(map(int, reshare["first_apply_s"])) == list(range(groups.RESHARE_TO))
    assert 0 < reshare["all_held_s"] < 30 and reshare["group_gap_s"] > 0, reshare
    sizes = groups.QUICK
    assert len(reshare["per_bin"]) == round((sizes.before + sizes.after) / groups.BIN)
    assert sum(reshare["per_bin"]) > 0.8 * groups.RATE * (sizes.before + sizes.after)

    scaling = results["scaling"]
    for variant in ("group", "shares"):
        rates = scaling["median_rate"][variant]
        assert sorted(map(int, rates)) == list(groups.QUICK.members), scaling
        assert all(rate > 0 for rate in rates.values()), scaling

    assert [table.title for table in groups.tables(results)]
    (chart,) = charts.groups(results, tmp_path)
    assert chart.stat().st_size > 10_000

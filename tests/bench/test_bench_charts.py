"""The charts redraw from the stored results alone (``python -m bench.charts``), each
labelled with its machine and date; only whole runs replace the stored results."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from bench import charts
from bench.common import results_dir


def test_every_stored_result_redraws(tmp_path: Path) -> None:
    for stored in charts.RESULTS.glob("*.json"):
        shutil.copy(stored, tmp_path)
    assert charts.main([str(tmp_path)]) == 0
    drawn = {path.name for path in tmp_path.glob("*.png")}
    committed = {path.name for path in charts.RESULTS.glob("*.png")}
    assert committed <= drawn
    assert all((tmp_path / name).stat().st_size > 10_000 for name in drawn)


def test_label_names_machine_and_date() -> None:
    stored = json.loads((charts.RESULTS / "pipe.json").read_text())
    assert charts.machine_label(stored).startswith(f"{stored['machine']['cores']} cores, Python ")
    assert charts.machine_label({}) == "cores not recorded, Python not recorded, date not recorded"


def test_quick_and_partial_runs_save_where_git_ignores_them() -> None:
    """A run without Kafka or NATS must not overwrite the committed figures."""
    assert results_dir(quick=False) == charts.RESULTS
    for quick, partial in ((True, False), (False, True), (True, True)):
        folder = results_dir(quick, partial)
        assert folder != charts.RESULTS
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(folder / "pipe.json")],
            cwd=charts.RESULTS,
            check=False,
        )
        assert ignored.returncode == 0, f"{folder} is not ignored by git"


def test_workers_and_pg_load_compare_delivered_per_second(tmp_path: Path) -> None:
    """The ratio drawn after each case is of delivered/s; results stored before it, with
    commits/s alone, still draw."""
    values = {
        ("streamq", "1 worker"): [300.0, 100.0, 200.0],
        ("kafka", "1 worker"): [400.0],
        ("streamq", "2 workers"): [100.0],
    }
    assert charts.with_ratios(values) == {
        ("streamq", "1 worker: 0.50x"): [300.0, 100.0, 200.0],
        ("kafka", "1 worker: 0.50x"): [400.0],
        ("streamq", "2 workers"): [100.0],
    }
    stored = json.loads((charts.RESULTS / "workers.json").read_text())
    delivered = [
        {**s, "unit": "delivered/s", "values": [v / 2 for v in s["values"]]}
        for s in stored["series"]
        if s["unit"] == "commits/s"
    ]
    for results in (stored, {**stored, "series": stored["series"] + delivered}):
        (chart, *_) = charts.workers(results, tmp_path)
        assert chart.stat().st_size > 10_000

"""``python -m bench.tools.lock_hold``: how long each SQLite write path holds the write
lock, against a plain outbox, in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tools import lock_hold
from streamq.engines.sqlite import storage


def test_every_write_path_is_timed_against_the_outbox(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commit = storage.SQLiteBlockingWriter.commit
    out = tmp_path / "lock_hold.json"
    argv = ["--transactions", "40", "--rounds", "2", "--warm", "10", "--out", str(out)]
    assert lock_hold.main(argv) == 0
    paths = json.loads(out.read_text())["paths"]
    assert list(paths) == list(lock_hold.PATHS)
    for figures in paths.values():
        assert figures["transactions"] == 40
        assert 0 < figures["p50_us"] <= figures["p99_us"]
    assert paths["outbox"]["p50_ratio"] == 1.0
    assert "Producer.transaction()" in capsys.readouterr().out
    assert storage.SQLiteBlockingWriter.commit is commit  # the timing undone

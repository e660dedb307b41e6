"""``python -m bench.tools.fanout_cost``: the producer's CPU per commit with N readers."""

from __future__ import annotations

import pytest

from bench.tools import fanout_cost


def test_the_cost_of_readers_at_the_head_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    assert fanout_cost.main(["--consumers", "0,5", "--commits", "100", "--rate", "500"]) == 0
    lines = capsys.readouterr().out.splitlines()
    per_commit = {int(line.split()[0]): float(line.split()[2]) for line in lines}
    assert list(per_commit) == [0, 5]
    assert all(figure > 0 for figure in per_commit.values())
    assert "µs a reader" in lines[1]

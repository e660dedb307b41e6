"""Power loss: images of the producer's database as a power loss could leave it, checked with
a real restarted producer and real consumers (see tests/powerloss.py for the method)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ..powerloss import sweep


@pytest.mark.parametrize("durability", ["normal", "full"])
def test_power_loss_images(durability: str, tmp_path: Path) -> None:
    figures = asyncio.run(sweep(durability, 12, 7, tmp_path))  # type: ignore[arg-type]
    print(figures.report())
    assert figures.images >= 2 * 12 and figures.integrity_ok == figures.images
    assert figures.acknowledged_lost == 0
    assert figures.undetected == 0 and figures.detected == figures.regressions
    if durability == "normal":
        assert figures.commits_lost > 0 and figures.reused_detected > 0
    else:
        assert figures.regressions == 0
    assert figures.resumed > 0

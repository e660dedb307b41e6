"""The pause between rounds of serving work that follow each other under load.

The fan-out's rounds (``fanout``) and the commit watcher's looks (``commit_watcher``)
both follow one rule: the next round waits ``GAP_RATIO`` times as long as the last one
took, counted from its end, within a floor and a ceiling. Serving then takes at most
about a quarter of the event loop, whatever the load; commits that come faster than a
round share the next one (fewer, fuller frames and catch-ups); and a round after a
quiet spell starts at once, so latency at low rates does not move.
"""

from __future__ import annotations

import math

GAP_RATIO = 3.0


class Spacing:
    """Where one kind of round stands: when the last ended and how long it took."""

    __slots__ = ("ended", "least", "most", "took")

    def __init__(self, least: float, most: float) -> None:
        self.least, self.most = least, most
        self.took = 0.0
        self.ended = -math.inf

    def pause(self, now: float) -> float:
        """Seconds to wait at ``now`` before the next round (0 or less: none)."""
        return self.ended + min(self.most, max(self.least, self.took * GAP_RATIO)) - now

    def done(self, took: float, ended: float) -> None:
        """A round ended at ``ended``, its work having taken ``took``."""
        self.took, self.ended = took, ended

"""Named fault points for the crash test programs: ``STREAMQ_FAULT=POINT:N`` kills at the N-th hit.

A program calls ``FAULTS.due(point)`` where the fault may strike (it counts the hits)
and ``FAULTS.fire(point, detail)`` to die there: it prints ``FAULT POINT N DETAIL``
(flushed, so the test can tell a planned death from a crash) and SIGKILLs itself,
so no ``finally`` block, atexit handler or buffered write runs.
"""

from __future__ import annotations

import os
import signal

ENV = "STREAMQ_FAULT"


class Faults:
    def __init__(self, spec: str) -> None:
        point, _, count = spec.partition(":")
        self.point = point
        self.at = int(count or 1)
        self.hits = 0

    def armed(self, point: str) -> bool:
        return self.point == point

    def due(self, point: str) -> bool:
        """Count a hit of ``point``; True when this is the hit the fault is set for."""
        if self.point != point:
            return False
        self.hits += 1
        return self.hits == self.at

    def fire(self, point: str, detail: str = "") -> None:
        print(f"FAULT {point} {self.hits} {detail}".rstrip(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


FAULTS = Faults(os.environ.get(ENV, ""))

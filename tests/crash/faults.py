"""Named fault points for the crash test programs: ``STREAMQ_FAULT=POINT:N`` kills at the N-th hit.

A program calls ``FAULTS.due(point)`` where the fault may strike (it counts the hits)
and ``FAULTS.fire(point, detail)`` to die there: it prints ``FAULT POINT N DETAIL``
(flushed, so the test can tell a planned death from a crash) and SIGKILLs itself,
so no ``finally`` block, atexit handler or buffered write runs.

``STREAMQ_HOLD=POINT:N`` stops the process instead, at the N-th hit of its point
(``HOLDS.due``, ``HOLDS.hold``): it prints ``HOLD POINT N DETAIL`` and SIGSTOPs itself,
so that the test does something at that very moment (kill -9 the database server in the
middle of the program's transaction) before it SIGCONTs it.
"""

from __future__ import annotations

import os
import signal

ENV = "STREAMQ_FAULT"
HOLD_ENV = "STREAMQ_HOLD"


class Faults:
    def __init__(self, spec: str) -> None:
        point, _, count = spec.partition(":")
        self.point = point
        self.at = int(count or 1)
        self.hits = 0
        self.spent = False  # held once: a hold happens once

    def armed(self, point: str) -> bool:
        return self.point == point

    def pending(self, point: str) -> bool:
        """Set for ``point``, and its hit not come yet."""
        return self.point == point and self.hits < self.at and not self.spent

    def due(self, point: str) -> bool:
        """Count a hit of ``point``; True when this is the hit the fault is set for."""
        if self.point != point or self.spent:
            return False
        self.hits += 1
        return self.hits == self.at

    def again(self, point: str) -> None:
        """The hit the fault was set for did not get to its point (its transaction failed
        first, the database server being killed): the next hit is the one."""
        if self.point == point and self.hits >= self.at and not self.spent:
            self.at = self.hits + 1

    def fire(self, point: str, detail: str = "") -> None:
        print(f"FAULT {point} {self.hits} {detail}".rstrip(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def hold(self, point: str, detail: str = "") -> None:
        """Stop here until the test continues this process (SIGCONT)."""
        self.spent = True
        print(f"HOLD {point} {self.hits} {detail}".rstrip(), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


FAULTS = Faults(os.environ.get(ENV, ""))
HOLDS = Faults(os.environ.get(HOLD_ENV, ""))

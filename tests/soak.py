"""``make soak``: the crash harness (tests/crashrun.py) run after run, for >= 1,000 kill cycles.

    python -m tests.soak [--kills 1000] [--max-seconds 1800] [--seed S]

Each run is a fresh producer and consumer database with the plan of tests/crash/test_crash.py
(kills at random moments and at every fault point, pauses beyond every timeout), checked
by the oracle after every kill and at its end. Runs go on until ``--kills`` kill cycles
are done or ``--max-seconds`` have passed (a run is never cut short). Prints the figures;
exits 1 on any anomaly or if fewer kills than asked for were delivered in time.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .crashrun import CrashRun, Plan, describe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=1000, help="kill cycles to deliver")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="time bound")
    parser.add_argument("--seed", type=int, default=None, help="seed of the first run")
    args = parser.parse_args()
    seeds = random.Random(args.seed)
    started = time.monotonic()
    faults: Counter[str] = Counter()
    runs = records = checks = anomalies = kills = 0
    while kills < args.kills and time.monotonic() - started < args.max_seconds:
        seed = seeds.randrange(2**32)
        with tempfile.TemporaryDirectory(prefix="streamq-soak-") as tmp:
            try:
                figures = CrashRun(Path(tmp), seed, Plan()).run()
            except AssertionError as exc:
                print(f"run {runs + 1} FAILED (seed {seed}): {exc}", flush=True)
                anomalies += 1
                break
        runs += 1
        kills += figures.kills
        records += figures.records
        checks += figures.checks
        anomalies += figures.anomalies
        faults.update(figures.faults)
        print(f"run {runs}: {describe(figures)}", flush=True)
    elapsed = time.monotonic() - started
    by_kind = ", ".join(f"{kind} {n}" for kind, n in sorted(faults.items()))
    print(
        f"soak: runs {runs}, kill cycles {kills}, faults injected {sum(faults.values())} "
        f"({by_kind}), records checked {records} (oracle run {checks} times), "
        f"anomalies {anomalies}; {elapsed:.0f} s"
    )
    return 0 if anomalies == 0 and kills >= args.kills else 1


if __name__ == "__main__":
    sys.exit(main())

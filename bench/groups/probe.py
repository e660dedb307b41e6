"""How low can a Kafka consumer group's session go? ``python -m bench.groups.probe
[--kills 6] [--sessions 1000:250,500:125,...]``: the takeover runs of ``bench.groups.run``,
Kafka only, at each session.timeout.ms:heartbeat.interval.ms, on one broker whose
group.min.session.timeout.ms is the lowest of them. A setting works when every run kept
its members (none expelled while alive), took every share over and passed the checks;
the workload uses the lowest that works (``run.SESSION_MS``, ``run.HEARTBEAT_MS``).
Adds its runs to ``groups_probe.json`` beside the workload's results (``--fresh``: replaces
them), each with its date: a setting that works once may not the next time.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

from ..common import RESULTS, console, save
from .run import FULL, group_broker, takeovers

SESSIONS = "6000:1500,3000:750,1000:250,500:125,250:60,100:25"


def probe(session: tuple[int, int], broker: Any, kills: int, seed: int) -> dict[str, Any]:
    """One takeover run at ``session``; what failed, if anything."""
    sizes = replace(FULL, kills=kills)
    found: dict[str, Any] = {"session_ms": session[0], "heartbeat_ms": session[1]}
    with tempfile.TemporaryDirectory(prefix="streamq-groups-probe-") as folder:
        try:
            found |= takeovers(
                "kafka", broker, Path(folder), sizes, random.Random(seed), session=session
            )
        except (TimeoutError, RuntimeError) as error:
            return {**found, "works": False, "error": str(error)}
    return {**found, "works": found["ok"] and not found["expelled_alive"]}


def why(r: dict[str, Any]) -> str:
    """What broke at a setting that does not work, in a few words."""
    if "error" in r:
        return str(r["error"]).removeprefix("groups: ")
    checks = r["checks"]
    broken = [f"{checks[k]:,} {k}" for k in ("duplicates", "lost", "out_of_order") if checks[k]]
    return ", ".join(broken or [f"{r['expelled_alive']} shares taken from live members"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.groups.probe", description=__doc__)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--sessions", default=SESSIONS, help="SESSION_MS:HEARTBEAT_MS,...")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="forget the runs saved before")
    args = parser.parse_args(argv)
    sessions = [
        (int(s), int(h)) for s, _, h in (p.partition(":") for p in args.sessions.split(","))
    ]
    table = Table(title="Kafka consumer group sessions: takeover after kill -9, seconds")
    for column in ("session ms", "heartbeat ms", "p50", "p99", "expelled alive", "works"):
        table.add_column(column, justify="right")
    runs = []
    with group_broker(min(s for s, _ in sessions)) as broker:
        for session in sessions:
            r = probe(session, broker, args.kills, args.seed)
            runs.append({**r, "at": time.time()})
            table.add_row(
                *map(str, session),
                *(f"{r[k]:.3f}" if k in r else "" for k in ("p50_s", "p99_s")),
                str(r.get("expelled_alive", "")),
                "yes" if r["works"] else f"no: {why(r)}",
            )
    console.print(table)
    saved = RESULTS / "groups_probe.json"
    if saved.exists() and not args.fresh:
        runs = json.loads(saved.read_text())["runs"] + runs
    save("groups_probe", {"runs": runs}, quick=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

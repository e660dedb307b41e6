"""The groups workload's driver: streamq's consumer groups against a Kafka consumer group.

1. **Takeover after kill -9.** Four members over four shares (streamq: ``GroupConsumer``,
   shares=4; Kafka: four partitions, ``cooperative-sticky``, the lowest session timeout
   that works), a producer writing ``RATE`` records a second over ``KEYS`` keys, every
   member applying into ONE SQLite database (``bench/groups/common.py``). Each kill: a
   member holding a share is SIGKILLed; the takeover is the time from the kill to the
   ``applied_at`` of the first record of its share applied by another member, read from
   the database; then a replacement starts and the group is balanced again (every share
   held once, one each) before the next kill. After the last, the producer stops, the
   group drains and the table is checked: every record applied once, each key in order.
2. **Online resharing 4 -> 8** (streamq only: a Kafka topic's partition count cannot grow
   without moving keys between partitions, breaking per-key order): eight members from the
   start over shares=4 (four standbys), then ``streamq.consumer.database.reshare(db, GROUP, 8)``
   while the producer writes. Measured from the table: duplicates, lost records, key-order
   violations, the longest gap between applies across the group and per key, and records
   applied per 100 ms before, during and after.
3. **Scaling** 1/2/4/8 members (quick: 1 and 4) of a group with shares=8 over the shares
   workload's slow apply (``bench/shares``: 0.2 ms per record, PostgreSQL effects), against
   the same workload's hand-given shares in the same run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress
from rich.table import Table

from ..common import Reporting, console, save, wait_until, workload_main
from .common import (
    GROUP,
    KEYS,
    SHARES,
    WAIT,
    applied_count,
    balanced,
    check,
    create,
    first_applied_after,
    held,
    passed,
    reading,
)

STREAMQ = "bench.groups.streamq"
KAFKA = "bench.groups.kafka"
RATE = 1000  # records/s, both producers
RESHARE_TO = 8
SCALE_SHARES = 8  # the group's split in the scaling runs: members come and go, it stays

# Kafka's session: the lowest that works on this machine (docs/benchmarks.md, "Consumer
# groups"). The broker's group.min.session.timeout.ms (6,000 by default) is lowered to it.
SESSION_MS = 1000
HEARTBEAT_MS = 250


@dataclass(frozen=True)
class Sizes:
    kills: int
    settle: float  # s the balanced group applies before each kill
    before: float  # s of resharing run before the change
    after: float  # s after it
    members: tuple[int, ...]  # the scaling runs' member counts
    count: int  # records in each scaling run
    repeats: int  # scaling runs per member count


QUICK = Sizes(kills=3, settle=0.3, before=1.0, after=2.0, members=(1, 4), count=2_000, repeats=1)
FULL = Sizes(
    kills=30, settle=1.0, before=10.0, after=10.0, members=(1, 2, 4, 8), count=40_000, repeats=3
)


def losses(members: list[Reporting]) -> int:
    """Shares taken from members while they lived (seen stalled, or their session expired)."""
    return sum(int((m.last("LOST") or ["0"])[0]) for m in members)


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: of 30 values, p99 is the largest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# --- 1. takeover after kill -9 ------------------------------------------------------------


@contextlib.contextmanager
def deployment(
    system: str, broker: Any, folder: Path, db: str, session: tuple[int, int]
) -> Iterator[tuple[Reporting, Callable[[], Reporting]]]:
    """The system's producer, writing, and how to start one of its members (Kafka's with
    ``session``: session.timeout.ms and heartbeat.interval.ms)."""
    with contextlib.ExitStack() as stack:
        if system == "streamq":
            producer = stack.enter_context(
                Reporting(STREAMQ, "producer", folder / "producer.db", RATE)
            )
            (address,) = producer.expect("READY", timeout=WAIT)
            yield producer, lambda: Reporting(STREAMQ, "member", address, db, SHARES)
            return
        topic = f"groups-{uuid.uuid4().hex[:8]}"
        broker.create_topic(topic, SHARES)
        bootstrap = broker.bootstrap
        producer = stack.enter_context(Reporting(KAFKA, "producer", bootstrap, topic, RATE))
        producer.expect("READY", timeout=WAIT)
        yield producer, lambda: Reporting(KAFKA, "member", bootstrap, topic, db, *session)


def drain(producer: Reporting, conn: Any, members: list[Reporting]) -> dict[str, Any]:
    """Stop the producer, wait until every record it wrote is applied, stop the members:
    the records written, whether all were applied, and the members that failed (an exit
    other than 0 when told to STOP)."""
    producer.send("STOP")
    head = int(producer.expect("DONE", timeout=WAIT)[0])
    try:
        wait_until("drain", lambda: applied_count(conn) >= head)
        drained = True
    except TimeoutError:
        drained = False
    live = [m for m in members if m.alive]
    for m in live:
        m.send("STOP")
    failed = 0
    for m in live:
        try:
            failed += m.process.wait(timeout=30) != 0
        except subprocess.TimeoutExpired:
            failed += 1  # stopped by force on the way out
    return {"head": head, "drained": drained, "members_failed": failed}


def takeovers(
    system: str,
    broker: Any,
    folder: Path,
    sizes: Sizes,
    rng: random.Random,
    on_kill: Callable[[], None] = lambda: None,
    session: tuple[int, int] = (SESSION_MS, HEARTBEAT_MS),
) -> dict[str, Any]:
    """``sizes.kills`` kills of a member holding a share, each measured from the kill to
    another member's first apply of that share; the table checked after."""
    db = str(folder / f"{system}-takeover.db")
    create(db)
    kills: list[dict[str, Any]] = []
    with (
        deployment(system, broker, folder, db, session) as (producer, start),
        contextlib.ExitStack() as stack,
        reading(db) as conn,
    ):
        every = [stack.enter_context(start()) for _ in range(SHARES)]
        members = list(every)
        for number in range(sizes.kills):
            wait_until("balanced group", lambda: balanced(members, SHARES))
            time.sleep(sizes.settle)  # the group applies, balanced, for a while
            victim = rng.choice([m for m in members if m.alive and held(m)])
            parts = held(victim)
            killed_at = time.time()
            victim.kill()
            applied_at = wait_until(
                f"apply of share {parts} after kill {number}",
                lambda: first_applied_after(conn, killed_at, parts, victim.process.pid),  # noqa: B023
            )
            members.remove(victim)
            replacement = stack.enter_context(start())
            every.append(replacement)
            members.append(replacement)
            wait_until("balanced group", lambda: balanced(members, SHARES))
            kills.append(
                {
                    "shares": parts,
                    "takeover_s": applied_at - killed_at,
                    "balanced_s": time.time() - killed_at,  # with the replacement in
                }
            )
            on_kill()
        end = drain(producer, conn, members)
        checks = check(conn, end["head"])
    seconds = [k["takeover_s"] for k in kills]
    return {
        "system": system,
        "kills": kills,
        "takeover_s": seconds,
        "p50_s": percentile(seconds, 50),
        "p99_s": percentile(seconds, 99),
        "max_s": max(seconds),
        "balanced_p50_s": statistics.median(k["balanced_s"] for k in kills),
        "drained": end["drained"],
        "members_failed": end["members_failed"],
        "checks": checks,
        "ok": end["drained"] and not end["members_failed"] and passed(checks),
        "expelled_alive": losses(every),
    }


# --- 2. online resharing -----------------------------------------------------------------

BIN = 0.1  # s: records applied per bin, over time
AROUND = (-2.0, 5.0)  # s from the reshare: the window around the change


def resharing(folder: Path, sizes: Sizes) -> dict[str, Any]:
    """Eight members over shares=4 (four standbys), then ``reshare(db, GROUP, 8)`` while
    the producer writes; the pauses and the throughput around it, the table checked."""
    from streamq.consumer.database import reshare

    db = str(folder / "reshare.db")
    create(db)
    with (
        deployment("streamq", None, folder, db, (0, 0)) as (producer, start),
        contextlib.ExitStack() as stack,
        reading(db) as conn,
    ):
        members = [stack.enter_context(start()) for _ in range(RESHARE_TO)]
        wait_until("balanced group", lambda: balanced(members, SHARES))
        time.sleep(sizes.before)  # the group applies, 4 members and 4 standbys
        at = time.time()
        moves = reshare(db, GROUP, RESHARE_TO)
        returned = time.time()
        wait_until(f"{RESHARE_TO} shares held", lambda: balanced(members, RESHARE_TO))
        held_at = time.time()
        # Applied after reshare() returned: under the new split (the old leases are gone,
        # and a batch under one is refused in its transaction).
        first = {
            share: wait_until(
                f"an apply of new share {share}",
                lambda: first_applied_after(conn, returned, [share], 0),  # noqa: B023
            )
            for share in range(RESHARE_TO)
        }
        time.sleep(max(0.0, at + sizes.after - time.time()))
        end = drain(producer, conn, members)
        checks = check(conn, end["head"])
        rows = conn.execute(
            "SELECT seq, key, published_at, applied_at FROM applied ORDER BY seq"
        ).fetchall()
    figures = pauses(rows, at, sizes)
    return {
        "members": RESHARE_TO,
        "standbys": RESHARE_TO - SHARES,
        "from_shares": SHARES,
        "to_shares": RESHARE_TO,
        "moves": len(moves),
        "reshare_call_s": returned - at,
        "all_held_s": held_at - at,
        "first_apply_s": {str(s): t - at for s, t in first.items()},
        "drained": end["drained"],
        "members_failed": end["members_failed"],
        "checks": checks,
        "ok": end["drained"] and not end["members_failed"] and passed(checks),
        **figures,
        "goal_met": figures["group_gap_s"] <= 1.0 and figures["key_pause_s"] <= 1.0,
    }


def pauses(rows: list[tuple[int, bytes, float, float]], at: float, sizes: Sizes) -> dict[str, Any]:
    """From the applied rows (in seq order) and the reshare's time ``at``:

    - the longest gap between consecutive applies across the group, around the change
      and before it;
    - per key, the longest a record waited once it could be applied (published, and the
      key's record before it applied): ``applied_at - max(published_at, previous applied_at)``;
    - records applied per ``BIN`` from ``sizes.before`` before to ``sizes.after`` after.
    """
    low, high = at + AROUND[0], at + AROUND[1]
    before = at - sizes.before
    times = sorted(r[3] for r in rows)
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    previous: dict[bytes, float] = {}
    waits: list[tuple[float, float]] = []
    for _, key, published, applied in rows:
        waits.append((applied - max(published, previous.get(key, published)), applied))
        previous[key] = max(applied, previous.get(key, applied))
    bins = [0] * round((sizes.before + sizes.after) / BIN)
    for t in times:
        i = math.floor((t - before) / BIN)
        if 0 <= i < len(bins):
            bins[i] += 1
    split = round(sizes.before / BIN)  # the reshare's bin
    during = bins[split : split + round(2.0 / BIN)]
    after = bins[split + len(during) :]
    return {
        "group_gap_s": max((g for g, t in gaps if low <= t <= high), default=0.0),
        "group_gap_before_s": max((g for g, t in gaps if before <= t < at), default=0.0),
        "key_pause_s": max((w for w, t in waits if low <= t <= high), default=0.0),
        "key_pause_before_s": max((w for w, t in waits if before <= t < at), default=0.0),
        "bin_s": BIN,
        "bins_from_s": -sizes.before,
        "per_bin": bins,
        "per_bin_before": statistics.mean(bins[:split]),
        "per_bin_during_min": min(during),
        "per_bin_during": statistics.mean(during),
        "per_bin_after": statistics.mean(after) if after else 0.0,
    }


# --- 3. scaling ---------------------------------------------------------------------------


def scaling(sizes: Sizes, folder: Path, on_run: Callable[[], None]) -> dict[str, Any]:
    """records/s of ``sizes.members`` group members over the shares workload's slow apply,
    and of the same workload's hand-given shares, alternating, in one run."""
    from ..common import Child
    from ..shares import run as shares

    rates: dict[str, dict[str, list[float]]] = {"group": {}, "shares": {}}
    with (
        shares.postgres() as server,
        Child(shares.PROGRAMS, "producer", folder / "scale.db", sizes.count, shares.KEYS) as p,
    ):
        (address,) = p.expect("READY", timeout=300)
        for r in range(sizes.repeats):
            for n in sizes.members:
                for variant in ("group", "shares") if r % 2 == 0 else ("shares", "group"):
                    name = f"groups_{variant}_{n}_{r}"
                    if variant == "group":
                        figures = shares.run_group_once(
                            server, address, n, SCALE_SHARES, sizes.count, name
                        )
                    else:
                        figures = shares.run_once(server, address, n, sizes.count, name)
                    rates[variant].setdefault(str(n), []).append(figures["rate"])
                    on_run()
    medians = {v: {n: statistics.median(rs) for n, rs in by_n.items()} for v, by_n in rates.items()}
    one = medians["group"][str(sizes.members[0])]
    return {
        "count": sizes.count,
        "keys": shares.KEYS,
        "apply_ms": shares.APPLY_MS,
        "group_shares": SCALE_SHARES,
        "rates": rates,
        "median_rate": medians,
        "group_speedup": {n: rate / one for n, rate in medians["group"].items()},
        # The goal: 8 members at 5x one or more (None: no run of 8, as in quick mode).
        "goal_met": None if "8" not in medians["group"] else medians["group"]["8"] >= 5 * one,
    }


# --- entry ------------------------------------------------------------------------------


@contextlib.contextmanager
def group_broker(session_ms: int = SESSION_MS) -> Iterator[Any]:
    """A broker whose groups may have sessions as short as ``session_ms``."""
    from ..kafka.broker import KafkaBroker

    with KafkaBroker(extra_config={"group.min.session.timeout.ms": session_ms}) as broker:
        yield broker


def run(broker: Any | None, quick: bool, repeats: int, seed: int | None = None) -> dict[str, Any]:
    """``broker`` only says whether Kafka runs: its group gets a broker of its own, whose
    minimum session timeout is lowered to ``SESSION_MS``. ``repeats`` is ignored: the kills
    are the takeover's repeats, and the scaling runs ``sizes.repeats`` of each count."""
    sizes = QUICK if quick else FULL
    seed = random.randrange(2**31) if seed is None else seed
    console.print(
        f"[bold]groups[/] {RATE:,} records/s over {KEYS:,} keys; streamq GroupConsumer "
        f"defaults (poll_interval 0.2 s, lease_timeout 10 s); Kafka cooperative-sticky, "
        f"session.timeout.ms={SESSION_MS}, heartbeat.interval.ms={HEARTBEAT_MS}, broker "
        f"group.min.session.timeout.ms={SESSION_MS}; seed {seed}"
    )
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("groups", total=None)

        def step(what: str) -> None:
            progress.update(task, description=f"groups: {what}")

        results = measure(broker is not None, sizes, seed, step)
    for table in tables(results):
        console.print(table)
    save("groups", results, quick, partial=broker is None)
    return results


def measure(
    kafka: bool, sizes: Sizes, seed: int, step: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """The three parts, in one temporary folder (and, with ``kafka``, on a broker of their
    own); ``step`` is told what runs now."""
    rng = random.Random(seed)
    systems = ["streamq"] + (["kafka"] if kafka else [])
    results: dict[str, Any] = {
        "sizes": asdict(sizes),
        "seed": seed,
        "rate": RATE,
        "keys": KEYS,
        "shares": SHARES,
        "kafka_session_ms": SESSION_MS,
        "kafka_heartbeat_ms": HEARTBEAT_MS,
        "kafka_min_session_ms": SESSION_MS,
        "load_before": os.getloadavg(),  # other work on the machine: 1, 5, 15 min averages
    }
    with tempfile.TemporaryDirectory(prefix="streamq-groups-") as name:
        folder = Path(name)
        with contextlib.ExitStack() as stack:  # the broker stops before the streamq-only parts
            broker = stack.enter_context(group_broker()) if kafka else None
            results["takeover"] = []
            for system in systems:
                (folder / system).mkdir()
                killed = counting(step, f"kill -9, {system}", sizes.kills)
                results["takeover"].append(
                    takeovers(system, broker, folder / system, sizes, rng, killed)
                )
        step("resharing 4 -> 8")
        (folder / "reshare").mkdir()
        results["reshare"] = resharing(folder / "reshare", sizes)
        scaled = counting(step, "scaling, run", 2 * len(sizes.members) * sizes.repeats)
        results["scaling"] = scaling(sizes, folder, scaled)
    results["load_after"] = os.getloadavg()
    return results


def counting(step: Callable[[str], None], what: str, total: int) -> Callable[[], None]:
    """A callback telling ``step`` how many of ``total`` are done, each time it is called."""
    done = 0
    step(f"{what} 0 of {total}")

    def advance() -> None:
        nonlocal done
        done += 1
        step(f"{what} {done} of {total}")

    return advance


def failures(r: dict[str, Any]) -> str:
    """What a part's checks found wrong, in a few words."""
    checks = r["checks"]
    kinds = ("duplicates", "lost", "out_of_order", "unknown")
    found = [f"{checks[k]:,} {k.replace('_', ' ')}" for k in kinds if checks[k]]
    if not r["drained"]:
        found.append("not drained")
    if r["members_failed"]:
        found.append(f"{r['members_failed']} members failed")
    return ", ".join(found)


def tables(results: dict[str, Any]) -> list[Table]:
    """The three parts' figures as printed."""
    takeover = Table(
        title="takeover after kill -9: from the kill to another member's first apply of the "
        "killed member's share, seconds (balanced again: with a replacement started after the "
        "takeover, every share held once); then the table checked (exactly once, key order)"
    )
    for column in ("system", "kills", "p50", "p99", "max", "vs Kafka p99", "balanced again p50",
                   "expelled alive", "checks"):  # fmt: skip
        takeover.add_column(column, justify="left" if column == "system" else "right")
    kafka = {r["system"]: r for r in results["takeover"]}.get("kafka")
    for r in results["takeover"]:
        ratio = f"{r['p99_s'] / kafka['p99_s']:.2f}x" if kafka and r["system"] != "kafka" else ""
        checks = "ok" if r["ok"] else f"[bold red]{failures(r)}"
        takeover.add_row(
            r["system"], str(len(r["kills"])), f"{r['p50_s']:.3f}", f"{r['p99_s']:.3f}",
            f"{r['max_s']:.3f}", ratio, f"{r['balanced_p50_s']:.3f}", str(r["expelled_alive"]),
            checks,
        )  # fmt: skip
    r = results["reshare"]
    reshare = Table(
        title=f"online resharing {r['from_shares']} -> {r['to_shares']} at {results['rate']:,} "
        f"records/s, {r['members']} members ({r['standbys']} standbys before)"
    )
    reshare.add_column("figure")
    reshare.add_column("value", justify="right")
    checks = r["checks"]
    for label, value in (
        ("duplicates / lost / key-order violations",
         f"{checks['duplicates']} / {checks['lost']} / {checks['out_of_order']}"),
        ("records checked", f"{checks['records']:,}" + ("" if r["drained"] else " NOT drained")),
        ("reshare() call", f"{r['reshare_call_s'] * 1000:.0f} ms"),
        ("every new share held after", f"{r['all_held_s']:.3f} s"),
        ("every new share applying after", f"{max(r['first_apply_s'].values()):.3f} s"),
        ("longest gap across the group: around / before",
         f"{r['group_gap_s']:.3f} / {r['group_gap_before_s']:.3f} s"),
        ("longest per-key pause: around / before",
         f"{r['key_pause_s']:.3f} / {r['key_pause_before_s']:.3f} s"),
        (f"records per {r['bin_s'] * 1000:.0f} ms: before / during (min) / after",
         f"{r['per_bin_before']:.0f} / {r['per_bin_during']:.0f} ({r['per_bin_during_min']}) / "
         f"{r['per_bin_after']:.0f}"),
        ("goal: no pause > 1 s", "met" if r["goal_met"] else "[bold red]missed"),
    ):  # fmt: skip
        reshare.add_row(label, value)
    s = results["scaling"]
    scale = Table(
        title=f"scaling: {s['count']:,} records over {s['keys']:,} keys, apply "
        f"{s['apply_ms']} ms per record + one PostgreSQL row each; group shares="
        f"{s['group_shares']} against hand-given shares (the shares workload); medians"
    )
    for column in ("members", "group records/s", "x one member", "hand-given shares records/s"):
        scale.add_column(column, justify="right")
    for n, rate in s["median_rate"]["group"].items():
        scale.add_row(
            n, f"{rate:,.0f}", f"{s['group_speedup'][n]:.2f}",
            f"{s['median_rate']['shares'][n]:,.0f}",
        )  # fmt: skip
    return [takeover, reshare, scale]


if __name__ == "__main__":
    raise SystemExit(workload_main("python -m bench.groups.run", __doc__, run, None))

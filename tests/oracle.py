"""The history checker every reliability suite uses: did each committed record take effect once?

A run records its history: every record a producer tried to publish (committed or not),
every commit it acknowledged, what its log holds at the end, every record pushed to a
consumer, every record the consumer applied (in apply order) and the position and sum
the consumer stored. The consumer's effect is deliberately not idempotent (a row appended
to a table with no unique index, and an amount added to a running sum), so a record
applied twice leaves two rows and a sum too large, instead of being hidden.

``check(history)`` names every anomaly:

- lost: committed and never applied (only up to the consumer's position, unless the
  run is complete), or acknowledged as committed by the producer and absent from its log;
- duplicated: applied more than once;
- reordered: applied after a higher seq; gapped: applied right after a seq that is not
  its predecessor (in apply order);
- phantom: pushed or applied but never committed (e.g. published by a rolled-back
  transaction);
- conflicting: one seq seen with two different payloads (in the log, pushed or applied)
  other than a phantom's;
- position: the stored position or sum disagrees with the applied effects.

Programs write their part of a history as a journal: JSON lines, flushed one by one,
so a process killed with SIGKILL leaves at most one partial last line (ignored).
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# The consumer's effect: the table it appends to and the running sum it adds to.
EFFECT_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS applied (seq INTEGER NOT NULL, value BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS applied_sum (id INTEGER PRIMARY KEY CHECK (id = 1), "
    "total INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO applied_sum (id, total) VALUES (1, 0)",
)
APPLY_ROWS = "INSERT INTO applied (seq, value) VALUES (?, ?)"
ADD_TO_SUM = "UPDATE applied_sum SET total = total + ? WHERE id = 1"


def amount(value: bytes) -> int:
    """What a record adds to the consumer's sum: the number after the last ':' (else 1)."""
    _, sep, tail = value.rpartition(b":")
    return int(tail) if sep and tail.isdigit() else 1


@dataclass
class History:
    """Everything a run observed; each part may be empty when a suite cannot see it."""

    committed: dict[int, bytes] = field(default_factory=dict)  # the producer's log at the end
    attempted: dict[int, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    acknowledged: dict[int, bytes] = field(default_factory=dict)  # commits that returned
    pushed: list[tuple[int, bytes]] = field(default_factory=list)
    applied: list[tuple[int, bytes]] = field(default_factory=list)  # in apply order
    position: int | None = None  # the consumer's stored position (None: not stored)
    stored_sum: int | None = None
    start: int = 1  # the first seq the consumer was to apply
    complete: bool = False  # the consumer was to apply everything committed

    def attempt(self, seq: int, value: bytes) -> None:
        self.attempted[seq].add(value)


@dataclass
class Report:
    """The anomalies of one history, by kind; passing means every list is empty."""

    records: int = 0  # committed records checked
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    reordered: list[int] = field(default_factory=list)
    gapped: list[int] = field(default_factory=list)
    phantom: list[int] = field(default_factory=list)
    conflicting: list[int] = field(default_factory=list)
    position: list[str] = field(default_factory=list)

    KINDS = ("lost", "duplicated", "reordered", "gapped", "phantom", "conflicting", "position")

    @property
    def anomalies(self) -> int:
        return sum(len(getattr(self, kind)) for kind in self.KINDS)

    @property
    def ok(self) -> bool:
        return self.anomalies == 0

    def counts(self) -> dict[str, int]:
        return {kind: len(getattr(self, kind)) for kind in self.KINDS}

    def __str__(self) -> str:
        if self.ok:
            return f"oracle: {self.records} records checked, no anomalies"
        parts = [
            f"{kind} {len(items)} (e.g. {list(items)[:8]})"
            for kind in self.KINDS
            if (items := getattr(self, kind))
        ]
        return f"oracle: {self.records} records checked, ANOMALIES: " + "; ".join(parts)


def check(history: History, value_amount: Callable[[bytes], int] = amount) -> Report:
    """Compare what was applied with what was committed; see the module docstring."""
    committed = history.committed
    report = Report(records=len(committed))
    applied_seqs = Counter(seq for seq, _ in history.applied)

    def is_phantom(seq: int, value: bytes) -> bool:
        return seq not in committed or (
            committed[seq] != value and value in history.attempted.get(seq, ())
        )

    phantom = {seq for seq, value in [*history.pushed, *history.applied] if is_phantom(seq, value)}
    report.phantom = sorted(phantom)
    seen: dict[int, set[bytes]] = defaultdict(set)
    for seq, value in [*history.pushed, *history.applied]:
        if not is_phantom(seq, value):
            seen[seq].add(value)
    report.conflicting = sorted(
        seq for seq, values in seen.items() if len(values | {committed[seq]}) > 1
    )
    report.duplicated = sorted(seq for seq, n in applied_seqs.items() if n > 1)

    previous = history.start - 1
    for seq, _ in history.applied:
        if seq < previous:
            report.reordered.append(seq)
        elif seq > previous + 1:
            report.gapped.append(seq)
        previous = max(previous, seq)

    applied_upto = max(applied_seqs, default=history.start - 1)
    if history.position is not None:
        applied_upto = max(applied_upto, history.position)
    must_apply = (
        (seq for seq in committed if seq >= history.start)
        if history.complete
        else range(history.start, applied_upto + 1)
    )
    lost = {seq for seq in must_apply if seq in committed and seq not in applied_seqs}
    lost |= {
        seq
        for seq, value in history.acknowledged.items()
        if committed.get(seq) != value and seq >= history.start
    }
    report.lost = sorted(lost)

    if history.position is not None:
        last_applied = max(applied_seqs, default=history.start - 1)
        if history.position != last_applied:
            report.position.append(
                f"stored position {history.position} but last applied seq {last_applied}"
            )
    if history.stored_sum is not None:
        effects = sum(value_amount(value) for _, value in history.applied)
        if history.stored_sum != effects:
            report.position.append(
                f"stored sum {history.stored_sum} but the applied rows add up to {effects}"
            )
    return report


# --- reading a history from real files -------------------------------------------------


def read_log(path: Path | str, stream: str) -> dict[int, bytes]:
    """Every record of ``stream`` in a producer's database file: seq -> value."""
    import msgpack

    from streamq.engines.sqlite.storage import MAX_STORED_SEQ, SEQ_BITS

    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10) as db:
        row = db.execute("SELECT id FROM streamq_streams WHERE name = ?", (stream,)).fetchone()
        if row is None:
            return {}
        stream_id = int(row[0])
        rows = db.execute(
            "SELECT pos, record FROM streamq_log WHERE pos > ? AND pos < ? ORDER BY pos",
            (stream_id << SEQ_BITS, (stream_id + 1) << SEQ_BITS),
        ).fetchall()
    db.close()
    records = {}
    for pos, encoded in rows:
        seq, _, _, value, _ = msgpack.unpackb(encoded)
        assert seq == pos & MAX_STORED_SEQ, (seq, pos)
        records[seq] = value
    return records


def read_effects(
    path: Path | str, consumer: str, stream: str
) -> tuple[list[tuple[int, bytes]], int | None, int | None]:
    """A consumer database's applied rows (in apply order), stored position and sum."""
    if not Path(path).exists():
        return [], None, None
    with sqlite3.connect(path, timeout=10) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        applied: list[tuple[int, bytes]] = []
        if "applied" in tables:
            applied = [
                (int(s), bytes(v))
                for s, v in db.execute("SELECT seq, value FROM applied ORDER BY rowid")
            ]
        position = total = None
        if "streamq_positions" in tables:
            rows = db.execute(
                "SELECT seq FROM streamq_positions WHERE consumer = ? AND stream = ?",
                (consumer, stream),
            ).fetchall()
            assert len(rows) <= 1, rows
            position = int(rows[0][0]) if rows else 0
        if "applied_sum" in tables:
            row = db.execute("SELECT total FROM applied_sum WHERE id = 1").fetchone()
            total = int(row[0]) if row else None
    db.close()
    return applied, position, total


class Journal:
    """Appends history events to a file as JSON lines, each flushed before going on."""

    def __init__(self, path: Path | str | None) -> None:
        self._file: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115

    def write(self, event: str, records: Iterable[tuple[int, bytes]]) -> None:
        if self._file is None:
            return
        rows = [[seq, value.decode("latin-1")] for seq, value in records]
        self._file.write(json.dumps({"event": event, "records": rows}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_journals(paths: Iterable[Path]) -> dict[str, list[tuple[int, bytes]]]:
    """Events of every journal, by kind; a truncated last line (a kill mid-write) is skipped."""
    events: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for path in sorted(paths):
        for line in path.read_text().splitlines():
            try:
                event: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue
            events[event["event"]].extend(
                (int(seq), value.encode("latin-1")) for seq, value in event["records"]
            )
    return events


def history_from_files(
    producer_db: Path,
    consumer_db: Path,
    journals: Sequence[Path],
    *,
    stream: str,
    consumer: str,
    complete: bool,
) -> History:
    """A crash run's history: the producer's log, the consumer's effects, and the journals."""
    events = read_journals(journals)
    applied, position, total = read_effects(consumer_db, consumer, stream)
    history = History(
        committed=read_log(producer_db, stream),
        acknowledged=dict(events.get("commit", [])),
        pushed=events.get("push", []),
        applied=applied,
        position=position,
        stored_sum=total,
        complete=complete,
    )
    for seq, value in events.get("publish", []):
        history.attempt(seq, value)
    return history

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
  transaction; where seqs are given after the commit, as on PostgreSQL, such a record
  never had a seq: it is journalled under ``UNNUMBERED``, and is a phantom at any seq
  while its payload was never committed);
- conflicting: one seq seen with two different payloads (in the log, pushed or applied)
  other than a phantom's;
- position: the stored position or sum disagrees with the applied effects.

Programs write their part of a history as a journal: JSON lines, flushed one by one,
so a process killed with SIGKILL leaves at most one partial last line (ignored).

The databases are a SQLite file or a PostgreSQL database (a ``postgresql://`` URL), on
either side: ``Dialect`` holds everything the effect's SQL, the crash programs' business
SQL and the readers below say differently on the two engines, and nothing else does.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# --- the two engines ---------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    """What SQLite and PostgreSQL spell differently, for every statement of the effect, the
    crash programs and the readers: each is written once, with ``?`` placeholders, and
    goes through ``sql``."""

    engine: str  # "sqlite" or "postgres"
    placeholder: str
    blob: str  # the type of a bytes column
    # The column of ``applied`` that keeps the apply order, and its definition (SQLite's
    # rowid needs none; PostgreSQL's is an identity, taken after the turn's row lock).
    apply_order: str
    apply_order_column: str
    ignore: tuple[str, str]  # INSERT <ignore[0]>INTO ...<ignore[1]>: not if the row exists

    def sql(self, statement: str) -> str:
        """``statement`` (``?`` placeholders) in this engine's placeholders (psycopg's
        ``%s``, where a ``%`` of the statement's own is written ``%%``)."""
        if self.placeholder == "?":
            return statement
        return statement.replace("%", "%%").replace("?", self.placeholder)

    def insert_or_ignore(self, into: str) -> str:
        """``INSERT INTO <into>`` (a table, its columns and VALUES) that inserts nothing
        where the row's key exists."""
        return f"INSERT {self.ignore[0]}INTO {into}{self.ignore[1]}"

    @contextlib.contextmanager
    def connect(self, db: Path | str, *, snapshot: bool = False) -> Iterator[Any]:
        """A DB-API connection (``sqlite3``'s or psycopg's) to ``db``: its transaction
        committed at the end (rolled back if the block raises), then closed. ``snapshot``:
        read only, every statement seeing one snapshot (PostgreSQL: REPEATABLE READ, since
        a killed consumer's session may still commit while the oracle reads)."""
        if self.engine == "sqlite":
            conn = sqlite3.connect(db, timeout=10)
            with contextlib.closing(conn), conn:
                if snapshot:
                    conn.execute("BEGIN")  # a read transaction: one snapshot
                yield conn
            return
        import psycopg

        with psycopg.connect(str(db), connect_timeout=10) as pg:
            if snapshot:
                pg.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                pg.read_only = True
            yield pg

    def head_query(self) -> str:
        """The last seq of a stream (one parameter: its name), from the engine's own SQL."""
        if self.engine == "sqlite":
            from streamq.engines.sqlite.storage import HEAD_QUERY
        else:
            from streamq.engines.postgres.append import HEAD_QUERY
        return HEAD_QUERY


SQLITE = Dialect("sqlite", "?", "BLOB", "rowid", "", ("OR IGNORE ", ""))
POSTGRES = Dialect(
    "postgres",
    "%s",
    "BYTEA",
    "n",
    "n BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ",
    ("", " ON CONFLICT DO NOTHING"),
)


def dialect(db: Path | str) -> Dialect:
    """The engine of ``db``: PostgreSQL for a ``postgresql://`` URL, else SQLite."""
    from streamq.engines import is_postgres_url

    return POSTGRES if is_postgres_url(str(db)) else SQLITE


# The consumer's effect: the table it appends to and the running sum it adds to.
def effect_schema(d: Dialect) -> tuple[str, ...]:
    return (
        f"CREATE TABLE IF NOT EXISTS applied ({d.apply_order_column}seq INTEGER NOT NULL, "
        f"value {d.blob} NOT NULL)",
        "CREATE TABLE IF NOT EXISTS applied_sum (id INTEGER PRIMARY KEY CHECK (id = 1), "
        "total INTEGER NOT NULL)",
        d.insert_or_ignore("applied_sum (id, total) VALUES (1, 0)"),
    )


EFFECT_SCHEMA = effect_schema(SQLITE)
APPLY_ROWS = "INSERT INTO applied (seq, value) VALUES (?, ?)"  # through Dialect.sql
ADD_TO_SUM = "UPDATE applied_sum SET total = total + ? WHERE id = 1"


# The seq journalled for a record published where seqs are given after the commit
# (PostgreSQL: ``publish`` returns a ``streamq.Receipt``): it has none until it commits
# and is numbered (never, if rolled back). No record has this seq (seqs start at 1).
UNNUMBERED = 0


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
        """A record published (committed or not), at ``seq`` or ``UNNUMBERED``."""
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

    unnumbered = history.attempted.get(UNNUMBERED, set())
    committed_values = set(committed.values()) if unnumbered else set()

    def is_phantom(seq: int, value: bytes) -> bool:
        """Never committed at ``seq``: not in the log, or the payload of a publish at
        that seq, or of an unnumbered one, that did not commit (else: conflicting)."""
        if seq not in committed:
            return True
        if committed[seq] == value:
            return False
        return value in history.attempted.get(seq, ()) or (
            value in unnumbered and value not in committed_values
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


def read_log(db: Path | str, stream: str) -> dict[int, bytes]:
    """Every record of ``stream`` in a producer's database (file or URL): seq -> value."""
    if dialect(db) is POSTGRES:
        return _read_log_postgres(str(db), stream)
    import msgpack

    from streamq.engines.sqlite.storage import MAX_STORED_SEQ, SEQ_BITS, unpack_rows

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        row = conn.execute("SELECT id FROM streamq_streams WHERE name = ?", (stream,)).fetchone()
        if row is None:
            return {}
        stream_id = int(row[0])
        rows = conn.execute(
            "SELECT pos, count, record FROM streamq_log WHERE pos > ? AND pos < ? ORDER BY pos",
            (stream_id << SEQ_BITS, (stream_id + 1) << SEQ_BITS),
        ).fetchall()
    conn.close()
    records = {}
    for pos, encoded in unpack_rows(rows):
        seq, _, _, value, _ = msgpack.unpackb(encoded)
        assert seq == pos & MAX_STORED_SEQ, (seq, pos)
        records[seq] = value
    return records


def _read_log_postgres(url: str, stream: str) -> dict[int, bytes]:
    from streamq.protocol import decode_record

    with POSTGRES.connect(url, snapshot=True) as conn:
        rows = conn.execute(
            "SELECT l.seq, l.record FROM streamq_log AS l "
            "JOIN streamq_streams AS s ON s.id = l.stream_id WHERE s.name = %s ORDER BY l.seq",
            (stream,),
        ).fetchall()
    records = {}
    for seq, encoded in rows:
        record = decode_record(bytes(encoded))
        assert record.seq == seq, (record.seq, seq)
        records[int(seq)] = bytes(record.value)
    return records


def read_head(db: Path | str, stream: str) -> int | None:
    """The head of ``stream`` as the producer's database stores it (None: no stream)."""
    d = dialect(db)
    with d.connect(db, snapshot=True) as conn:
        row = conn.execute(d.head_query(), (stream,)).fetchone()
    return None if row is None else int(row[0])


def read_effects(
    db: Path | str, consumer: str, stream: str
) -> tuple[list[tuple[int, bytes]], int | None, int | None]:
    """A consumer database's applied rows (in apply order), stored position and sum, all
    read in one snapshot."""
    d = dialect(db)
    if d is SQLITE and not Path(db).exists():
        return [], None, None
    with d.connect(db, snapshot=True) as conn:
        if d is SQLITE:
            query = "SELECT name FROM sqlite_master WHERE type = 'table'"
        else:
            query = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        tables = {row[0] for row in conn.execute(query)}
        applied: list[tuple[int, bytes]] = []
        if "applied" in tables:
            applied = [
                (int(s), bytes(v))
                for s, v in conn.execute(f"SELECT seq, value FROM applied ORDER BY {d.apply_order}")
            ]
        position = total = None
        if "streamq_positions" in tables:
            rows = conn.execute(
                d.sql("SELECT seq FROM streamq_positions WHERE consumer = ? AND stream = ?"),
                (consumer, stream),
            ).fetchall()
            assert len(rows) <= 1, rows
            position = int(rows[0][0]) if rows else 0
        if "applied_sum" in tables:
            row = conn.execute("SELECT total FROM applied_sum WHERE id = 1").fetchone()
            total = int(row[0]) if row else None
    return applied, position, total


class Journal:
    """Appends history events to a file as JSON lines, each flushed before going on."""

    def __init__(self, path: Path | str | None) -> None:
        self._file: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115
        self._lock = threading.Lock()  # the loop and a producer's writer thread both write

    def write(self, event: str, records: Iterable[tuple[int, bytes]]) -> None:
        if self._file is None:
            return
        rows = [[seq, value.decode("latin-1")] for seq, value in records]
        with self._lock:
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
    producer_db: Path | str,
    consumer_db: Path | str,
    journals: Sequence[Path],
    *,
    stream: str,
    consumer: str,
    complete: bool,
) -> History:
    """A crash run's history: the producer's log, the consumer's effects, and the journals.

    Either database is a SQLite file or a PostgreSQL URL. Read in this order, each after
    the last, so the log read holds every commit a journal acknowledged and every record
    the consumer applied (with other writers still running, only later commits differ)."""
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

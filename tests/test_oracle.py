"""The oracle itself, on crafted histories: a clean one passes, each anomaly is caught."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import streamq

from .oracle import (
    ADD_TO_SUM,
    APPLY_ROWS,
    EFFECT_SCHEMA,
    POSTGRES,
    SQLITE,
    UNNUMBERED,
    History,
    Journal,
    amount,
    check,
    dialect,
    effect_schema,
    history_from_files,
    read_head,
    read_journals,
)

VALUES = {seq: b"order-%d:%d" % (seq, seq * 10) for seq in range(1, 11)}


def clean(**changes: object) -> History:
    """Ten committed records, pushed and applied once each, in order."""
    rows = list(VALUES.items())
    history = History(
        committed=dict(VALUES),
        acknowledged=dict(VALUES),
        pushed=list(rows),
        applied=list(rows),
        position=10,
        stored_sum=sum(amount(v) for v in VALUES.values()),
        complete=True,
    )
    for name, value in changes.items():
        setattr(history, name, value)
    return history


def only(report_kind: str, history: History) -> list[object]:
    report = check(history)
    others = {k: n for k, n in report.counts().items() if n and k != report_kind}
    assert not others, f"{report}: expected only {report_kind}"
    found: list[object] = getattr(report, report_kind)
    assert found, f"{report}: {report_kind} not detected"
    assert not report.ok
    return found


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.ok and report.anomalies == 0 and report.records == 10, report
    assert "no anomalies" in str(report)


def test_a_partial_run_passes_up_to_its_position() -> None:
    rows = list(VALUES.items())[:4]
    history = clean(applied=rows, pushed=rows, complete=False, position=4)
    history.stored_sum = sum(amount(v) for _, v in rows)
    assert check(history).ok


def test_lost_record() -> None:
    rows = [r for r in VALUES.items() if r[0] != 10]
    history = clean(applied=rows, position=9)
    history.stored_sum = sum(amount(v) for _, v in rows)
    assert only("lost", history) == [10]


def test_acknowledged_commit_missing_from_the_log_is_lost() -> None:
    committed = {seq: v for seq, v in VALUES.items() if seq <= 8}
    rows = list(committed.items())
    history = clean(committed=committed, applied=rows, pushed=rows, position=8)
    history.stored_sum = sum(amount(v) for _, v in rows)
    assert only("lost", history) == [9, 10]


def test_duplicated_record() -> None:
    history = clean()
    history.applied.insert(5, (5, VALUES[5]))
    report = check(history)
    assert report.duplicated == [5]
    # The non-idempotent sum shows it too: the stored sum has it once, the rows twice.
    assert report.position and "sum" in report.position[0]


def test_reordered_records() -> None:
    history = clean()
    history.applied[3], history.applied[4] = history.applied[4], history.applied[3]
    report = check(history)
    assert report.reordered == [4] and report.gapped == [5], report


def test_gap_in_apply_order() -> None:
    rows = [r for r in VALUES.items() if r[0] != 6] + [(6, VALUES[6])]
    report = check(clean(applied=rows))
    assert report.gapped == [7] and report.reordered == [6], report
    assert not report.lost and not report.duplicated


def test_phantom_from_a_rolled_back_transaction() -> None:
    committed = {seq: v for seq, v in VALUES.items() if seq <= 9}
    history = clean(committed=committed, acknowledged=dict(committed))
    history.attempt(10, VALUES[10])  # published, then rolled back
    assert only("phantom", history) == [10]


def test_phantom_replaced_by_a_later_commit() -> None:
    """A seq reused after a rollback: applying the rolled-back payload is a phantom."""
    history = clean()
    history.attempt(7, b"rolled-back:1")
    history.applied[6] = (7, b"rolled-back:1")
    history.stored_sum = sum(amount(v) for _, v in history.applied)
    report = check(history)
    assert report.phantom == [7] and not report.conflicting, report


def test_phantom_published_unnumbered() -> None:
    """Where seqs are given after the commit (PostgreSQL), a rolled-back record never had
    a seq: journalled ``UNNUMBERED``, it is a phantom wherever it shows up, even at a seq
    that committed with another payload; a committed record's payload at the wrong seq
    stays a conflict."""
    history = clean()
    history.attempt(UNNUMBERED, b"rolled-back:1")
    history.attempt(UNNUMBERED, VALUES[2])  # published unnumbered, then committed as seq 2
    history.applied[6] = (7, b"rolled-back:1")
    history.stored_sum = sum(amount(v) for _, v in history.applied)
    report = check(history)
    assert report.phantom == [7] and not report.conflicting, report
    history.pushed[3] = (4, VALUES[2])
    report = check(history)
    assert report.phantom == [7] and report.conflicting == [4], report


def test_one_seq_with_two_payloads() -> None:
    history = clean()
    history.pushed[2] = (3, b"something else:30")
    assert only("conflicting", history) == [3]


def test_position_disagreeing_with_effects() -> None:
    assert only("position", clean(position=7))
    assert only("position", clean(stored_sum=1))


def test_position_with_no_effects() -> None:
    report = check(clean(applied=[], pushed=[], position=3, stored_sum=0, complete=False))
    assert report.position and report.lost == [1, 2, 3], report


def test_journals_survive_a_torn_last_line(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "a.jsonl")
    journal.write("publish", [(1, b"x:1"), (2, b"\xff:2")])
    journal.write("commit", [(1, b"x:1")])
    journal.close()
    with (tmp_path / "a.jsonl").open("a") as f:
        f.write('{"event": "commit", "records": [[2, "')  # killed mid-write
    events = read_journals([tmp_path / "a.jsonl"])
    assert events["publish"] == [(1, b"x:1"), (2, b"\xff:2")]
    assert events["commit"] == [(1, b"x:1")]


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
@pytest.mark.parametrize("rolled_back", [False, True])
async def test_history_from_real_files(
    tmp_path: Path, rolled_back: bool, engine: str, request: pytest.FixtureRequest
) -> None:
    """The readers see a real producer's log and a real consumer's effects, in SQLite files
    or PostgreSQL databases (the effect's SQL through the engine's ``Dialect``)."""
    if engine == "sqlite":
        producer_db, consumer_db = str(tmp_path / "p.db"), str(tmp_path / "c.db")
    else:
        server = request.getfixturevalue("postgres")
        producer_db = request.getfixturevalue("pg_url")
        name = f"oracle_effects_{uuid.uuid4().hex[:12]}"  # the consumer's own database
        consumer_db = server.create_database(name)
        request.addfinalizer(lambda: server.drop_database(name))
    d = dialect(consumer_db)
    assert d.engine == engine and dialect(producer_db).engine == engine
    journal = Journal(tmp_path / "p.jsonl")
    async with streamq.Producer(producer_db) as producer:
        async with producer.transaction() as tx:
            published = await tx.publish_many("s", [b"a:1", b"b:2"])
        if isinstance(published, streamq.Receipt):  # PostgreSQL: numbered after the commit
            assert engine == "postgres"
            published = await producer.wait_served(published, timeout=10)  # served already
        assert published == range(1, 3)
        journal.write("commit", zip(published, [b"a:1", b"b:2"], strict=True))
        with pytest.raises(RuntimeError):
            async with producer.transaction() as tx:
                seq = await tx.publish("s", b"c:3")
                if isinstance(seq, streamq.Receipt):  # no seq before the commit: never one
                    seq = UNNUMBERED
                journal.write("publish", [(seq, b"c:3")])
                raise RuntimeError("roll back")
        async with streamq.Consumer(producer.address, "s", db=consumer_db, name="n") as consumer:
            batch = await anext(consumer)
            async with consumer.transaction(batch) as ctx:
                for statement in effect_schema(d):
                    await ctx.execute(statement)
                rows = [(r.seq, r.value) for r in batch]
                if rolled_back:
                    rows.append((3, b"c:3"))  # what a bug applying uncommitted data would do
                await ctx.executemany(d.sql(APPLY_ROWS), rows)
                await ctx.execute(d.sql(ADD_TO_SUM), (sum(amount(v) for _, v in rows),))
    journal.close()
    history = history_from_files(
        producer_db,
        consumer_db,
        [tmp_path / "p.jsonl"],
        stream="s",
        consumer="n",
        complete=True,
    )
    report = check(history)
    assert history.committed == {1: b"a:1", 2: b"b:2"}
    assert read_head(producer_db, "s") == 2
    assert history.attempted == {3 if engine == "sqlite" else UNNUMBERED: {b"c:3"}}
    if rolled_back:
        assert report.phantom == [3] and report.position, report
    else:
        assert report.ok, report
        assert history.applied == [(1, b"a:1"), (2, b"b:2")] and history.position == 2


def test_dialect_spells_each_engine() -> None:
    """The one place where the engines differ: placeholders (a literal % doubled for
    psycopg), INSERT that skips an existing row, bytes, the apply order."""
    assert dialect("/tmp/x.db") is SQLITE and dialect("postgresql://u@h/db") is POSTGRES
    statement = "SELECT a FROM t WHERE (-a) % ? = ? AND b = ?"
    assert SQLITE.sql(statement) == statement
    assert POSTGRES.sql(statement) == "SELECT a FROM t WHERE (-a) %% %s = %s AND b = %s"
    assert SQLITE.insert_or_ignore("t (a) VALUES (1)") == "INSERT OR IGNORE INTO t (a) VALUES (1)"
    assert POSTGRES.insert_or_ignore("t (a) VALUES (1)") == (
        "INSERT INTO t (a) VALUES (1) ON CONFLICT DO NOTHING"
    )
    assert effect_schema(SQLITE) == EFFECT_SCHEMA  # what the other suites use
    assert "BYTEA" in effect_schema(POSTGRES)[0] and "IDENTITY" in effect_schema(POSTGRES)[0]

"""Power loss, replayed: a producer's database imaged as a power loss could leave it, then
restarted, with real consumers that had applied records the image lost.

1. A real Producer (in WAL, ``durability`` normal or full) commits records with business
   rows (every third commit a group of concurrent ``run_in_transaction`` calls: one
   COMMIT, a member sometimes withdrawn into its savepoint), and a quarter of the way
   through a second Producer process commits once into the same database (as ``streamq
   publish`` does); a real Consumer applies each commit, and its database is snapshotted
   after each. The test notes the WAL's length when a producer has started (its epoch is
   committed with a full sync) and after each commit returned.
2. From the final WAL it builds images (``walimage``): the WAL cut at every commit frame,
   torn in the middle of the next frame, or with the next frame zeroed (a page the OS never
   wrote back). With ``synchronous=NORMAL`` nothing after the second producer's start is
   synced (no checkpoint runs: the test checks the WAL was never restarted), so every image
   from there is a possible post-power-loss state (``make powerloss`` checks these sync
   points against the system calls, with strace). With ``synchronous=FULL`` each commit is
   synced before it returns, so the images possible after commit k returned are those cut
   at or after it.
3. Each image must pass ``PRAGMA integrity_check``, hold exactly the commits before the cut
   (log and business rows together), and, with FULL, every commit acknowledged before the
   image. Then a real Producer restarts on it (a new epoch) and writes other records under
   the lost seqs (beyond, up to, or short of the old head), and real Consumers restored from
   the snapshots connect: one that had applied beyond the lost point must stop with
   ``ConsumerPositionError`` naming exactly the seqs it has that the log lost; one at or
   below it must go on and receive exactly the producer's log.

``python -m tests.powerloss`` (``make powerloss``) runs a larger sweep and prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from streamq import (
    BlockingTransaction,
    Consumer,
    ConsumerPositionError,
    Producer,
    SeqsReusedError,
)
from streamq.engines.sqlite.storage import HEAD_QUERY, unpack_rows
from streamq.sql import Durability

from .conftest import wait_for
from .walimage import FRAME_HEADER, WAL_HEADER, commit_ends, valid_frames, write_image

STREAM = "orders"


@dataclass
class Figures:
    durability: str
    commits: int = 0  # acknowledged commits in the workload
    images: int = 0  # post-crash images built and checked
    integrity_ok: int = 0  # images where PRAGMA integrity_check said ok
    torn: int = 0  # images whose WAL ends in a torn frame or has a hole
    images_with_loss: int = 0  # images missing commits acknowledged before them
    commits_lost: int = 0  # acknowledged commits missing, summed over images
    acknowledged_lost: int = 0  # ... with FULL, where none may be: must be 0
    regressions: int = 0  # consumers that had applied beyond what the image kept
    detected: int = 0  # ... stopped with ConsumerPositionError naming exactly the lost seqs
    reused_detected: int = 0  # ... of which the producer had re-used the seqs (SeqsReusedError)
    undetected: int = 0  # ... went on: must be 0
    resumed: int = 0  # consumers at or below the kept head that went on correctly
    seconds: float = 0.0

    def report(self) -> str:
        return (
            f"durability={self.durability}: {self.commits} commits; {self.images} images built "
            f"({self.torn} torn or with a hole), integrity_check ok in {self.integrity_ok}; "
            f"{self.images_with_loss} images lost acknowledged commits ({self.commits_lost} "
            f"commits in all); {self.regressions} regressions (consumers that had applied "
            f"beyond the loss): {self.detected} detected ({self.reused_detected} with the seqs "
            f"re-used), {self.undetected} undetected; {self.resumed} consumers at or below "
            f"the loss resumed with exactly the producer's log; {self.seconds:.1f} s"
        )


@dataclass
class Commit:
    end: int  # WAL length once it returned
    head: int


@dataclass
class Workload:
    db: Path  # the database file as the producer left it (never checkpointed)
    wal: bytes
    base: int  # WAL length once the stream and the business table were made
    sync_bound: tuple[int, int, int]  # another producer started: (WAL synced, head, commits)
    commits: list[Commit]
    values: dict[int, bytes]  # seq -> value, as published
    snapshots: dict[int, Path] = field(default_factory=dict)  # consumer position -> its db


def _init_consumer_db(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE credits (seq INTEGER PRIMARY KEY, value BLOB NOT NULL)")
        db.commit()


async def _apply_until(consumer: Consumer, seq: int) -> None:
    while consumer.applied < seq:
        batch = await anext(consumer)
        async with consumer.transaction(batch) as tx:
            await tx.executemany(
                "INSERT INTO credits VALUES (?, ?)", [(r.seq, r.value) for r in batch]
            )


def _backup(source: Path, target: Path) -> None:
    with (
        contextlib.closing(sqlite3.connect(source)) as src,
        contextlib.closing(sqlite3.connect(target)) as dst,
    ):
        src.backup(dst)


async def record_workload(
    work: Path, durability: Durability, commits: int, rng: random.Random
) -> Workload:
    db = work / "producer.db"
    wal_path = Path(f"{db}-wal")
    consumer_db = work / "consumer.db"
    _init_consumer_db(consumer_db)
    (work / "snapshots").mkdir()
    done: list[Commit] = []
    values: dict[int, bytes] = {}
    snapshots: dict[int, Path] = {}
    async with Producer(str(db), durability=durability, watch_interval=0.01) as producer:
        synced = wal_path.stat().st_size
        header = wal_path.read_bytes()[:WAL_HEADER]
        async with producer.storage.writer.conn.execute("PRAGMA synchronous") as cursor:
            row = await cursor.fetchone()
        assert row is not None and row[0] == {"normal": 1, "full": 2}[durability]
        await producer.create_stream(STREAM)
        async with producer.transaction() as tx:
            await tx.execute("CREATE TABLE orders (seq INTEGER PRIMARY KEY, value BLOB NOT NULL)")
        base = wal_path.stat().st_size  # images start here: stream and table exist
        async with Consumer(producer.address, STREAM, db=str(consumer_db), name="c") as consumer:
            for k in range(commits):
                if k == commits // 4:
                    sync_bound = await _other_process_commits(db, wal_path, done, values)
                    await wait_for(lambda: producer.head(STREAM) == done[-1].head)
                    await _apply_until(consumer, producer.head(STREAM))
                if k % 3 == 2:
                    await _commit_group(producer, k, values, rng)
                else:
                    async with producer.transaction() as tx:
                        for i in range(rng.randint(1, 4)):
                            value = b"epoch%d-commit%d-%d" % (producer.epoch, k, i)
                            seq = await tx.publish(STREAM, value)
                            await tx.execute("INSERT INTO orders VALUES (?, ?)", (seq, value))
                            values[seq] = value
                done.append(Commit(wal_path.stat().st_size, producer.head(STREAM)))
                await _apply_until(consumer, producer.head(STREAM))
                snapshot = work / "snapshots" / f"{consumer.applied}.db"
                _backup(consumer_db, snapshot)
                snapshots[consumer.applied] = snapshot
            wal = wal_path.read_bytes()
            image_db = work / "image-source.db"
            image_db.write_bytes(db.read_bytes())
    # No checkpoint ran while recording: the WAL was never restarted (same salts) ...
    assert wal[:WAL_HEADER] == header, "the WAL was restarted: a checkpoint ran"
    # ... and each acknowledged commit ended exactly at a valid commit frame.
    ends = [end for end in commit_ends(wal) if end > synced]
    assert set(ends) - {c.end for c in done} == {ends[0], base, sync_bound[0]}, (
        "commits and WAL commit frames differ"  # besides: the stream, the table, the epoch
    )
    return Workload(image_db, wal, base, sync_bound, done, values, snapshots)


class _Withdrawn(Exception):
    """A member of a commit group that rolls back alone."""


def _member(tx: BlockingTransaction, prefix: bytes, count: int, withdraw: bool) -> dict[int, bytes]:
    published = {}
    for i in range(count):
        value = b"%s-%d" % (prefix, i)
        seq = tx.publish(STREAM, value)
        tx.execute("INSERT INTO orders VALUES (?, ?)", (seq, value))
        published[seq] = value
    if withdraw:
        raise _Withdrawn
    return published


async def _commit_group(
    producer: Producer, k: int, values: dict[int, bytes], rng: random.Random
) -> None:
    """2 to 4 concurrent transactions, one COMMIT (the WAL check counts commit frames);
    a withdrawn member's seqs go to the next member, its rows nowhere."""
    calls = [
        producer.run_in_transaction(
            _member,
            b"epoch%d-commit%d-member%d" % (producer.epoch, k, m),
            rng.randint(1, 3),
            rng.random() < 0.25,
        )
        for m in range(rng.randint(2, 4))
    ]
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, dict):
            values.update(outcome)
        elif not isinstance(outcome, _Withdrawn):
            raise outcome


async def _other_process_commits(
    db: Path, wal_path: Path, done: list[Commit], values: dict[int, bytes]
) -> tuple[int, int, int]:
    """Another producer (``streamq publish``) commits into the served database; returns
    the WAL bound its start synced (its epoch's commit): (WAL length, head, commits)."""
    async with Producer(str(db), serve=False) as other:
        head = other.head(STREAM)
        bound = (wal_path.stat().st_size, head, len(done))
        async with other.transaction() as tx:
            for i in range(2):
                value = b"other-epoch%d-%d" % (other.epoch, i)
                seq = await tx.publish(STREAM, value)
                await tx.execute("INSERT INTO orders VALUES (?, ?)", (seq, value))
                values[seq] = value
        done.append(Commit(wal_path.stat().st_size, other.head(STREAM)))
    return bound


@dataclass(frozen=True)
class Image:
    cut: int  # WAL bytes kept
    hole: bool  # the frame at the cut zeroed, the frames after it kept
    kept_head: int  # the head SQLite must recover
    kept_commits: int  # acknowledged commits it keeps
    acknowledged: int  # commits acknowledged before the image was made


def images(work: Workload, durability: Durability) -> list[Image]:
    """Every image a power loss could leave after the last commit returned (NORMAL), or
    after commit k returned, for every k (FULL)."""
    frames = valid_frames(work.wal)
    page = frames[0].end - frames[0].offset - FRAME_HEADER
    bounds = [(work.base, 0, 0), work.sync_bound] + [
        (c.end, c.head, k + 1) for k, c in enumerate(work.commits)
    ]  # (WAL length, head, commits kept)
    result: list[Image] = []
    for cut, head, kept in sorted(bounds):
        if durability == "normal" and cut < work.sync_bound[0]:
            continue  # synced by the other producer's start: no power loss undoes it
        acknowledged = len(work.commits) if durability == "normal" else kept
        result.append(Image(cut, False, head, kept, acknowledged))
        if cut < len(work.wal):
            result.append(Image(cut + FRAME_HEADER + page // 2, False, head, kept, acknowledged))
            result.append(Image(cut, True, head, kept, acknowledged))
    return result


def _check_file(path: Path, image: Image, work: Workload) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)], image
        (head,) = db.execute(HEAD_QUERY, (STREAM,)).fetchone()
        orders = dict(db.execute("SELECT seq, value FROM orders"))
    assert head == image.kept_head, f"{image}: recovered head {head}"
    # The log and the business rows commit together: both hold exactly the kept commits.
    assert orders == {s: v for s, v in work.values.items() if s <= head}, image


async def check_image(
    work: Workload, image: Image, target: Path, figures: Figures, rng: random.Random
) -> None:
    wal = work.wal
    hole = None
    if image.hole:
        hole = next(f for f in valid_frames(wal) if f.offset == image.cut)
        cut = len(wal)
    else:
        cut = image.cut
    path = write_image(work.db, wal, target, cut=cut, hole=hole)
    _check_file(path, image, work)
    figures.images += 1
    figures.integrity_ok += 1
    figures.torn += image.hole or image.cut not in (work.base, *ends(work))
    lost = image.acknowledged - image.kept_commits
    figures.images_with_loss += lost > 0
    figures.commits_lost += lost
    figures.acknowledged_lost += lost if figures.durability == "full" else 0
    kept = image.kept_head
    applied_max = work.commits[image.acknowledged - 1].head if image.acknowledged else 0
    async with Producer(str(path)) as producer:  # restarted: a new epoch
        # After the loss the producer goes on: beyond the old head, up to it, short of it.
        regrow = rng.choice([applied_max - kept + 3, max(0, applied_max - kept), 0])
        regrow = rng.choice([regrow, (applied_max - kept) // 2])
        if regrow:
            async with producer.transaction() as tx:
                await tx.publish_many(STREAM, [b"after-loss-%d" % n for n in range(regrow)])
        log = _log(path)
        positions = sorted(p for p in work.snapshots if p <= applied_max)
        below = [p for p in positions if p <= kept]
        above = [p for p in positions if p > kept]
        chosen = set(below[-1:] + above[-1:] + rng.sample(above, min(1, len(above))))
        for position in sorted(chosen):
            consumer_db = target / f"consumer-{position}.db"
            _backup(work.snapshots[position], consumer_db)
            consumer = Consumer(producer.address, STREAM, db=str(consumer_db), name="c")
            if position > kept:
                figures.regressions += 1
                try:
                    await consumer.start()
                except ConsumerPositionError as exc:
                    assert exc.lost == range(kept + 1, position + 1), (image, position, exc)
                    figures.detected += 1
                    figures.reused_detected += isinstance(exc, SeqsReusedError)
                    continue
                await consumer.close()
                figures.undetected += 1
                continue
            async with consumer:
                await _apply_until(consumer, producer.head(STREAM))
            with contextlib.closing(sqlite3.connect(consumer_db)) as db:
                credits = dict(db.execute("SELECT seq, value FROM credits"))
            assert credits == log, (image, position)
            figures.resumed += 1


def ends(work: Workload) -> list[int]:
    return [commit.end for commit in work.commits]


def _log(path: Path) -> dict[int, bytes]:
    """seq -> value of every record in the producer's log, read from its file."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT pos, count, record FROM streamq_log ORDER BY pos").fetchall()
    decoded = [msgpack.unpackb(record) for _, record in unpack_rows(rows)]
    return {seq: value for seq, _, _, value, _ in decoded}


async def sweep(durability: Durability, commits: int, seed: int, work: Path) -> Figures:
    """Record a workload, build every image, check each; the figures."""
    started = time.monotonic()
    rng = random.Random(seed)
    figures = Figures(durability)
    workload = await record_workload(work, durability, commits, rng)
    figures.commits = len(workload.commits)
    for n, image in enumerate(images(workload, durability)):
        await check_image(workload, image, work / f"image-{n}", figures, rng)
    figures.seconds = time.monotonic() - started
    return figures


# The workload of ``verify_sync_points``, run under strace in its own process.
_TRACED_PRODUCER = """
import asyncio, os, sys
from streamq import Producer
async def main(path, durability, commits):
    async with Producer(path, durability=durability, serve=False) as producer:
        os.write(1, b"STARTED\\n")
        for k in range(commits):
            await producer.publish("orders", b"x" * 100)
            os.write(1, b"ACK %d\\n" % k)
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""
_SYSCALL = re.compile(r"^(\d+) (?:<\.\.\. )?(\w+)(?: resumed>|\()(.*)$")
_FILE = re.compile(r"^(\d+)<([^>]*)>")


def verify_sync_points(durability: Durability, commits: int, work: Path) -> str:
    """Check, from the system calls of a real producer traced with strace, which WAL bytes
    were synced when each commit returned: all of them with FULL; with NORMAL none written
    after the start (and no checkpoint wrote the database file) -- the model the images use.
    """
    trace = work / "trace.txt"
    script = work / "traced_producer.py"
    script.write_text(_TRACED_PRODUCER)
    command = ["strace", "-f", "-qq", "-y", "-e", "trace=pwrite64,write,fdatasync,fsync"]
    command += ["-o", str(trace), sys.executable, str(script)]
    command += [str(work / "traced.db"), durability, str(commits)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    written = synced = 0  # WAL bytes written, and written before the last WAL sync
    started: tuple[int, int] | None = None
    acks: list[tuple[int, int]] = []  # (written, synced) when each commit returned
    db_writes = 0  # to the database file (a checkpoint) after the start
    db_writes_by_last_ack = 0
    pending: dict[str, str] = {}
    for line in trace.read_text().splitlines():
        match = _SYSCALL.match(line)
        if match is None:
            continue
        pid, call, rest = match.groups()
        if "<unfinished ...>" in rest:
            pending[pid] = rest
            continue
        arguments = pending.pop(pid, "") + rest if "resumed>" in line else rest
        target = _FILE.match(arguments)
        path = target.group(2) if target else ""
        if call == "pwrite64" and path.endswith("-wal"):
            size, offset = re.findall(r", (\d+), (\d+)\) += ", arguments)[-1]
            written = max(written, int(size) + int(offset))
        elif call == "pwrite64" and path.endswith("traced.db") and started is not None:
            db_writes += 1
        elif call in ("fdatasync", "fsync") and path.endswith("-wal"):
            synced = written
        elif call == "write" and '"STARTED' in arguments:
            started = (written, synced)
        elif call == "write" and '"ACK ' in arguments:
            acks.append((written, synced))
            db_writes_by_last_ack = db_writes
    assert started is not None and len(acks) == commits, f"trace incomplete: {trace}"
    assert db_writes_by_last_ack == 0, "a checkpoint ran during the workload"
    if durability == "full":
        assert all(w == s for w, s in acks), f"a commit returned before its WAL was synced: {acks}"
        return f"strace, full: all of the WAL was synced when each of {commits} commits returned"
    assert all(s == started[1] for _, s in acks), f"the WAL was synced after the start: {acks}"
    assert started[0] == started[1], "the start's commit was not synced"
    return (
        f"strace, normal: the WAL synced at the start only; {acks[-1][0] - started[1]} bytes "
        f"of {commits} commits never synced"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    durabilities: tuple[Durability, ...] = ("normal", "full")
    for durability in durabilities:
        with tempfile.TemporaryDirectory() as tmp:
            if shutil.which("strace"):
                print(verify_sync_points(durability, args.commits, Path(tmp)), flush=True)
            else:
                print("strace not found: sync points taken from SQLite's documentation")
            figures = asyncio.run(sweep(durability, args.commits, args.seed, Path(tmp)))
        print(figures.report(), flush=True)
        assert figures.undetected == 0 and figures.acknowledged_lost == 0


if __name__ == "__main__":
    main()


class WalTape:
    """A served producer's database (SQLite, WAL, ``durability="normal"``) recorded as it
    runs, to be replaced afterwards by an image a power loss could leave, built from its WAL
    the way ``images`` builds them (``walimage``): for tests of other readers than the
    Consumer, such as the Spark source (tests/spark/test_spark_power_loss.py).

    ``mark()`` notes the WAL's length: once right after the producer started (its epoch's
    commit synced the WAL), then after each commit that returned. ``freeze()``, while the
    producer still runs (a clean stop may checkpoint), keeps the database file and its WAL.
    ``lose_after(k)`` then puts in the database's place the image of a power loss that
    kept the WAL up to mark ``k``: with ``synchronous=NORMAL`` nothing after the start is
    synced (no checkpoint ran: ``freeze`` checks the WAL was never restarted), so every
    mark from the start on is a possible post-power-loss state.
    """

    def __init__(self, db: Path) -> None:
        self.db = db
        self.wal_path = Path(f"{db}-wal")
        self.marks: list[int] = []
        self._header = b""
        self._wal = b""
        self._frozen: Path | None = None

    def mark(self) -> int:
        """Note the WAL's length now; returns the mark's number."""
        wal = self.wal_path.read_bytes()
        if not self.marks:
            self._header = wal[:WAL_HEADER]
        self.marks.append(len(wal))
        return len(self.marks) - 1

    def freeze(self, work: Path) -> None:
        """Keep the database file and its WAL as they are now (the producer still runs)."""
        self._wal = self.wal_path.read_bytes()
        assert self._wal[:WAL_HEADER] == self._header, "the WAL was restarted: a checkpoint ran"
        self._frozen = work / "frozen" / self.db.name
        self._frozen.parent.mkdir(parents=True, exist_ok=True)
        self._frozen.write_bytes(self.db.read_bytes())

    def lose_after(self, mark: int, work: Path) -> Path:
        """Replace the (stopped) producer's database by the image of a power loss that kept
        its WAL up to ``mark``; returns the image it copied."""
        assert self._frozen is not None, "freeze() first"
        cut = self.marks[mark]
        assert mark == 0 or cut in commit_ends(self._wal), "a mark must follow a commit"
        image = write_image(self._frozen, self._wal, work / f"image-{mark}", cut=cut)
        with contextlib.closing(sqlite3.connect(image)) as db:  # recovers, as a restart would
            assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        for leftover in (self.wal_path, Path(f"{self.db}-shm")):
            leftover.unlink(missing_ok=True)
        shutil.copyfile(image, self.db)
        if Path(f"{image}-wal").exists():  # closing SQLite's last connection may fold it in
            shutil.copyfile(Path(f"{image}-wal"), self.wal_path)
        return image

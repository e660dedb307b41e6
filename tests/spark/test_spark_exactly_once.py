"""Exactly-once into a Spark parquet sink through kill -9, a graceful stop and restarts.

Three producer processes (tests/crash/producer_proc.py) commit transactions of
1 to 200 records at a modest pace, a share of their records released as each run of the
query starts (so every run reads records committed while it works), while a Spark
streaming query process
(tests/spark/programs/query.py, a real local[2] SparkSession) reads them with
``format("streamq")`` into a parquet sink, at most 500 records per micro-batch.
The test kills the query's whole process tree (Python driver, JVM, Python
workers) with SIGKILL at a random moment while batches run (more: ``make soak-spark``),
stops it gracefully once, restarting it from the same checkpoint each time; then, once the
producers have published everything, drains them with a last
``trigger(availableNow=True)`` run. Each run's process starts its SparkSession
(its JVM, ~10 s) while the run before it starts its query (~15 s to the first
batch), and starts its query on the checkpoint only once that run is gone
(``--wait-go``). What the sink committed (the files listed in
``OUT/_spark_metadata``, read both directly and with ``spark.read.parquet``)
must hold every record of every producer exactly once, as the producer serves it.

Set STREAMQ_SPARK_SEED to replay a run; the seed is in every failure message.
``make soak-spark`` runs it with more kills (STREAMQ_SPARK_KILLS); ``make soak-spark-many``
at 256 producers (STREAMQ_SPARK_PRODUCERS), served 16 to a process by
tests/spark/programs/writing_host.py, a few dozen records each per run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamq
from bench.common import reserved_port
from bench.spark.footprint import processes

ROOT = Path(__file__).resolve().parents[2]
PRODUCER_PROGRAM = ROOT / "tests" / "crash" / "producer_proc.py"
HOST_PROGRAM = Path(__file__).resolve().parent / "programs" / "writing_host.py"
QUERY_PROGRAM = Path(__file__).resolve().parent / "programs" / "query.py"
STREAM = "orders"

# More than 3 producers (``make soak-spark-many``: 256) are served HOSTED to a process
# (writing_host.py), as a host runs them; 3 are a process each (producer_proc.py).
PRODUCERS = int(os.environ.get("STREAMQ_SPARK_PRODUCERS") or 3)
HOSTED = 16
MANY = PRODUCERS > 3
KILLS = int(os.environ.get("STREAMQ_SPARK_KILLS") or 1)  # runs of the query ended by SIGKILL
STOPS = 1  # and gracefully
# Records each producer may publish more before each run, and before the last: about
# 1,200 in all (6,400 for many producers, a few dozen each).
SHARE = max(10, 6400 // PRODUCERS) if MANY else 400
TOTAL = SHARE * (KILLS + STOPS + 2)  # records each producer publishes
PACE = SHARE / 2  # records per second each producer publishes at, on average: 2 s per share
MAX_PER_TRIGGER = 2000 if MANY else 500  # records per micro-batch, at most
KILL_DELAY = (0.0, 2.5)  # seconds after the run's first completed batch
PRODUCER_START_TIMEOUT = 20.0
SESSION_TIMEOUT = 60.0  # for a run's SparkSession to start
QUERY_START_TIMEOUT = 60.0  # from a run's go until its first completed batch
STOP_TIMEOUT = 60.0
PUBLISH_TIMEOUT = 60.0  # from the last share's release until they have published all
LAST_RUN_TIMEOUT = 90.0
PR_SET_CHILD_SUBREAPER = 36  # prctl option
Row = tuple[str, str, str, int, bytes | None, bytes, int]  # as ROW_COLUMNS
ROW_COLUMNS = ["producer", "endpoint", "stream", "seq", "key", "value", "ts"]


def session_members(sid: int) -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of the processes of session ``sid``: a program started in its
    own session and all it started (Spark's JVM and Python workers change their process
    group, not their session)."""
    return [(p.pid, p.state, p.parent) for p in processes() if p.session == sid]


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """Make this process the subreaper of its descendants meanwhile, so the processes of a
    killed query (its JVM, its Python workers) are reaped here rather than left as zombies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class Proc:
    """A program in its own session, its output going to a log file; its stdin a pipe
    (``send``) with ``piped``."""

    def __init__(self, args: list[str], log: Path, piped: bool = False) -> None:
        self.log = log
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def send(self, line: str) -> None:
        """Write ``line`` to the program's stdin, then close it."""
        assert self.popen.stdin is not None
        with self.popen.stdin:
            self.popen.stdin.write(line.encode() + b"\n")

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def matching(self, prefix: str) -> list[str]:
        return [line for line in self.lines() if line.startswith(prefix)]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_line(self, prefix: str, timeout: float, context: Callable[[], str]) -> str:
        """The first output line starting with ``prefix``, waiting for it up to ``timeout``."""
        return self.wait_lines(prefix, 1, timeout, context)[0]

    def wait_lines(
        self, prefix: str, count: int, timeout: float, context: Callable[[], str]
    ) -> list[str]:
        """The output lines starting with ``prefix``, once there are ``count``, waiting for
        them up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(found := self.matching(prefix)) < count:
            assert self.alive(), (
                f"{self.log.name} exited ({self.popen.returncode}) before {prefix!r}:\n"
                f"{self.tail()}\n{context()}"
            )
            assert time.monotonic() < deadline, (
                f"no {prefix!r} from {self.log.name} within {timeout} s:\n"
                f"{self.tail()}\n{context()}"
            )
            time.sleep(0.02)
        return found

    def kill_all(self) -> int | None:
        """SIGKILL every process of the program's session at once, and reap them; returns
        the program's exit status (-9 if it was still running)."""
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        deadline = time.monotonic() + 20
        while members := session_members(self.popen.pid):
            live = [pid for pid, state, _ in members if state not in ("Z", "X")]
            for pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.popen.poll()  # reap the program itself
            for pid, state, ppid in members:
                if state == "Z" and ppid == os.getpid() and pid != self.popen.pid:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)  # an orphan adopted by this process
            if time.monotonic() > deadline:
                assert not live, f"{self.log.name}: {live} survive SIGKILL"
                break  # zombies left to someone else
            time.sleep(0.02)
        return self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, n: int = 25) -> str:
        lines = [line for line in self.lines() if not line.startswith(("\tat ", "  at "))]
        return "\n".join(lines[-n:])


def committed_files(out: Path) -> list[Path]:
    """The files the parquet sink committed: its ``_spark_metadata`` log, as Spark reads it
    (the latest compaction and every batch file after it)."""
    log = out / "_spark_metadata"
    if not log.is_dir():
        return []
    batches: dict[int, Path] = {}
    for entry in log.iterdir():
        if found := re.fullmatch(r"(\d+)(\.compact)?", entry.name):
            assert int(found[1]) not in batches, f"batch {found[1]} twice in {log}"
            batches[int(found[1])] = entry
    if not batches:
        return []
    compacted = [batch for batch, path in batches.items() if path.suffix == ".compact"]
    first = max(compacted, default=0)
    missing = sorted(set(range(first, max(batches) + 1)) - set(batches))
    assert not missing, f"file sink log {log} lacks batches {missing}"
    files: dict[str, None] = {}
    for batch in range(first, max(batches) + 1):
        version, *entries = batches[batch].read_text().splitlines()
        assert version == "v1", f"{batches[batch]}: {version!r}"
        for line in entries:
            entry = json.loads(line)
            if entry["action"] == "add":
                files[entry["path"]] = None
            else:
                files.pop(entry["path"], None)
    paths = [Path(unquote(urlparse(url).path)) for url in files]
    assert all(path.parent == out for path in paths), f"files outside {out}: {paths[:5]}"
    return paths


def read_rows(paths: list[Path]) -> list[Row]:
    """The rows of parquet files, as ``ROW_COLUMNS`` (ts: epoch milliseconds)."""
    rows: list[Row] = []
    for path in paths:
        table = pq.read_table(path)
        if "ts" not in table.column_names:  # a sink file, not the dump: timestamp column
            stamps = table.column("timestamp").cast(pa.timestamp("ms", tz="UTC"))
            table = table.append_column("ts", stamps.cast(pa.int64()))
        columns = [table.column(name).to_pylist() for name in ROW_COLUMNS]
        rows += zip(*columns, strict=True)
    return rows


def whole_files(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` that are complete parquet files (not cut short by a kill)."""
    whole = []
    for path in paths:
        try:
            pq.read_metadata(path)
        except pa.ArrowInvalid:
            continue
        whole.append(path)
    return whole


class SparkRun:
    def __init__(self, tmp_path: Path, seed: int) -> None:
        self.dir = tmp_path
        self.seed = seed
        self.rng = random.Random(seed)
        self.checkpoint = tmp_path / "checkpoint"
        self.out = tmp_path / "out"
        self.stop_file = tmp_path / "stop"
        self.allow_file = tmp_path / "allow"  # records each producer may have published
        self.producers: list[Proc] = []
        self.addresses: list[str] = []
        self.ports = contextlib.ExitStack()  # the producers' ports, held until ``stop``
        self.query: Proc | None = None
        self.next_query: Proc | None = None  # started, its query waiting for its go
        self.runs = 0
        self.events: list[str] = []
        self.started = time.monotonic()
        self.committed: dict[str, int] = {}  # producer id -> records committed in the sink
        self.published_while_running: list[int] = []  # per interrupted run

    def context(self) -> str:
        return (
            f"seed={self.seed} (STREAMQ_SPARK_SEED), logs in {self.dir}; events:\n  "
            + "\n  ".join(self.events[-20:])
        )

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:7.3f} {text}")

    # --- producers ---------------------------------------------------------

    def allow(self, records: int) -> None:
        """Let each producer publish up to ``records`` records."""
        tmp = self.allow_file.with_suffix(".tmp")
        tmp.write_text(str(records))
        tmp.replace(self.allow_file)
        self.event(f"allow {records}")

    def start_producers(self) -> None:
        self.allow(SHARE)
        if MANY:
            self.start_hosts()
            return
        for number in range(PRODUCERS):
            port = self.ports.enter_context(reserved_port())
            db = self.dir / f"producer-{number}.db"
            args = [str(PRODUCER_PROGRAM), str(db), str(port), str(TOTAL)]
            args += ["--allow", str(self.allow_file)]
            args += ["--pace", str(PACE), "--seed", str(self.rng.randrange(2**32))]
            self.producers.append(Proc(args, self.dir / f"producer-{number}.log"))
            self.addresses.append(f"127.0.0.1:{port}")
        for producer in self.producers:
            ready = producer.wait_line("READY", PRODUCER_START_TIMEOUT, self.context)
            self.event(f"{producer.log.name}: {ready}")

    def start_hosts(self) -> None:
        """PRODUCERS producers, HOSTED to a process."""
        hosted = []
        for first in range(0, PRODUCERS, HOSTED):
            numbers = range(first, min(first + HOSTED, PRODUCERS))
            args = [str(HOST_PROGRAM), str(TOTAL)]
            args += [str(self.dir / f"producer-{number}.db") for number in numbers]
            args += ["--allow", str(self.allow_file)]
            args += ["--pace", str(PACE), "--seed", str(self.rng.randrange(2**32))]
            self.producers.append(Proc(args, self.dir / f"host-{first // HOSTED}.log"))
            hosted.append(len(numbers))
        for host, count in zip(self.producers, hosted, strict=True):
            ready = host.wait_lines("READY", count, PRODUCER_START_TIMEOUT, self.context)
            self.addresses += [line.split()[2] for line in ready]
        self.event(f"{PRODUCERS} producers in {len(self.producers)} processes ready")

    def heads(self) -> int:
        """Records published so far, by all producers."""
        total = 0
        for address in self.addresses:
            with streamq.Client(address, timeout=10) as client:
                total += client.head(STREAM).head
        return total

    def wait_published(self) -> None:
        self.allow(TOTAL)
        deadline = time.monotonic() + PUBLISH_TIMEOUT
        for producer in self.producers:
            producer.wait_line("COMPLETE", max(0.0, deadline - time.monotonic()), self.context)
        self.event(f"producers complete, {self.heads()} records")

    def expected(self) -> dict[tuple[str, int], Row]:
        """Every record, as the producers serve it, by (producer id, seq)."""
        rows: dict[tuple[str, int], Row] = {}
        for address in self.addresses:
            with streamq.Client(address, timeout=20) as client:
                info = client.head(STREAM)
                assert (info.low, info.head) == (1, TOTAL), f"{address}: {info}: {self.context()}"
                pid = client.producer_id
                for batch in client.read_range(STREAM, 1, TOTAL + 1):
                    for r in batch:
                        assert not r.headers, f"{address} seq {r.seq}: {r}"
                        row = (pid, address, STREAM, r.seq, r.key, r.value, r.timestamp)
                        assert rows.setdefault((pid, r.seq), row) == row, (
                            f"{address} served seq {r.seq} twice: {self.context()}"
                        )
        assert len(rows) == PRODUCERS * TOTAL, self.context()
        return rows

    # --- the query ---------------------------------------------------------

    def prepare_query(self, *extra: str) -> None:
        """Start the next run's program, which starts its SparkSession and then waits for its
        go (``start_query``) to start the query."""
        assert self.next_query is None
        self.runs += 1
        name = f"query-{self.runs}.log"
        args = [str(QUERY_PROGRAM), ",".join(self.addresses), str(self.checkpoint), str(self.out)]
        args += ["--max-per-trigger", str(MAX_PER_TRIGGER)]
        self.event(f"{name}: start {' '.join(extra)}")
        self.next_query = Proc([*args, *extra, "--wait-go"], self.dir / name, piped=True)

    def start_query(self) -> Proc:
        """Start the query of the prepared run, once its SparkSession runs."""
        query, self.next_query = self.next_query, None
        assert query is not None
        query.wait_line("SESSION", SESSION_TIMEOUT, self.context)
        query.send("go")
        self.event(f"{query.log.name}: go")
        self.query = query
        return query

    def interrupted_run(self, how: str, *next_run: str) -> None:
        """A run of the query, SIGKILLed (``kill``) or stopped (``stop``) while it works; the
        next run (its arguments ``next_run``) is prepared meanwhile."""
        self.stop_file.unlink(missing_ok=True)
        heads_before = self.heads()
        self.allow(SHARE * (self.runs + 1))  # the next share, committed while the run works
        query = self.start_query()
        self.prepare_query(*next_run)  # its JVM starts while this run starts its query
        first = query.wait_line("BATCH", QUERY_START_TIMEOUT, self.context)
        self.event(f"{query.log.name}: {first.partition(' end=')[0]}")
        time.sleep(self.rng.uniform(*KILL_DELAY))  # fault injection, not synchronization
        if how == "kill":
            rc = query.kill_all()
            assert rc == -signal.SIGKILL, (
                f"{query.log.name} exited ({rc}) before it was killed:\n"
                f"{query.tail()}\n{self.context()}"
            )
        else:
            self.stop_file.touch()
            rc = query.wait(STOP_TIMEOUT)
            assert rc == 0, f"{query.log.name}: exit {rc}:\n{query.tail()}\n{self.context()}"
            assert query.matching("STOPPED"), f"{query.tail()}\n{self.context()}"
            query.kill_all()  # its JVM and workers, if any linger
        heads_after = self.heads()
        self.published_while_running.append(heads_after - heads_before)
        batches = query.matching("BATCH")
        self.event(
            f"{query.log.name}: {how} after {len(batches)} batches, {batches[-1][:60]}...; "
            f"producers published {heads_after - heads_before} meanwhile"
        )
        self.check_committed(batches[-1])

    def check_committed(self, last_batch: str) -> None:
        """Between runs: the sink holds a prefix of every producer's stream, each record once,
        at least up to the last batch the run reported complete, and never less than before."""
        rows = read_rows(committed_files(self.out))
        seqs: dict[str, list[int]] = {}
        for row in rows:
            seqs.setdefault(row[0], []).append(row[3])
        reported = json.loads(last_batch.partition(" end=")[2])[0]
        reported.pop("epochs", None)  # beside the seqs: {producer id: epoch}
        for pid in set(seqs) | set(reported):
            found = sorted(seqs.get(pid, []))
            assert found == list(range(1, len(found) + 1)), (
                f"sink after {self.query and self.query.log.name}: producer {pid} has "
                f"{len(found)} rows, {len(set(found))} distinct seqs, up to "
                f"{found[-1] if found else 0}: {self.context()}"
            )
            assert len(found) >= reported.get(pid, 1) - 1, (
                f"producer {pid}: the sink holds seqs up to {len(found)}, but the batch "
                f"{last_batch} completed: {self.context()}"
            )
            assert len(found) >= self.committed.get(pid, 0), (
                f"producer {pid}: the sink went back from {self.committed[pid]} records to "
                f"{len(found)}: {self.context()}"
            )
            self.committed[pid] = len(found)
        self.event(f"sink holds {len(rows)} records: {sorted(self.committed.values())}")

    def last_run(self) -> None:
        """The prepared run with ``--available-now``."""
        query = self.start_query()
        rc = query.wait(LAST_RUN_TIMEOUT)
        assert rc == 0, f"last run: exit {rc}:\n{query.tail()}\n{self.context()}"
        assert query.matching("DONE") and query.matching("DUMPED"), query.tail()
        query.kill_all()
        self.event(f"{query.log.name}: {query.matching('DUMPED')[0]}")

    def stop(self) -> None:
        for proc in [self.query, self.next_query, *self.producers]:
            if proc is not None:
                proc.kill_all()
        self.ports.close()


@pytest.mark.slow
@pytest.mark.timeout(180 + 45 * (KILLS + STOPS))
def test_spark_parquet_sink_gets_every_record_once_through_kill_9_and_restarts(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("STREAMQ_SPARK_SEED") or random.randrange(2**32))
    run = SparkRun(tmp_path, seed)
    dump = tmp_path / "dump.parquet"
    with adopting_orphans():
        try:
            run.start_producers()
            interruptions = ["kill"] * KILLS + ["stop"] * STOPS
            run.rng.shuffle(interruptions)
            interrupted = ("--stop-file", str(run.stop_file))
            draining = ("--available-now", "--dump", str(dump))
            run.prepare_query(*interrupted)
            for n, how in enumerate(interruptions, 1):
                run.interrupted_run(how, *(interrupted if n < len(interruptions) else draining))
            run.wait_published()
            run.last_run()
            expected = run.expected()
        finally:
            run.stop()
    context = run.context()

    # The producers committed while each run of the query worked.
    assert all(n > 0 for n in run.published_while_running), (
        f"{run.published_while_running}: {context}"
    )

    # What the sink committed, read from its log here and by Spark in the last run.
    files = committed_files(run.out)
    committed = read_rows(files)
    by_spark = read_rows([dump])
    assert Counter(by_spark) == Counter(committed), (
        f"spark.read.parquet read {len(by_spark)} rows, the sink's log lists "
        f"{len(committed)}: {context}"
    )

    # Files a killed run wrote but never committed hold the same records the batch's rerun
    # committed: a batch reads exactly the seqs its offsets say, each time.
    left = sorted(set(run.out.glob("*.parquet")) - set(files))
    readable = whole_files(left)
    strays = set(read_rows(readable)) - set(committed)
    assert not strays, (
        f"{len(strays)} records in uncommitted files that no committed file holds, e.g. "
        f"{list(strays)[:3]}: {context}"
    )

    # Every record of every producer exactly once, as the producer serves it; nothing else.
    found = Counter((row[0], row[3]) for row in committed)
    duplicated = sorted(key for key, n in found.items() if n > 1)
    missing = sorted(set(expected) - set(found))
    unknown = sorted(set(found) - set(expected))
    assert not duplicated, f"{len(duplicated)} records twice, e.g. {duplicated[:10]}: {context}"
    assert not missing, f"{len(missing)} records missing, e.g. {missing[:10]}: {context}"
    assert not unknown, f"{len(unknown)} records never published: {unknown[:10]}: {context}"
    wrong = [row for row in committed if row != expected[row[0], row[3]]]
    assert not wrong, (
        f"{len(wrong)} records differ from the producer's, e.g. {wrong[:3]} vs "
        f"{[expected[row[0], row[3]] for row in wrong[:3]]}: {context}"
    )
    assert len(committed) == PRODUCERS * TOTAL, context
    assert run.committed, context  # the interrupted runs left something committed
    print(
        f"\n{context}\n{len(committed)} records checked; {len(files)} files committed, "
        f"{len(left)} left uncommitted by killed runs ({len(left) - len(readable)} truncated)"
    )

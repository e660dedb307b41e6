"""What every workload shares: child processes, the machine, results and tables (charts:
``bench.charts``; pacing and latencies: ``bench.measure``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from rich.console import Console
from rich.table import Table

T = TypeVar("T")

RESULTS = Path(__file__).parent / "results"  # full runs: committed, shown in the README


def results_dir(quick: bool, partial: bool = False) -> Path:
    """Where a run's JSON and charts go. Quick runs, and partial ones (a baseline left
    out), stay out of the committed results, which only a whole run may replace."""
    if partial:
        return RESULTS / "partial"
    return RESULTS / "quick" if quick else RESULTS


console = Console()

# Durability is matched in two pairs, printed and stored with every result.
DURABILITY = {
    "normal": {
        "streamq": "SQLite WAL, synchronous=NORMAL: a commit survives a process crash",
        "kafka": "acks=all, default flush (page cache): survives a process crash",
        "nats": "JetStream file storage, default sync_interval (2 min, page cache until "
        "then): survives a process crash",
    },
    "full": {
        "streamq": "SQLite WAL, synchronous=FULL: a commit survives power loss",
        "kafka": "acks=all, log.flush.interval.messages=1: fsync before acknowledging",
        "nats": "JetStream file storage, sync_interval: always: fsync of every write "
        "before acknowledging",
    },
}
# The systems streamq is compared with, in the order their ratio columns appear.
BASELINES = ("kafka", "nats")


@contextlib.contextmanager
def durability_modes(broker: Any | None) -> Iterator[list[tuple[str, Any | None]]]:
    """Each durability mode with the Kafka broker that matches it.

    ``full`` gets a second broker that flushes every message; without Kafka, None.
    """
    if broker is None:
        yield [("normal", None), ("full", None)]
        return
    # Here, not above: the broker's module loads confluent_kafka, which the workloads'
    # own processes (they all import this module) do not need.
    from .kafka.broker import KafkaBroker

    with KafkaBroker(flush_every_message=True) as flushing:
        yield [("normal", broker), ("full", flushing)]


def machine() -> dict[str, Any]:
    """Cores, memory and versions, printed and stored with every result."""
    import msgpack

    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    try:
        import confluent_kafka

        info["confluent_kafka"] = confluent_kafka.version()[0]
        info["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    return info


class Child:
    """A benchmark process speaking a line protocol on stdin/stdout (READY, GO, DONE ...)."""

    def __init__(self, module: str, *args: object) -> None:
        self.name = module.removeprefix("bench.")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        self._unread = b""  # output read from the pipe, not yet looked at by ``expect``

    def expect(self, word: str, timeout: float = 120.0) -> list[str]:
        """Wait for a line starting with ``word``; returns its other fields. Reads the pipe
        itself: lines a file object had read ahead into its buffer (two lines written at
        once) would wait there unseen while ``select`` waits for more."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._unread:
                line, _, self._unread = self._unread.partition(b"\n")
                fields = line.decode(errors="replace").split()
                if fields and fields[0] == word:
                    return fields[1:]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {word} within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"{self.name} exited ({self.process.wait()}) before {word}")
            self._unread += chunk

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._end()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def _end(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; returns once the process is gone."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Reporting(Child):
    """A Child whose lines are read as they come, on a thread of their own: ``expect`` as
    a Child's, and ``last(word)``, the fields of the latest line starting with ``word``
    (state a child reports again whenever it changes, such as the shares a group member
    holds), which a driver watching several children reads without blocking."""

    def __init__(self, module: str, *args: object) -> None:
        super().__init__(module, *args)
        self._lines: list[list[str]] = []
        self._read_to = 0  # lines before this one were looked at by ``expect``
        self._last: dict[str, list[str]] = {}
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            fields = line.split()
            with self._changed:
                self._lines.append(fields)
                if fields:
                    self._last[fields[0]] = fields[1:]
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def last(self, word: str) -> list[str] | None:
        """The other fields of the latest line starting with ``word`` (None: none yet)."""
        with self._changed:
            return self._last.get(word)

    def expect(self, word: str, timeout: float = 120.0) -> list[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for fields in self._lines[self._read_to :]:
                    self._read_to += 1
                    if fields and fields[0] == word:
                        return fields[1:]
                if self._ended:
                    code = self.process.wait()
                    raise RuntimeError(f"{self.name} exited ({code}) before {word}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no {word} within {timeout:g} s")
                self._changed.wait(left)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as ``kill -9`` from outside; returns once the process is gone."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        self._end()
        self._reader.join(timeout=10)  # to the end of its output, before the pipe closes
        super().stop()


def proc_kib(pid: int, field: str) -> int:
    """A memory figure of a process from /proc, e.g. VmRSS or VmHWM (its peak), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def proc_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: Iterable[int]) -> None:
    """Every thread of process ``pid`` (a JVM's, a Go runtime's, librdkafka's) on ``cpus``
    only; threads it starts later inherit their parent thread's."""
    wanted = set(cpus)
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), wanted)


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port on loopback that no other process can take while the block runs, for a
    server told to listen on it, once or again after each restart.

    A port found free and let go (bind to 0, close) can be taken by another process before
    the server binds it: a Spark master then moved to the next port, and the test read
    another Spark UI's page. This port stays bound, with SO_REUSEADDR, and never listens:
    the kernel hands it to no one else (neither ``bind`` to port 0 nor an outgoing
    connection's source port), a server binding it with SO_REUSEADDR (asyncio's, uvicorn,
    PostgreSQL, the JVM's) shares it, and until one listens a connection to it is
    refused. A process binding it without SO_REUSEADDR gets ``EADDRINUSE``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # before SO_REUSEADDR: a port no socket holds
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        yield int(sock.getsockname()[1])


def wait_until(
    what: str, probe: Callable[[], T | None], timeout: float = 120.0, every: float = 0.005
) -> T:
    """``probe()`` once it returns something other than None or False, asked ``every``
    seconds; ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(every)


def alternating(systems: Sequence[str], repeats: int) -> Iterator[str]:
    """Each system once per repeat, alternating which goes first so drift hits all alike."""
    for repeat in range(repeats):
        yield from (systems if repeat % 2 == 0 else systems[::-1])


def wait_line(word: str) -> None:
    """In a child: block until the parent sends ``word``."""
    for line in sys.stdin:
        if line.strip() == word:
            return
    raise SystemExit(0)  # parent went away


def say(*fields: object) -> None:
    """In a child: one line to the parent."""
    print(*fields, flush=True)


@dataclass
class Series:
    """Repeated measurements of one figure for one system and case."""

    system: str
    case: str
    unit: str
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the runs disagree."""
        if len(self.values) < 2 or not self.median:
            return 0.0
        return (max(self.values) - min(self.values)) / self.median


# Latency runs: (system, case) -> one [p50, p99, p99.9, max] (microseconds) per repeat.
PERCENTILES = ("p50", "p99", "p99.9", "max")
LatencyRuns = dict[tuple[str, str], list[list[int]]]


def percentile_series(runs: LatencyRuns) -> list[Series]:
    """One Series per (system, case, percentile), for the JSON results and the charts."""
    return [
        Series(system, f"{case} {name}", "us", [figures[i] for figures in repeats])
        for (system, case), repeats in runs.items()
        for i, name in enumerate(PERCENTILES)
    ]


def baselines_of(systems: Iterable[str]) -> list[str]:
    """The baselines to give streamq a ratio against: those measured, Kafka if none was
    (its column then stays empty, as it always did)."""
    present = set(systems)
    return [b for b in BASELINES if b in present] or ["kafka"]


def latency_table(title: str, runs: LatencyRuns) -> Table:
    """Median of each percentile per case and system, with streamq's p99 over each
    baseline's (Kafka's; NATS's too when it ran)."""
    table = Table(title=title)
    baselines = baselines_of(system for system, _ in runs)
    ratios = [f"p99 vs {b}" for b in baselines]
    for column in ("case", "system", *PERCENTILES, *ratios):
        table.add_column(column, justify="left" if column in ("case", "system") else "right")
    cases = list(dict.fromkeys(case for _, case in runs))
    for case in cases:
        medians: dict[str, list[int]] = {}
        for system in ("streamq", *BASELINES):
            figures = runs.get((system, case))
            if figures:
                medians[system] = [
                    sorted(f[i] for f in figures)[len(figures) // 2] for i in range(4)
                ]
        for system, m in medians.items():
            cells = []
            for b in baselines:
                ok = system == "streamq" and medians.get(b, [0, 0])[1]
                cells.append(f"{m[1] / medians[b][1]:.2f}x" if ok else "")
            table.add_row(case, system, *(f"{v:,}" for v in m), *cells)
    return table


def save(
    workload: str,
    payload: dict[str, Any],
    quick: bool,
    folder: Path | None = None,
    *,
    partial: bool = False,
) -> Path:
    """``folder/WORKLOAD.json`` (default: ``results_dir(quick, partial)``) with the machine's
    details and the date, then the workload's charts, drawn from what was saved."""
    folder = results_dir(quick, partial) if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{workload}.json"
    payload = {
        "workload": workload,
        "machine": machine(),
        "at": time.time(),
        "durability": DURABILITY,
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    from .charts import draw  # matplotlib: only once there are results

    draw(json.loads(path.read_text()), folder)
    return path


def comparison_table(title: str, series: Sequence[Series], better: str = "higher") -> Table:
    """Median and spread per system and case, with streamq / kafka as a ratio (and
    streamq / nats when NATS ran)."""
    table = Table(title=title)
    baselines = baselines_of(s.system for s in series)
    ratios = [f"streamq / {b}" if better == "higher" else f"{b} / streamq" for b in baselines]
    for column in ("case", "system", "median", "spread", "runs", *ratios):
        table.add_column(column, justify="right" if column != "system" else "left")
    by_case: dict[str, dict[str, Series]] = {}
    for s in series:
        by_case.setdefault(s.case, {})[s.system] = s
    for case, systems in by_case.items():
        for name, s in systems.items():
            cells = []
            for b in baselines:
                ratio = ""
                if name == "streamq" and b in systems and systems[b].median:
                    value = s.median / systems[b].median
                    if better == "lower" and s.median:
                        value = systems[b].median / s.median
                    ratio = f"{value:.2f}x"
                cells.append(ratio)
            table.add_row(
                case,
                name,
                f"{s.median:,.0f} {s.unit}",
                f"{s.spread:.0%}",
                str(len(s.values)),
                *cells,
            )
    return table


def int_list(text: str) -> list[int]:
    """``1,10,100`` (an option's value) as ``[1, 10, 100]``."""
    try:
        return [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, e.g. 1,10,100") from None


def workload_main(
    prog: str,
    doc: str | None,
    run: Callable[..., Any],
    argv: Any,
    *,
    nats: bool = False,
    lists: Mapping[str, str] | None = None,
) -> int:
    """``python -m bench.<workload>.run``: its options, a Kafka broker unless ``--no-kafka``,
    then ``run(broker, quick, repeats, seed)``; with ``nats`` (the workloads with NATS as a
    second baseline, which start its servers themselves) ``run(broker, quick, repeats,
    nats=...)``, NATS unless ``--no-nats``. ``lists``: options of comma-separated whole
    numbers (name: help), passed to ``run`` as keywords when given."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    for name, text in (lists or {}).items():
        parser.add_argument(f"--{name}", type=int_list, default=None, help=text)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (3; quick: 1)")
    parser.add_argument("--no-kafka", action="store_true", help="no Kafka broker")
    if nats:
        parser.add_argument("--no-nats", action="store_true", help="no NATS JetStream server")
    else:
        parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    with contextlib.ExitStack() as stack:
        broker: Any = None
        if not args.no_kafka:
            from .kafka.broker import KafkaBroker  # confluent_kafka: only with a broker

            broker = stack.enter_context(KafkaBroker())
        chosen = {n: getattr(args, n) for n in lists or {} if getattr(args, n) is not None}
        if nats:
            run(broker, args.quick, repeats, nats=not args.no_nats, **chosen)
        else:
            run(broker, args.quick, repeats, args.seed, **chosen)
    return 0

"""The transfer workload's runs as processes: its sizes, one system's services deployed for
a run (``Deployment``: their files, where they meet, their processes, kills), and a run
without kills (``flow``). The workload's driver (``run``) and the floor's (``floor``)
both measure flows.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from streamq.engines.sqlite.storage import HEAD_QUERY

from ..common import Child
from .common import LEDGER, STREAM

# The processes of each system's module (``kafka-*``: one module for both).
PROGRAMS = {
    "streamq": "bench.transfer.streamq",
    "kafka-outbox": "bench.transfer.kafka",
    "kafka-naive": "bench.transfer.kafka",
}
# The processes of each system, in start order.
ROLES = {
    "streamq": ("producer", "consumer"),
    "kafka-outbox": ("producer", "relay", "consumer"),
    "kafka-naive": ("producer", "consumer"),
}

STARTUP_TIMEOUT = 60.0  # s for a process to say READY
FLOW_TIMEOUT = 900.0  # s for a run without kills to finish
ARM_TIMEOUT = 30.0  # s for an armed process to reach its worst moment and kill itself
POLL = 0.02  # s between looks at the files


@dataclass(frozen=True)
class Sizes:
    transfers: int  # for throughput, as fast as possible
    latency_rate: int  # transfers/s, for latency
    latency_seconds: float
    crash_transfers: int  # for the crash runs, paced at crash_rate
    crash_rate: int
    kills: int  # per system
    # By HANDLERS concurrent handlers, one per transaction, durability full; at full size
    # enough for seconds of steady state (20,000 took streamq under one second).
    handler_transfers: int


FULL = Sizes(200_000, 2_000, 10.0, 20_000, 1_000, 10, 60_000)
QUICK = Sizes(20_000, 1_000, 2.0, 5_000, 1_000, 3, 2_000)


def _scalar(path: Path, sql: str, default: int = 0) -> int:
    """One number from a service's database (``default`` if it or its table is not there yet)."""
    if not path.exists():
        return default
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as conn:
            row = conn.execute(sql).fetchone()
    except sqlite3.OperationalError as error:
        if "no such table" in str(error):
            return default
        raise
    return default if row is None or row[0] is None else int(row[0])


class Deployment:
    """One system's services for one run: their files, where they meet, their processes."""

    def __init__(
        self,
        system: str,
        folder: Path,
        total: int,
        rate: float,
        *,
        broker: Any = None,
        target: int = 0,
        port: int = 0,
        dedupe: bool = True,
        seed: int = 0,
        handlers: int = 1,
        durability: str = "normal",
    ) -> None:
        if system != "streamq" and broker is None:
            raise ValueError(f"{system} needs a Kafka broker")
        self.system = system
        self.folder = folder
        self.total = total
        self.rate = rate
        self.target = target
        self.port = port
        self.dedupe = dedupe
        self.handlers = handlers
        self.durability = durability
        self.rng = random.Random(seed)
        self.producer_db = folder / "payments.db"
        self.consumer_db = folder / "ledger.db"
        self.address = ""
        self.bootstrap = broker.bootstrap if broker is not None else ""
        self.topic = ""
        if broker is not None and system != "streamq":
            self.topic = f"transfer-{uuid.uuid4().hex[:8]}"
            broker.create_topic(self.topic, 1)
            broker.create_topic(f"{self.topic}-warm-up", 1)  # see KafkaSender
        self.children: dict[str, Child] = {}
        self.lives: Counter[str] = Counter()
        self._watermarks: Any = None

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _args(self, role: str) -> list[object]:
        seed = self.rng.randrange(2**31)
        p, c, total, rate = self.producer_db, self.consumer_db, self.total, self.rate
        if self.system == "streamq":
            if role == "producer":
                return ["producer", p, self.port, total, rate, seed, self.handlers, self.durability]
            return ["consumer", self.address, c, self.target]
        if role == "producer" and self.system == "kafka-outbox" and self.handlers > 1:
            return ["outbox-handlers", p, total, seed, self.handlers, self.durability]
        if role == "producer" and self.system == "kafka-outbox":
            return ["outbox-producer", p, total, rate, seed]
        if role == "producer":
            return ["naive-producer", p, self.bootstrap, self.topic, total, rate, seed]
        if role == "relay":
            return ["relay", p, self.bootstrap, self.topic]
        dedupe = "1" if self.dedupe else "0"
        return ["consumer", self.bootstrap, self.topic, c, self.target, dedupe]

    def start(self, role: str) -> None:
        """Start one process and wait until it is ready (a producer: also let it go)."""
        child = Child(PROGRAMS[self.system], *self._args(role))
        self.children[role] = child
        self.lives[role] += 1
        fields = child.expect("READY", STARTUP_TIMEOUT)
        if role == "producer" and self.system == "streamq" and not self.address:
            self.address = fields[0]
        if role == "producer" and self.lives[role] > 1:
            self.go()

    def start_all(self) -> None:
        for role in ROLES[self.system]:
            self.start(role)

    def go(self) -> float:
        """Let the producer run; returns the wall-clock time it started at."""
        producer = self.children["producer"]
        producer.send("GO")
        return float(producer.expect("START", STARTUP_TIMEOUT)[0])

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            child.stop()
        self.children.clear()
        if self._watermarks is not None:
            self._watermarks.close()
            self._watermarks = None

    def check_alive(self) -> None:
        for role, child in self.children.items():
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{self.system}: {role} exited with {code} without being killed "
                    f"(files in {self.folder})"
                )

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Poll ``condition`` until it holds (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while not condition():
            self.check_alive()
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
        return True

    def wait_committed(self, transfers: int, timeout: float) -> None:
        if not self.wait(lambda: self.committed() >= transfers, timeout):
            raise TimeoutError(
                f"{self.system}: fewer than {transfers} transfers committed within {timeout:g} s"
            )

    # --- what the files say ------------------------------------------------

    def committed(self) -> int:
        """Transfers the payments service has committed."""
        return _scalar(self.producer_db, "SELECT MAX(transfer_id) FROM transfers")

    def high_watermark(self) -> int:
        from confluent_kafka import Consumer, TopicPartition

        if self._watermarks is None:
            self._watermarks = Consumer(
                {"bootstrap.servers": self.bootstrap, "group.id": "transfer-check"}
            )
        _, high = self._watermarks.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=10)
        return int(high)

    def drained(self) -> bool:
        """Everything committed has reached the ledger (deterministic, from files and topic)."""
        if self.system == "streamq":
            head = _scalar(self.producer_db, HEAD_QUERY.replace("?", f"'{STREAM}'"), -1)
            position = _scalar(
                self.consumer_db,
                f"SELECT seq FROM streamq_positions WHERE consumer = '{LEDGER}'",
                -2,
            )
            return head == position
        if self.system == "kafka-outbox":
            relayed = _scalar(self.producer_db, "SELECT last FROM relay_state", -1)
            if relayed != _scalar(self.producer_db, "SELECT COALESCE(MAX(id), 0) FROM outbox", -2):
                return False
        position = _scalar(
            self.consumer_db, f"SELECT next FROM offsets WHERE topic = '{self.topic}'", -1
        )
        return position == self.high_watermark()

    # --- kills ---------------------------------------------------------------

    def kill(self, role: str, how: str) -> str:
        """SIGKILL ``role`` (``armed``: it kills itself at its worst moment); restart it.

        Returns how the kill landed: ``armed`` or ``random`` (also an armed kill that did not
        fire within ``ARM_TIMEOUT``: then it is killed from outside).
        """
        self.check_alive()
        child = self.children[role]
        landed = how
        if how == "armed":
            child.send(f"ARM {self.rng.randint(1, 3)}")
            try:
                child.process.wait(ARM_TIMEOUT)
            except subprocess.TimeoutExpired:
                landed = "random"
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait(10)
        if child.process.returncode != -signal.SIGKILL:
            raise RuntimeError(
                f"{self.system}: {role} exited with {child.process.returncode}, not by SIGKILL "
                f"(files in {self.folder})"
            )
        child.stop()
        self.start(role)
        return landed


@dataclass(frozen=True)
class Flow:
    """A run without kills."""

    seconds: float  # from GO to the commit of the last credit
    producer_seconds: float  # from GO to the producer's last commit
    latency: list[int]  # p50, p99, p99.9, max (microseconds), count
    cpu: dict[str, float]  # each process's CPU seconds (all its threads) from GO to the end


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far, all its threads (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flow(
    system: str,
    broker: Any,
    folder: Path,
    total: int,
    rate: float,
    handlers: int = 1,
    durability: str = "normal",
) -> Flow:
    """One run without kills (``handlers`` > 1: that many request handlers, one transfer
    per transaction, as fast as they can)."""
    with Deployment(
        system,
        folder,
        total,
        rate,
        broker=broker,
        target=total,
        handlers=handlers,
        durability=durability,
    ) as deployment:
        deployment.start_all()
        pids = {role: child.process.pid for role, child in deployment.children.items()}
        before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        start = deployment.go()
        done = deployment.children["consumer"].expect("DONE", FLOW_TIMEOUT)
        produced = deployment.children["producer"].expect("DONE", STARTUP_TIMEOUT)
        cpu = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
        return Flow(
            float(done[0]) - start,
            float(produced[0]) - start,
            [int(v) for v in done[1:6]],
            cpu,
        )

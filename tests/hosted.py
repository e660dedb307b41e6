"""A producer in a process of its own, for tests that pause it (SIGSTOP) as an overloaded
or stuck machine would be paused."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.spark.footprint import established
from streamq.wire.transport import parse_address


@contextlib.contextmanager
def hosted(db: str) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """A producer served by a process of its own (``bench.spark.host``), to pause with
    SIGSTOP: (producer id, address, process)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.spark.host", db],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "serving producer ID on HOST:PORT"
        assert line.startswith("serving producer"), line
        yield line.split()[2], line.rsplit(" on ", 1)[1].strip(), process
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        process.communicate(timeout=30)


def unread(address: str) -> int:
    """Bytes its peers have sent the producer at ``address`` that it has not read yet, over
    every connection (the kernel's receive queues, ``/proc/net/tcp``): what a paused
    producer has been asked."""
    port = parse_address(address)[1]
    return sum(c.unread for c in established() if c.local_port == port)

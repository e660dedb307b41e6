"""One lock between processes, for the baselines' setup (the Kafka broker's download and
build, NATS's ``go install``): it imports nothing of the benchmarks, so both can use it."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, timeout: float, error: type[Exception]) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, waited for at most ``timeout`` seconds (then
    ``error``): two processes must not download or build the same thing at once."""
    with path.open("a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise error(f"{path} stayed locked for {timeout:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

"""Waiting on a condition from plain (not async) test code: poll it, fail on a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import streamq


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Check ``condition`` until it holds; raise ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def producer_connections(address: str) -> int:
    """The producer's open connections, as its status counts them (this one's included)."""
    with streamq.Client(address) as client:
        count: int = client.status()["connections"]
        return count

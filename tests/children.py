"""This test process's child processes, read from /proc: the benchmark smoke tests check
that none is left running, beside the servers session fixtures keep (``KEPT``)."""

from __future__ import annotations

import os
from pathlib import Path

KEPT: set[int] = set()  # pids of the session fixtures' servers (Spark's JVM, a Kafka broker)


def running_children() -> dict[int, str]:
    """{pid: command line} of this process's children still running, but for ``KEPT``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == os.getpid() and int(entry.name) not in KEPT:
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found

"""A consumer group's rows in a SQLite consumer database (``engines.leases``).

A member's liveness lock is an open-file-description lock (``F_OFD_SETLK``) on one byte
of a file beside the database (``DB-streamq-members``), at the member's id as offset.
The kernel releases it when the process dies, however it dies; unlike the POSIX locks
SQLite itself takes, it belongs to this member's open file, so members in one process
are told apart, and closing other descriptors of the file does not drop it. The
database file itself is never opened here: closing a descriptor of it would drop
SQLite's own locks in this process. Without OFD locks (not Linux), members are known
dead only once their row expires.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import struct
from typing import Any
from urllib.request import pathname2url

from ...errors import DatabaseOpenError
from ..leases import LeaseTable
from .storage import BUSY_TIMEOUT_MS

_OFD = hasattr(fcntl, "F_OFD_SETLK")
_FLOCK = "hhqqi4x"  # struct flock on Linux: type, whence, start, len, pid


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0)


class SQLiteLeases(LeaseTable):
    NOW = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"

    def __init__(self, db: str, name: str, stream: str) -> None:
        super().__init__(db, name, stream)
        self.where = f"SQLite database {db!r}"
        self._lock_fd: int | None = None

    def _connect(self) -> Any:
        try:  # mode=rw: the consumer's store made the file; a missing one is an error
            return sqlite3.connect(
                f"file:{pathname2url(self.db)}?mode=rw",
                uri=True,
                isolation_level=None,
                timeout=BUSY_TIMEOUT_MS / 1000,
                check_same_thread=False,  # called from the default executor's threads
            )
        except sqlite3.Error as exc:
            raise DatabaseOpenError(f"cannot open {self.where}: {exc}") from exc

    def _begin(self) -> None:
        self._execute("BEGIN IMMEDIATE")  # the write lock first: reads and writes agree

    def _hold_liveness(self) -> None:
        if not _OFD:
            return
        self._lock_fd = os.open(f"{self.db}-streamq-members", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.fcntl(self._lock_fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, self.member))

    def _alive(self, members: list[int]) -> set[int]:
        if self._lock_fd is None:
            return set(members)  # no liveness locks: rows expire instead
        alive = set()
        for member in members:
            if member == self.member:
                alive.add(member)  # its own lock never conflicts with itself
                continue
            found = fcntl.fcntl(self._lock_fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, member))
            if struct.unpack(_FLOCK, found)[0] != fcntl.F_UNLCK:
                alive.add(member)
        return alive

    def _release_liveness(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

"""One serving process per producer database.

Any number of processes may publish into a producer database; one serves it. A second
server would hand out the same seqs from a second address, and consumers that moved
between them could not tell. The serving process holds an exclusive ``flock`` on
``<database>-serve.lock`` for as long as it runs (the kernel drops it when the process
dies, even by ``kill -9``) and writes its pid and address there, so a second one is
refused with an error that names the file and the process already serving it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket

from ...errors import AlreadyServedError


class ServeLock:
    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def claim(cls, database: str) -> ServeLock:
        """Take the lock, or raise ``AlreadyServedError`` naming who holds it."""
        path = database + "-serve.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise AlreadyServedError(
                f"{database!r} is already served by {holder}: one process serves a producer "
                "database; the others publish with Producer(..., serve=False), "
                "SyncProducer(..., serve=False) or streamq.publish(conn, ...)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock._write({"pid": os.getpid(), "host": socket.gethostname()})
        return lock

    def serving(self, address: str) -> None:
        """Note where this process serves (for the next one's error message)."""
        self._write({"pid": os.getpid(), "host": socket.gethostname(), "address": address})

    def _write(self, holder: dict[str, object]) -> None:
        data = json.dumps(holder).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


def _describe(data: bytes) -> str:
    try:
        holder = json.loads(data)
        where = f" at {holder['address']}" if "address" in holder else ""
        return f"process {holder['pid']} on {holder['host']}{where}"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"

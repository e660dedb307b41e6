"""``streamq serve`` for many databases at once, for tests/spark/test_spark_many.py: a process per
database, each forked from this one once it has imported streamq (a Python start and
streamq's imports cost ~0.3 s of CPU each: 64 of them take 10-20 s on two cores).

    fleet.py DB...

Each child runs ``streamq serve DB --port 0`` (``streamq.cli.main``), which prints
``serving producer ID (epoch N) on HOST:PORT`` (the children share stdout, each line
written whole). A child that ends before this process is told to stop: ``exited DB <status>``.
On SIGTERM this process sends SIGTERM to every child, waits for them all, and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from types import FrameType

from streamq.cli import main as streamq_main


def fork_server(db: str) -> int:
    """The pid of a child serving ``db``; the child never returns from here."""
    pid = os.fork()
    if pid:
        return pid
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until streamq serve handles it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # A line in one write, so that the children's lines never mix (unbuffered, as with
    # PYTHONUNBUFFERED, print writes a line's text and its end apart).
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    code = 1
    try:
        code = streamq_main(["serve", db, "--port", "0"])
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(dbs: list[str]) -> int:
    children: dict[int, str] = {}
    stopping = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    # A SIGTERM while the children are forked (this process may get little CPU meanwhile,
    # the first children starting) waits until every one of them is known.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, stop)
    for db in dbs:
        children[fork_server(db)] = db
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while children:
        pid, status = os.wait()
        db = children.pop(pid)
        if not stopping:
            print(f"exited {db} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A producer serving in its own process (tests/crash/server_proc.py), measured from outside.

Attacks on the server run against a separate process so that its memory (VmRSS, and
VmHWM, the peak) is its own, not the test's or hypothesis's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from bench.common import proc_kib

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(__file__).resolve().parent / "crash" / "server_proc.py"


class ServerProc:
    """``with ServerProc(db, "--max-connections", "100") as server: server.address``."""

    def __init__(self, db: Path, *options: str) -> None:
        self.log = db.with_suffix(".log")
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, str(PROGRAM), str(db), *options],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.address = self._wait_ready(20.0)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log.read_text().splitlines():
                if line.startswith("READY "):
                    return line.split()[1]
            assert self.popen.poll() is None, f"server exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"server not ready: {self.log.read_text()}"
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def rss_kib(self) -> int:
        return proc_kib(self.popen.pid, "VmRSS")

    def peak_kib(self) -> int:
        return proc_kib(self.popen.pid, "VmHWM")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> ServerProc:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.popen.kill()
        self.popen.wait(timeout=10)

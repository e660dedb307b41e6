"""A producer serving in its own process (tests/crash/server_proc.py), measured from outside.

Attacks on the server run against a separate process so that its memory (VmRSS, and
VmHWM, the peak) is its own, not the test's or hypothesis's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from bench.common import proc_kib
from streamq.protocol import PROTOCOL_VERSION, ClientConnection, ClientHello, Records, Subscribe

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


class Subscriber:
    """A well-behaved blocking subscriber that must keep receiving throughout."""

    def __init__(self, address: str, stream: str = "orders") -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = ClientConnection()
        self.sock.sendall(self.conn.send(ClientHello(PROTOCOL_VERSION, "bystander")))
        self.sock.sendall(self.conn.send(Subscribe(stream, 1, "bystander", None)))
        self.last = 0

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def receive_until(self, seq: int) -> None:
        while self.last < seq:
            message = self.conn.next_event()
            if message is None:
                data = self.sock.recv(65536)
                assert data, "the server closed the bystander's subscription"
                self.conn.receive_data(data)
            elif isinstance(message, Records) and message.records:
                self.last = message.records[-1].seq

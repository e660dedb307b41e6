"""A real, single-node NATS server with JetStream for the benchmarks, on loopback only.

The binary is ``$NATS_SERVER`` when that is set, else ``bench/nats/bin/nats-server``,
built there with ``go install github.com/nats-io/nats-server/v2@VERSION`` on first use
(the Go module proxy is the one place it comes from)::

    from bench.nats.server import NatsServer

    with NatsServer(sync_always=True) as server:  # writes its config, starts, waits for /healthz
        server.create_stream("orders")            # FILE storage, one replica
        print(server.url)                         # "nats://127.0.0.1:54321"
        print(server.config)                      # the JetStream settings the server reports
    # stopped (SIGTERM, then SIGKILL after a bound), its temporary folder removed

``python -m bench.nats.server`` builds it if needed, starts one, publishes and reads back
a few messages with nats-py, and stops it; ``--build`` only builds.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ..locks import file_lock

HERE = Path(__file__).resolve().parent
BIN = HERE / "bin"  # git-ignored: the built binary
MODULE = "github.com/nats-io/nats-server/v2"
VERSION = "v2.15.2"
GO_FALLBACK = Path("/usr/local/go/bin/go")  # where Go's own installer puts it

BUILD_TIMEOUT = 900.0  # s, one `go install` (cold: module downloads and a compile, ~2 min)
VERSION_TIMEOUT = 10.0  # s, `nats-server --version`
STARTUP_TIMEOUT = 30.0  # s, from launch until /healthz answers ok (it takes ~10 ms)
STOP_TIMEOUT = 10.0  # s of SIGTERM (JetStream's orderly shutdown) before SIGKILL
API_TIMEOUT = 10.0  # s, one JetStream API call from this process (stream creation)

T = TypeVar("T")
# Loopback is asked directly, never through an http_proxy the environment may name.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class NatsServerError(RuntimeError):
    """Building, starting or talking to nats-server failed; the message says why."""


# --------------------------------------------------------------------------- binary


def go_executable() -> str:
    """``go`` from PATH, else the usual install location; a clear error if neither."""
    found = shutil.which("go") or (str(GO_FALLBACK) if GO_FALLBACK.is_file() else None)
    if found is None:
        raise NatsServerError(
            f"Go is not installed (no `go` on PATH nor {GO_FALLBACK}): install Go to build "
            f"nats-server ({MODULE}@{VERSION}), or set NATS_SERVER to a nats-server binary"
        )
    return found


def binary_version(binary: Path) -> str | None:
    """``v2.15.2`` from ``nats-server --version``; None if it does not run."""
    try:
        done = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    return words[-1] if done.returncode == 0 and words else None


def ensure_binary() -> Path:
    """The nats-server to run: ``$NATS_SERVER``, or ``bin/nats-server`` at ``VERSION``,
    built by ``go install`` when it is missing or another version."""
    given = os.environ.get("NATS_SERVER")
    if given:
        path = Path(given)
        if binary_version(path) is None:
            raise NatsServerError(f"NATS_SERVER={given} does not run `--version`")
        return path
    binary = BIN / "nats-server"
    if binary_version(binary) == VERSION:
        return binary
    BIN.mkdir(parents=True, exist_ok=True)
    with file_lock(BIN / ".build.lock", BUILD_TIMEOUT + 60, NatsServerError):
        if binary_version(binary) == VERSION:  # another process built it while we waited
            return binary
        _go_install(binary)
    return binary


def _go_install(binary: Path) -> None:
    """``go install MODULE@VERSION`` into a staging folder, then moved into place, so a
    killed build never leaves a binary that looks complete."""
    go = go_executable()
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=BIN))
    command = [go, "install", f"{MODULE}@{VERSION}"]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            stdin=subprocess.DEVNULL,
            env=_go_environment(staging),
            check=False,
        )
        built = staging / "nats-server"
        if done.returncode != 0 or not built.is_file():
            output = (done.stdout + done.stderr).strip()
            raise NatsServerError(
                f"{' '.join(command)} failed (exit {done.returncode}):\n{output[-4000:]}"
            )
        built.replace(binary)
    except subprocess.TimeoutExpired as error:
        raise NatsServerError(f"`go install` took over {BUILD_TIMEOUT:.0f} s") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if binary_version(binary) != VERSION:
        raise NatsServerError(f"{binary} built, but `--version` does not say {VERSION}")


def _go_environment(gobin: Path) -> dict[str, str]:
    """The environment of ``go install``: the binary into ``gobin``, no cgo (a static
    binary, no C compiler needed); with no HOME (some CI runners) Go has no default for
    its module and build caches, so they go beside the binary."""
    env = {**os.environ, "GOBIN": str(gobin), "CGO_ENABLED": "0"}
    if not env.get("HOME"):
        env.setdefault("GOPATH", str(BIN / ".go"))
        env.setdefault("GOCACHE", str(BIN / ".go-cache"))
        env.setdefault("GOFLAGS", "-modcacherw")  # so the cache can be deleted like any folder
    return env


def run_coroutine(coroutine: Coroutine[Any, Any, T], timeout: float = API_TIMEOUT) -> T:
    """Run a nats-py coroutine to its end from synchronous code, in a thread of its own so
    that it works whether or not the caller's thread already runs an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(asyncio.run, asyncio.wait_for(coroutine, timeout))
        return future.result(timeout + 5)


# --------------------------------------------------------------------------- server

_LIVE: set[NatsServer] = set()  # started and not yet stopped


@atexit.register
def _stop_leftovers() -> None:
    """A server never outlives the process that started it, even if not stopped."""
    for server in list(_LIVE):
        server.stop()


class NatsServer:
    """One nats-server with JetStream (FILE storage) on 127.0.0.1, as a context manager.

    Both its ports (clients, and the monitoring one /healthz is asked on) are picked by
    the server itself (``-1``) and read from its ports file, so no port can be taken
    between choosing and binding it. ``sync_always``: ``sync_interval: always``, an fsync
    on every write before the publish is acknowledged; otherwise the default interval
    (2 min), the page cache holding what is not yet synced. Its config, log and data go
    to a temporary folder, removed at stop.
    """

    def __init__(self, sync_always: bool = False, *, startup_timeout: float = STARTUP_TIMEOUT):
        self.sync_always = sync_always
        self.startup_timeout = startup_timeout
        self.folder: Path | None = None
        self.url = ""
        self.monitor = ""
        self.version = ""
        self.config: dict[str, Any] = {}
        self.returncode: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_file(self) -> Path:
        assert self.folder is not None
        return self.folder / "server.log"

    def start(self) -> None:
        """Build if needed, write the config, launch, wait until ready; on any failure the
        server is stopped and its folder removed before the error propagates."""
        binary = ensure_binary()
        try:
            self._start(binary)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="streamq-nats-"))
        _LIVE.add(self)
        sync = "  sync_interval: always\n" if self.sync_always else ""
        conf = self.folder / "nats-server.conf"
        conf.write_text(
            "# Written by bench/nats/server.py\n"
            'listen: "127.0.0.1:-1"\n'
            'http: "127.0.0.1:-1"\n'
            f"ports_file_dir: {json.dumps(str(self.folder))}\n"
            "jetstream {\n"
            f"  store_dir: {json.dumps(str(self.folder / 'jetstream'))}\n"
            f"{sync}"
            "}\n"
        )
        self._log = self.log_file.open("ab")
        self._proc = subprocess.Popen(
            [str(binary), "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.folder,
        )
        self._wait_ready()
        self.config = self._reported_config()

    def _reported_config(self) -> dict[str, Any]:
        """The settings that matter here, as the running server reports them (/varz), so
        what is printed is what was in force, not what was meant."""
        varz = self._monitor_json("/varz")
        js = varz.get("jetstream", {}).get("config", {})
        always = bool(js.get("sync_always", False))
        if always != self.sync_always:
            raise self._failure(f"the server reports sync_always={always}")
        interval = f"every {js.get('sync_interval', 0) / 1e9:g} s (the default)"
        self.version = str(varz.get("version", ""))
        return {
            "version": self.version,
            "listen": self.url.removeprefix("nats://"),
            "jetstream.storage": "file",
            "jetstream.sync_interval": "always (fsync on every write)" if always else interval,
            "jetstream.store_dir": str(js.get("store_dir", "")),
        }

    def _wait_ready(self) -> None:
        """Until the ports file names both ports and /healthz (JetStream included) is ok."""
        assert self._proc is not None and self.folder is not None
        ports_file = self.folder / f"nats-server_{self._proc.pid}.ports"
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self._failure(f"nats-server exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise self._failure(f"nats-server was not ready within {self.startup_timeout:g} s")
            if not self.url:
                with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                    ports = json.loads(ports_file.read_text())  # partial while being written
                    self.url, self.monitor = ports["nats"][0], ports["monitoring"][0]
            if self.url:
                with contextlib.suppress(OSError, ValueError, NatsServerError):
                    if self._monitor_json("/healthz").get("status") == "ok":
                        return
            time.sleep(0.01)

    def _monitor_json(self, path: str) -> dict[str, Any]:
        try:
            with DIRECT.open(self.monitor + path, timeout=2.0) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as error:  # /healthz says 503 while starting
            raise NatsServerError(f"{path}: HTTP {error.code}") from error

    def _failure(self, what: str) -> NatsServerError:
        text = ""
        with contextlib.suppress(OSError):
            text = self.log_file.read_text(errors="replace")
        last = "\n".join(text.splitlines()[-15:])
        return NatsServerError(f"{what}; last lines of {self.log_file}:\n{last}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, wait ``timeout`` s, then SIGKILL; remove the folder. Safe to repeat."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            self.returncode = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        _LIVE.discard(self)

    def create_stream(self, name: str) -> None:
        """A stream ``name`` on subject ``name``: FILE storage, one replica, no limits."""
        from .clients import add_stream

        run_coroutine(add_stream(self.url, name))

    def delete_stream(self, name: str) -> None:
        """Remove a stream and its files (a full pipe run leaves ~1 GB otherwise)."""
        from .clients import delete_stream

        run_coroutine(delete_stream(self.url, name))

    @contextlib.contextmanager
    def stream(self, prefix: str) -> Iterator[str]:
        """A new stream with a unique name, deleted afterwards: one per benchmark run."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.create_stream(name)
        try:
            yield name
        finally:
            if self._proc is not None and self._proc.poll() is None:
                self.delete_stream(name)


@contextlib.contextmanager
def durability_servers(enabled: bool) -> Iterator[dict[str, NatsServer]]:
    """A server per durability mode, as ``durability_modes`` gives Kafka brokers:
    ``normal`` with the default sync interval, ``full`` with ``sync_interval: always``
    (none when not ``enabled``)."""
    if not enabled:
        yield {}
        return
    with NatsServer() as normal, NatsServer(sync_always=True) as full:
        yield {"normal": normal, "full": full}


def recorded_settings(servers: dict[str, NatsServer]) -> dict[str, Any]:
    """What a workload's results keep of the NATS side: each mode's server config (as the
    server reports it), the client and its settings."""
    import importlib.metadata

    from .clients import SETTINGS

    return {
        "servers": {mode: s.config for mode, s in servers.items()},
        "nats_py": importlib.metadata.version("nats-py"),
        "clients": SETTINGS,
    }


# --------------------------------------------------------------------------- self-check


def self_check(server: NatsServer, count: int = 10) -> float:
    """Publish ``count`` messages to a new stream and read them back; seconds taken."""
    from .clients import round_trip

    began = time.monotonic()
    got = run_coroutine(round_trip(server.url, "self-check", count))
    if got != count:
        raise NatsServerError(f"read back {got}/{count} messages")
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nats.server", description=__doc__)
    parser.add_argument("--build", action="store_true", help="only build (if needed) and exit")
    parser.add_argument("--sync-always", action="store_true", help="sync_interval: always")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    began = time.monotonic()
    binary = ensure_binary()
    print(f"nats-server {binary_version(binary)} at {binary} ({time.monotonic() - began:.1f} s)")
    if args.build:
        return 0
    with NatsServer(args.sync_always) as server:
        print(f"url        {server.url}  (pid {server.pid}, log {server.log_file})")
        for key, value in server.config.items():
            print(f"  {key}: {value}")
        print(f"self-check ok: 10 messages in {self_check(server):.2f} s")
    print(f"stopped, exit code {server.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

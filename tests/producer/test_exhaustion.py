"""Resource exhaustion: connection floods, slowloris, bodiless frames, many names, a full disk.

The server runs in its own process (tests/serverproc.py) so its memory is measured alone.
Throughout, a well-behaved subscriber must keep receiving what another process
publishes; the connection cap and every deadline must hold; and nothing is
acknowledged that was not committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import selectors
import socket
import sqlite3
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import streamq
from streamq import Consumer, Producer, SyncProducer
from streamq.errors import ErrorCode
from streamq.producer.consumer_positions import MAX_UNREGISTERED
from streamq.protocol import (
    PROTOCOL_VERSION,
    Ack,
    ClientHello,
    Error,
    FrameDecoder,
    GetHead,
    Message,
    ReportPosition,
    ServerHello,
    Subscribe,
    decode_message,
    encode,
)

from ..conftest import wait_for
from ..oracle import read_log
from ..pipeline import NAME, Pipeline
from ..serverproc import ServerProc, Subscriber

STREAM = "orders"
HELLO = encode(ClientHello(PROTOCOL_VERSION, "flood"))


@dataclass
class Peer:
    """One raw client connection: what it still has to send, and every frame it got."""

    sock: socket.socket
    to_send: bytes = b""
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    received: list[Message] = field(default_factory=list)
    closed_at: float | None = None

    @property
    def error(self) -> Error | None:
        last = self.received[-1] if self.received else None
        return last if isinstance(last, Error) else None


def connect(address: str, count: int) -> list[Peer]:
    host, port = address.rsplit(":", 1)
    peers = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.setblocking(False)
        peers.append(Peer(sock))
    return peers


def serve_peers(peers: list[Peer], until: float, trickle: float | None = None) -> None:
    """Read every peer until it is closed by the server or ``until`` (monotonic) passes.

    With ``trickle``, each open peer sends one byte of its ``to_send`` every ``trickle``
    seconds, the slowloris way.
    """
    selector = selectors.DefaultSelector()
    for peer in peers:
        selector.register(peer.sock, selectors.EVENT_READ, peer)
    next_byte = time.monotonic()
    try:
        while selector.get_map() and time.monotonic() < until:
            if trickle is not None and time.monotonic() >= next_byte:
                next_byte += trickle
                for peer in peers:
                    if peer.closed_at is None and peer.to_send:
                        with contextlib.suppress(OSError):
                            peer.sock.send(peer.to_send[:1])
                        peer.to_send = peer.to_send[1:]
            for key, _ in selector.select(timeout=0.05):
                peer = key.data
                try:
                    data = peer.sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                if not data:
                    peer.closed_at = time.monotonic()
                    selector.unregister(peer.sock)
                    continue
                peer.decoder.feed(data)
                while (body := peer.decoder.next_frame()) is not None:
                    peer.received.append(decode_message(body))
    finally:
        selector.close()


def close_all(peers: list[Peer]) -> None:
    for peer in peers:
        peer.sock.close()


@pytest.fixture
def fd_room() -> Iterator[None]:
    """Room in this process for a few thousand sockets (the server process raises its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, room), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def publish_elsewhere(db: Path, value: bytes) -> int:
    """Publish from another producer on the same file, as ``streamq publish`` would."""
    with SyncProducer(str(db), serve=False) as writer:
        return writer.publish(STREAM, value)


def test_thousands_of_idle_connections(
    tmp_path: Path, fd_room: None, figures: Callable[[str], None]
) -> None:
    room, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = min(3000, room - 200)  # sockets this process may open
    limit = flood * 2 // 3
    db = tmp_path / "producer.db"
    options = ["--max-connections", str(limit), "--handshake-timeout", "3"]
    with ServerProc(db, *options) as server:
        with Subscriber(server.address) as bystander:
            bystander.receive_until(20)
            started = time.monotonic()
            peers = connect(server.address, flood)
            try:
                # The bystander keeps receiving while the flood is open.
                seq = publish_elsewhere(db, b"during the flood")
                bystander.receive_until(seq)
                serve_peers(peers, until=started + 20)
                accepted = [p for p in peers if isinstance(p.received[0], ServerHello)]
                refused = [p for p in peers if p not in accepted]
                # The cap holds: the bystander and limit - 1 others; the rest refused at once.
                assert len(accepted) == limit - 1, (len(accepted), len(refused))
                for peer in refused:
                    assert peer.error is not None and len(peer.received) == 1
                    assert peer.error.code == ErrorCode.TOO_MANY_CONNECTIONS
                # Every idle one was closed by the handshake deadline, with its reason.
                for peer in accepted:
                    assert peer.closed_at is not None and peer.error is not None, peer.received
                    assert peer.error.code == ErrorCode.IDLE_TIMEOUT
                    assert "no complete CLIENT_HELLO within 3 s" in peer.error.message
                seq = publish_elsewhere(db, b"after the flood")
                bystander.receive_until(seq)
                with streamq.Client(server.address) as client:  # room again for newcomers
                    assert client.head(STREAM).head == seq
                peak = server.peak_kib()
            finally:
                close_all(peers)
        assert server.alive(), server.output()
    assert peak < 256 * 1024, f"server peak RSS {peak} KiB"
    figures(
        f"runs 1, faults injected {flood} idle connections ({len(refused)} refused at the cap, "
        f"{len(accepted)} closed by the handshake deadline), records checked 2 (by the "
        f"bystander), anomalies 0; server peak RSS {peak // 1024} MiB"
    )


SLOW_TIMEOUT = 1.0
TRICKLE = 0.25  # one byte every this many seconds: a frame of 40 bytes takes 10 s


def slowloris_cases() -> dict[str, tuple[bytes, bytes, str]]:
    """name -> (sent at once, trickled, the IDLE_TIMEOUT message expected)."""
    request = encode(GetHead(STREAM + "x" * 40))
    ack = encode(Ack(2**62))
    subscribe = encode(Subscribe(STREAM, 1, "slow", None))
    prefix = struct.pack(">I", 1000)  # a length prefix whose body never comes
    return {
        "hello trickled": (b"", encode(ClientHello(PROTOCOL_VERSION, "s" * 40)), "CLIENT_HELLO"),
        "request trickled": (HELLO, request, "no complete request"),
        "ack trickled on a subscription": (HELLO + subscribe, ack + ack, "incomplete frame"),
        "prefix without body, before hello": (prefix, b"", "CLIENT_HELLO"),
        "prefix without body, after hello": (HELLO + prefix, b"", "no complete request"),
        "prefix without body, subscribed": (HELLO + subscribe + prefix, b"", "incomplete frame"),
    }


def test_slowloris_and_bodiless_frames_meet_their_deadlines(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    db = tmp_path / "producer.db"
    timeouts = ["--handshake-timeout", "--idle-timeout", "--frame-timeout"]
    options = [arg for name in timeouts for arg in (name, str(SLOW_TIMEOUT))]
    cases = slowloris_cases()
    with ServerProc(db, *options) as server:
        per_case = 20
        peers = connect(server.address, per_case * len(cases))
        try:
            with Subscriber(server.address) as bystander:
                bystander.receive_until(20)
                started = time.monotonic()
                for i, peer in enumerate(peers):
                    at_once, trickled, _ = cases[list(cases)[i // per_case]]
                    peer.sock.setblocking(True)
                    peer.sock.sendall(at_once)
                    peer.sock.setblocking(False)
                    peer.to_send = trickled
                serve_peers(peers, until=started + 8, trickle=TRICKLE)
                seq = publish_elsewhere(db, b"after the slowloris")
                bystander.receive_until(seq)
        finally:
            close_all(peers)
        assert server.alive(), server.output()
    for i, peer in enumerate(peers):
        name = list(cases)[i // per_case]
        # Closed by its deadline, long before the trickle could have completed a frame.
        assert peer.closed_at is not None, f"{name}: still open"
        assert peer.error is not None and peer.error.code == ErrorCode.IDLE_TIMEOUT, name
        assert cases[name][2] in peer.error.message, (name, peer.error.message)
        assert peer.closed_at - started < 3 * SLOW_TIMEOUT + 2, name
    slowest = max(peer.closed_at or 0 for peer in peers) - started
    figures(
        f"runs 1, faults injected {len(peers)} slow connections ({len(cases)} kinds), "
        f"records checked 1 (by the bystander), anomalies 0; all closed by their deadlines, "
        f"the last {slowest:.1f} s after starting (deadlines {SLOW_TIMEOUT:g} s)"
    )


def test_many_reported_names_do_not_grow_the_server(tmp_path: Path) -> None:
    db = tmp_path / "producer.db"
    names = 5 * MAX_UNREGISTERED
    with ServerProc(db) as server:
        host, port = server.address.rsplit(":", 1)
        requests = b"".join(
            encode(ReportPosition(STREAM, f"reader-{n}", n % 20)) for n in range(names)
        )
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(HELLO + requests)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 20):
                pass
        with streamq.Client(server.address) as client:
            reported = client.status()["positions"]
    assert len(reported) == MAX_UNREGISTERED
    assert {r["consumer"] for r in reported} == {
        f"reader-{n}" for n in range(names - MAX_UNREGISTERED, names)
    }
    assert read_log(db, STREAM) == {n + 1: b"%d" % n for n in range(20)}  # nothing persisted


# --- the producer's disk fills up mid-commit ---------------------------------------


class Disk:
    """A small disk for the producer's database, which the test fills and frees.

    A tmpfs of a few MiB mounted in the test's folder (the tests run as root), filled
    with a file up to ENOSPC. Where mounting is not permitted, SQLite's
    ``PRAGMA max_page_count`` on the producer's writer connection simulates it.
    """

    def __init__(self, path: Path, try_mount: bool) -> None:
        self.path = path
        path.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)]
        self.mounted = try_mount and subprocess.run(mount, capture_output=True).returncode == 0
        self.filler = path / "filler"
        self._page_limit: tuple[Producer, int] | None = None

    async def fill(self, producer: Producer) -> None:
        if not self.mounted:
            conn = producer.storage.writer.conn  # the simulation needs the writer connection itself
            (pages,) = (await conn.execute_fetchall("PRAGMA page_count"))[0]
            (limit,) = (await conn.execute_fetchall("PRAGMA max_page_count"))[0]
            await conn.execute(f"PRAGMA max_page_count = {pages + 1}")
            self._page_limit = (producer, int(limit))
            return
        # Unbuffered, and ENOSPC suppressed around the file too: nothing left to flush at
        # close, where a buffered file would raise it again. Bounded: 64 MiB at most.
        with contextlib.suppress(OSError), self.filler.open("wb", buffering=0) as f:
            for _ in range(1024):
                f.write(b"\0" * 65536)

    async def free(self) -> None:
        if self._page_limit is not None:
            producer, limit = self._page_limit
            await producer.storage.writer.conn.execute(f"PRAGMA max_page_count = {limit}")
            self._page_limit = None
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=True)


@pytest.fixture(params=["tmpfs", "max_page_count"])
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Disk]:
    disk = Disk(tmp_path / "disk", try_mount=request.param == "tmpfs")
    yield disk
    disk.close()


async def test_disk_full_mid_commit(
    tmp_path: Path, disk: Disk, figures: Callable[[str], None]
) -> None:
    pipeline = Pipeline(tmp_path, seed=7, producer_db=disk.path / "producer.db")
    producer = await pipeline.start_producer()
    failures = 0
    try:
        async with Consumer(
            producer.address, STREAM, db=pipeline.consumer_db, name=NAME
        ) as consumer:
            applier = asyncio.create_task(pipeline.apply(consumer))
            try:
                await pipeline.publish(20)
                await disk.fill(producer)
                # Publish until the disk refuses several transactions in a row.
                streak = 0
                for _ in range(400):
                    try:
                        await pipeline.publish(1, size=2000)
                        streak = 0
                    except sqlite3.OperationalError as exc:
                        assert "full" in str(exc), exc
                        failures += 1
                        streak += 1
                        if streak == 5:
                            break
                assert streak == 5, f"the disk never filled ({failures} failures)"
                # Nothing acknowledged that was not committed; the consumer still follows.
                acknowledged = max(pipeline.history.acknowledged)
                assert producer.head(STREAM) == acknowledged
                await wait_for(lambda: consumer.applied == acknowledged, 10, "catch up")

                await disk.free()  # space returns: the producer commits again
                await pipeline.publish(20, size=2000)
                assert producer.head(STREAM) == max(pipeline.history.acknowledged)
                await wait_for(lambda: consumer.applied == producer.head(STREAM), 10, "resume")
            finally:
                applier.cancel()
                await asyncio.gather(applier, return_exceptions=True)
    finally:
        await producer.close()
    report = pipeline.check()
    assert set(pipeline.history.committed) == set(pipeline.history.acknowledged), report
    # A restart finds the same head: what failed was never half-written.
    async with Producer(pipeline.producer_db, serve=False) as reopened:
        assert reopened.head(STREAM) == max(pipeline.history.acknowledged)
    how = "a 4 MiB tmpfs, filled" if disk.mounted else "PRAGMA max_page_count"
    figures(
        f"runs 1, faults injected {failures} (transactions refused, {how}), "
        f"records checked {report.records}, anomalies {report.anomalies}"
    )

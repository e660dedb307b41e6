"""A fault-injecting TCP proxy on loopback, with the toxics of Toxiproxy, in asyncio.

    proxy = FaultProxy("127.0.0.1", producer_port)
    await proxy.start()                      # proxy.address: where the consumer connects
    proxy.toxic = Latency(0.05, jitter=0.02) # applies at once, to every connection
    proxy.toxic = None                       # the fault clears; stalled data flows again

Each proxied connection has two links (``upstream``: client to server, ``downstream``:
server to client); the toxic in force decides what each link does with every chunk it
reads. A toxic with ``direction`` set acts on that link only and forwards the other
untouched. ``stats`` counts what was done, so a test can check that a fault really hit.
Only loopback addresses are accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import socket
import struct
from collections import Counter
from typing import Literal

Direction = Literal["upstream", "downstream"]
_READ = 64 * 1024


class Link:
    """One direction of one proxied connection."""

    def __init__(
        self,
        connection: Connection,
        direction: Direction,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.connection = connection
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.forwarded = 0  # bytes written on
        self.ready_at = 0.0  # Latency: when the previous chunk went out (keeps order)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        self.forwarded += len(data)
        await self.writer.drain()


class Connection:
    """A client connection and its connection to the server."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.writers: list[asyncio.StreamWriter] = []
        self.closed = False

    def reset(self) -> None:
        """Close both sockets with a TCP reset (SO_LINGER 0), as a crashed peer or a firewall."""
        self.closed = True
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    def close(self) -> None:
        self.closed = True
        for writer in self.writers:
            writer.close()


class Toxic:
    """Forwards everything unchanged; subclasses change what one link does."""

    name = "none"

    def __init__(self, direction: Direction | None = None) -> None:
        self.direction = direction

    def applies(self, link: Link) -> bool:
        return self.direction is None or link.direction == self.direction

    async def forward(self, link: Link, data: bytes) -> None:
        await link.send(data)

    async def closing(self, link: Link) -> None:
        """The link's source closed; the proxy closes the connection after this returns."""


class Latency(Toxic):
    """Delays every chunk by ``latency`` plus or minus ``jitter`` seconds, in order."""

    name = "latency"

    def __init__(self, latency: float, jitter: float = 0.0, direction: Direction | None = None):
        super().__init__(direction)
        self.latency, self.jitter = latency, jitter

    async def forward(self, link: Link, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        delay = max(0.0, self.latency + random.uniform(-self.jitter, self.jitter))
        link.ready_at = max(link.ready_at, loop.time() + delay)
        await asyncio.sleep(link.ready_at - loop.time())
        link.connection.proxy.stats["delayed chunks"] += 1
        await link.send(data)


class Bandwidth(Toxic):
    """Caps the rate at ``rate`` bytes per second."""

    name = "bandwidth"

    def __init__(self, rate: int, direction: Direction | None = "downstream") -> None:
        super().__init__(direction)
        self.rate = rate

    async def forward(self, link: Link, data: bytes) -> None:
        piece = max(1, self.rate // 20)  # 20 writes a second
        for i in range(0, len(data), piece):
            chunk = data[i : i + piece]
            await link.send(chunk)
            link.connection.proxy.stats["throttled bytes"] += len(chunk)
            await asyncio.sleep(len(chunk) / self.rate)


class Slicer(Toxic):
    """Forwards every chunk as ``size``-byte pieces, each its own write (and TCP segment)."""

    name = "slicer"

    def __init__(self, size: int = 1, delay: float = 0.0, direction: Direction | None = None):
        super().__init__(direction)
        self.size, self.delay = size, delay

    async def forward(self, link: Link, data: bytes) -> None:
        for i in range(0, len(data), self.size):
            await link.send(data[i : i + self.size])
            link.connection.proxy.stats["slices"] += 1
            await asyncio.sleep(self.delay)


class Stall(Toxic):
    """Holds every byte, silently, with the connections open, until the toxic is removed."""

    name = "stall"

    async def forward(self, link: Link, data: bytes) -> None:
        proxy = link.connection.proxy
        proxy.stats["stalled chunks"] += 1
        while proxy.toxic is self:
            await proxy.changed.wait()
        await link.send(data)


class _AfterBytes(Toxic):
    """Passes ``after`` bytes of a connection, then strikes (mid-frame, typically)."""

    def __init__(self, after: int, direction: Direction | None = "downstream") -> None:
        super().__init__(direction)
        self.after = after

    async def forward(self, link: Link, data: bytes) -> None:
        room = self.after - link.forwarded
        if room > len(data):
            await link.send(data)
            return
        if room > 0:
            await link.send(data[:room])
        self.strike(link.connection)

    def strike(self, connection: Connection) -> None:
        raise NotImplementedError


class ResetPeer(_AfterBytes):
    """Resets both sides of a connection once ``after`` bytes went by."""

    name = "reset"

    def strike(self, connection: Connection) -> None:
        connection.proxy.stats["resets"] += 1
        connection.reset()


class ResetAfterChunk(ResetPeer):
    """Passes each chunk, then resets the connection: on a new connection the producer's
    first chunk is its SERVER_HELLO, so the client learns of the reset between the
    handshake and its next request (a producer killed just after it answered)."""

    name = "reset after a chunk"

    def __init__(self, direction: Direction | None = "downstream") -> None:
        super().__init__(0, direction)

    async def forward(self, link: Link, data: bytes) -> None:
        await link.send(data)
        self.strike(link.connection)


class LimitData(_AfterBytes):
    """Closes a connection (a clean FIN) once ``after`` bytes went by."""

    name = "limit"

    def strike(self, connection: Connection) -> None:
        connection.proxy.stats["limited closes"] += 1
        connection.close()


class SlowClose(Toxic):
    """Delays passing on a close by ``delay`` seconds."""

    name = "slow-close"

    def __init__(self, delay: float, direction: Direction | None = None) -> None:
        super().__init__(direction)
        self.delay = delay

    async def closing(self, link: Link) -> None:
        link.connection.proxy.stats["slow closes"] += 1
        await asyncio.sleep(self.delay)


class FaultProxy:
    """Listens on loopback and relays every connection to ``host:port`` through the toxic."""

    def __init__(self, host: str, port: int) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the fault proxy relays to loopback only, not {host}")
        self.upstream = (host, port)
        self._toxic: Toxic | None = None
        self.changed = asyncio.Event()
        self.stats: Counter[str] = Counter()
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    @property
    def toxic(self) -> Toxic | None:
        return self._toxic

    @toxic.setter
    def toxic(self, toxic: Toxic | None) -> None:
        self._toxic = toxic
        self.changed.set()  # wake what a stall holds
        self.changed = asyncio.Event()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"

    async def close(self) -> None:
        self.toxic = None
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(self)
        connection.writers.append(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        connection.writers.append(up_writer)
        for w in (writer, up_writer):
            with contextlib.suppress(OSError, AttributeError):
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(connection)
        self.stats["connections"] += 1
        links = (
            Link(connection, "upstream", reader, up_writer),
            Link(connection, "downstream", up_reader, writer),
        )
        pumps = [asyncio.create_task(self._pump(link)) for link in links]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            self.connections.discard(connection)
            connection.close()

    async def _pump(self, link: Link) -> None:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            while not link.connection.closed and (data := await link.reader.read(_READ)):
                toxic = self._toxic
                if toxic is not None and toxic.applies(link):
                    await toxic.forward(link, data)
                else:
                    await link.send(data)
            toxic = self._toxic
            if toxic is not None and toxic.applies(link):
                await toxic.closing(link)

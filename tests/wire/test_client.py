"""The blocking client's connections made together (``Client.connect_all``): every
handshake in flight at once, each failure in its place, a silent peer's timeout paid once."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import streamq
from streamq import Client, ConnectionLostError, RemoteProtocolError


@contextlib.contextmanager
def silent_peers(count: int) -> Iterator[list[str]]:
    """Ports whose connections complete in the kernel's backlog and are never answered."""
    with contextlib.ExitStack() as stack:
        addresses = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            addresses.append(f"127.0.0.1:{sock.getsockname()[1]}")
        yield addresses


def test_connect_all_gives_each_address_its_client_or_its_error(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    with (
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
        streamq.SyncProducer(str(tmp_path / "b.db")) as b,
        silent_peers(3) as mute,
    ):
        nothing = f"127.0.0.1:{reserve_port()}"  # nothing listens there
        addresses = [a.address, nothing, *mute, b.address]
        started = time.monotonic()
        made = Client.connect_all(addresses, timeout=1.0, name="test")
        took = time.monotonic() - started
        try:
            first, refused, *unanswered, last = made
            assert isinstance(first, Client) and first.producer_id == a.producer_id
            assert isinstance(last, Client) and last.producer_id == b.producer_id
            assert first.timeout == last.timeout == 1.0  # requests get the whole timeout
            assert first.streams() == last.streams() == []  # and both serve requests
            assert isinstance(refused, ConnectionLostError)
            assert str(refused).startswith(f"cannot connect to producer at {nothing}: ")
            for address, error in zip(mute, unanswered, strict=True):
                assert isinstance(error, ConnectionLostError)
                assert str(error).startswith(
                    f"no SERVER_HELLO from {address} within 1 s: is a streamq producer listening"
                )
            # The three silent peers waited for together: one timeout, not three.
            assert took < 2.5, took
        finally:
            for one in made:
                if isinstance(one, Client):
                    one.close()


def test_connect_all_names_a_peer_that_is_not_a_producer(tmp_path: Path) -> None:
    class Banner(socketserver.BaseRequestHandler):
        def handle(self) -> None:  # a service that speaks first, as SMTP does
            self.request.sendall(b"220 mail.example.com ESMTP ready\r\n")

    with (
        socketserver.ThreadingTCPServer(("127.0.0.1", 0), Banner) as smtp,
        streamq.SyncProducer(str(tmp_path / "a.db")) as a,
    ):
        threading.Thread(target=smtp.serve_forever, daemon=True).start()
        other = f"127.0.0.1:{smtp.server_address[1]}"
        try:
            wrong, right = Client.connect_all([other, a.address], timeout=5.0)
            assert isinstance(right, Client) and right.producer_id == a.producer_id
            right.close()
            assert isinstance(wrong, RemoteProtocolError)
            assert str(wrong).startswith(
                f"the peer at {other} is not a streamq producer: it answered with no SERVER_HELLO"
            )
        finally:
            smtp.shutdown()

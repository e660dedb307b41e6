"""``bench.common.reserved_port``: a loopback port no other process can take while it is
held, on which a server still listens, again after each restart."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from bench.common import reserved_port

# A server as the tests start them (asyncio's, binding with SO_REUSEADDR): it answers one
# connection with its life's number, then exits.
SERVER = """
import asyncio, sys

async def main():
    async def answer(reader, writer):
        writer.write(sys.argv[2].encode())
        await writer.drain()
        writer.close()
        done.set()

    done = asyncio.Event()
    server = await asyncio.start_server(answer, "127.0.0.1", int(sys.argv[1]))
    print("LISTENING", flush=True)
    async with server:
        await done.wait()

asyncio.run(main())
"""


def test_a_reserved_port_is_taken_by_no_other_process_and_refuses_connections() -> None:
    with reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))  # as a server told this port
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        sockets = [socket.socket() for _ in range(500)]
        try:
            for sock in sockets:
                sock.bind(("127.0.0.1", 0))  # the kernel's free ports: never this one
            assert port not in {sock.getsockname()[1] for sock in sockets}
        finally:
            for sock in sockets:
                sock.close()


def test_a_server_in_another_process_listens_on_it_after_each_restart() -> None:
    with reserved_port() as port:
        for life in ("first", "second"):
            with subprocess.Popen(
                [sys.executable, "-c", SERVER, str(port), life],
                stdout=subprocess.PIPE,
                text=True,
            ) as server:
                try:
                    assert server.stdout is not None
                    assert server.stdout.readline() == "LISTENING\n"
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                        assert client.recv(100) == life.encode()
                    assert server.wait(timeout=30) == 0
                finally:
                    server.kill()

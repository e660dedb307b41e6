"""Coverage-guided fuzzing of the frame decoder and both connection state machines (atheris).

    python tests/fuzz_protocol.py [-max_total_time=300] [-rss_limit_mb=512] [CORPUS_DIR]

``make fuzz`` runs it (then a long hypothesis campaign against a real server socket,
tests/protocol/test_hostile_input.py). Each input picks a role (server, client before or after
subscribing, client with a request pending), a frame size limit and a way of cutting
the bytes, and feeds the rest to the connection. Bad input must only ever raise
``RemoteProtocolError``; anything else (an IndexError, a RecursionError, a MemoryError
from a header believed before its length was checked) is a crash atheris reports with the
input that caused it. The decoder must also never buffer more than it was given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from streamq.errors import RemoteProtocolError
    from streamq.protocol import (
        PROTOCOL_VERSION,
        Ack,
        ClientConnection,
        ClientHello,
        Error,
        GetHead,
        GetRange,
        GetStatus,
        Heartbeat,
        ListStreams,
        Record,
        Records,
        ServerConnection,
        ServerHello,
        StatusReport,
        StreamInfo,
        Subscribe,
        Subscribed,
        encode,
    )

_ROLES = ("server", "client", "subscriber", "ranger", "epoch ranger", "requester")


def _connection(role: str, max_frame_size: int) -> ServerConnection | ClientConnection:
    """A connection in the state the role names, ready to receive the fuzzed bytes."""
    if role == "server":
        server = ServerConnection(max_frame_size)
        server.send(ServerHello(PROTOCOL_VERSION, "p" * 32, 1, max_frame_size))
        return server
    client = ClientConnection(max_frame_size)
    client.send(ClientHello(PROTOCOL_VERSION, "fuzz"))
    if role == "subscriber":
        client.send(Subscribe("s", 3, "fuzz", None))
    elif role == "ranger":
        client.send(GetRange("s", 2, 9))
    elif role == "epoch ranger":  # a range that asked for epochs (RANGE_END carries two more)
        client.send(GetRange("s", 2, 9, seen_epoch=3))
    elif role == "requester":
        client.send(GetHead("s"))
        client.send(GetStatus())
    return client


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    role = _ROLES[fdp.ConsumeIntInRange(0, len(_ROLES) - 1)]
    conn = _connection(role, fdp.ConsumeIntInRange(1, 1 << 20))
    conn.raw_records = fdp.ConsumeBool()
    fed = 0
    while fdp.remaining_bytes():
        piece = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 4096))
        conn.receive_data(piece)
        fed += len(piece)
        assert conn.buffered <= fed, "the decoder holds more than it was given"
        try:
            while conn.next_event() is not None:
                pass
        except RemoteProtocolError:
            return  # the peer's fault, reported as such: the expected outcome


def seed_corpus(directory: Path) -> None:
    """Valid frames of every kind, so the fuzzer starts from the protocol's grammar."""
    directory.mkdir(parents=True, exist_ok=True)
    record = Record(3, 1_700_000_000_000, b"k", b"value", {"h": b"v"})
    seeds = {
        # role index, frame-limit bytes, raw flag, then the frames.
        "server": (0, encode(ClientHello(PROTOCOL_VERSION, "c")) + encode(Ack(3))),
        "server-requests": (
            0,
            encode(ClientHello(PROTOCOL_VERSION, "c"))
            + encode(GetHead("s"))
            + encode(ListStreams()),
        ),
        "client": (
            1,
            encode(ServerHello(PROTOCOL_VERSION, "p", 1, 1024)) + encode(Error(5, "x", {})),
        ),
        "subscriber": (
            2,
            encode(ServerHello(PROTOCOL_VERSION, "p", 1, 1024))
            + encode(Subscribed("s", 5, 1))
            + encode(Records((record,)))
            + encode(Heartbeat(5)),
        ),
        "requester": (
            4,
            encode(ServerHello(PROTOCOL_VERSION, "p", 1, 1024))
            + encode(StreamInfo("s", 5, 1))
            + encode(StatusReport({"a": 1})),
        ),
    }
    for name, (role, frames) in seeds.items():
        prefix = bytes([role, 0, 0, 1, 0]) + len(frames).to_bytes(2, "big")
        (directory / name).write_bytes(prefix + frames)


def main() -> None:
    args = sys.argv[1:]
    if not any(not arg.startswith("-") for arg in args):
        corpus = Path(__file__).resolve().parent.parent / ".fuzz-corpus"
        seed_corpus(corpus)
        args.append(str(corpus))
    atheris.Setup([sys.argv[0], *args], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

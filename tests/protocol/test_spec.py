"""docs/protocol.md, read as data and checked against the code, so that neither side can
change alone.

The spec's tables (messages, errors, error cases, connection states) are parsed from the
Markdown. Message numbers and fields are checked through ``decode_message`` (what a peer's
frame must look like), the state tables through the sans-IO connections, and every row
of "Error cases" is provoked on a real producer over loopback, with raw frames, and must
answer with that code and exactly those ``details`` keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import sqlite3
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgpack
import pytest

from streamq import Consumer, Producer, ServerSettings
from streamq.consumer.consumer import heartbeat_timeout
from streamq.errors import (
    ERROR_CLASSES,
    ErrorCode,
    LocalProtocolError,
    RemoteProtocolError,
    UnknownStreamError,
)
from streamq.filters import Filter
from streamq.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Authenticated,
    ClientConnection,
    ClientHello,
    Error,
    FrameDecoder,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    Heartbeat,
    ListStreams,
    Message,
    MessageType,
    RangeEnd,
    Record,
    Records,
    ReportPosition,
    SeekTime,
    ServerConnection,
    ServerHello,
    State,
    StatusReport,
    StreamInfo,
    StreamList,
    Subscribe,
    Subscribed,
    TimePosition,
    WatchHead,
    decode_message,
    encode,
    frame,
)
from streamq.wire.security import TokenAuth, make_token

from ..conftest import wait_for
from ..producer.test_server_errors import HELLO, error_of, exchange

SPEC = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()


# --- Reading the spec ------------------------------------------------------------------


def section(title: str) -> str:
    """The text under the heading ``title`` (any level), up to the next heading."""
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", SPEC + "\n# end", re.M | re.S)
    assert match, f"docs/protocol.md has no section {title!r}"
    return match.group(1)


def table(text: str, first_header: str) -> list[list[str]]:
    """The rows of the Markdown table whose first header cell is ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and cells(line)[0] == first_header:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            return rows
    raise AssertionError(f"no table starting with {first_header!r}")


def cells(line: str) -> list[str]:
    escaped = line.replace("\\|", "\0")
    return [c.strip().replace("\0", "|") for c in escaped.strip().strip("|").split("|")]


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def message_names(text: str) -> set[str]:
    return {name for name in ticked(text) if name in MessageType.__members__}


def state_of(text: str) -> str:
    """The state a state-table cell names ("any" for a row that applies in every state)."""
    names = [name for name in ticked(text) if name in State.__members__]
    return names[0] if names else text.split()[0]


FIELD = re.compile(r"`([a-z_]+): ([^`]+)`")


def spec_fields(cell: str) -> tuple[list[tuple[str, str]], int]:
    """A message table cell's fields as (name, type), and the index of the first optional."""
    found: list[tuple[str, str]] = []
    optional = None
    for match in FIELD.finditer(cell):
        if optional is None and cell[: match.start()].rstrip().endswith("optional"):
            optional = len(found)
        found.append((match.group(1), match.group(2).strip()))
    return found, len(found) if optional is None else optional


MESSAGES = {
    row[1].strip("`"): (int(row[0]), row[2], *spec_fields(row[3]))
    for row in table(section("Messages"), "Type")
}
ERRORS = {row[1].strip("`"): row for row in table(section("Errors"), "Code")}
CASES = [
    (case, message.strip("`"), code.strip("`"), set() if keys == "none" else set(ticked(keys)))
    for case, message, code, keys in table(section("Error cases"), "Case")
]


# --- Messages: numbers, fields, types, order ---------------------------------------------


def test_message_numbers_match() -> None:
    assert {name: spec[0] for name, spec in MESSAGES.items()} == {
        t.name: t.value for t in MessageType
    }


# A distinct well-formed value for each spec type (``i``: the field's position), and one
# of another type.
GOOD: dict[str, Callable[[int], Any]] = {
    "uint": lambda i: 100 + i,
    "uint | nil": lambda i: 100 + i,
    "int": lambda i: -100 - i,
    "str": lambda i: f"f{i}",
    "str | nil": lambda i: f"f{i}",
    "bin": lambda i: b"b%d" % i,
    "map": lambda i: {},
    "array": lambda i: [],
}
WRONG = {"uint": "1", "int": "1", "str": 1, "bin": "b", "map": 1, "array": 1}
# Where the code names a field otherwise than the spec.
ALIASES = {("SEEK_TIME", "timestamp_ms"): "timestamp"}


def code_of(body: bytes) -> ErrorCode:
    with pytest.raises(RemoteProtocolError) as caught:
        decode_message(body)
    return caught.value.code


@pytest.mark.parametrize("name", list(MESSAGES))
def test_message_fields_match(name: str) -> None:
    """Every field the spec lists, in its order, with its type; the optional ones (and
    only those) may be left off; one more field is malformed."""
    number, _, spec, required = MESSAGES[name]
    values = [1 if f == "version" else GOOD[kind](i) for i, (f, kind) in enumerate(spec)]
    decoded = decode_message(msgpack.packb([number, *values], use_bin_type=True))
    names = [f.name for f in fields(decoded)]
    assert names == [ALIASES.get((name, f), f) for f, _ in spec]
    got = [getattr(decoded, f) for f in names]
    got = [v.to_wire() if isinstance(v, Filter) else v for v in got]
    assert got == [() if v == [] else v for v in values]
    for count in range(required, len(spec) + 1):
        decode_message(msgpack.packb([number, *values[:count]], use_bin_type=True))
    too_few = ([number, *values[: required - 1]],) if required else ()
    for wrong in (*too_few, [number, *values, 0]):
        assert code_of(msgpack.packb(wrong, use_bin_type=True)) is ErrorCode.MALFORMED_FRAME
    for i, (field, kind) in enumerate(spec):
        for bad in (WRONG[kind.removesuffix(" | nil")], *(() if "nil" in kind else (None,))):
            body = msgpack.packb([number, *values[:i], bad, *values[i + 1 :]], use_bin_type=True)
            # "Handshake": a hello's first field is its version, checked before the rest.
            expected = (
                ErrorCode.VERSION_MISMATCH if field == "version" else ErrorCode.MALFORMED_FRAME
            )
            assert code_of(body) is expected, (field, bad)


# --- Connection states -------------------------------------------------------------------

SAMPLES: dict[str, Message] = {
    "CLIENT_HELLO": ClientHello(PROTOCOL_VERSION, "c"),
    "SERVER_HELLO": ServerHello(PROTOCOL_VERSION, "p", 1, 1024, 5000),
    "SUBSCRIBE": Subscribe("s", 1, "c", None),
    "SUBSCRIBED": Subscribed("s", 0, 1),
    "RECORDS": Records((Record(1, 0, None, b"v", {}),)),
    "HEARTBEAT": Heartbeat(0),
    "ACK": Ack(0),
    "GET_HEAD": GetHead("s"),
    "STREAM_INFO": StreamInfo("s", 0, 1),
    "GET_RANGE": GetRange("s", 1, 1),
    "RANGE_END": RangeEnd(),
    "LIST_STREAMS": ListStreams(),
    "STREAM_LIST": StreamList(()),
    "GET_STATUS": GetStatus(),
    "STATUS_REPORT": StatusReport({}),
    "ERROR": Error(int(ErrorCode.SHUTTING_DOWN), "bye", {}),
    "REPORT_POSITION": ReportPosition("s", "c", 0),
    "GET_HISTORY": GetHistory("s", b"k", 1, 2),
    "SEEK_TIME": SeekTime("s", 0),
    "TIME_POSITION": TimePosition("s", 1, 0, 1),
    "WATCH_HEAD": WatchHead("s", 0),
    "AUTHENTICATED": Authenticated(None),
}


def test_samples_cover_every_message() -> None:
    assert set(SAMPLES) == set(MESSAGES)


def sent_by(direction: str) -> set[str]:
    return {name for name, spec in MESSAGES.items() if spec[1].startswith(direction)}


def state_table(title: str) -> list[tuple[str, bool, set[str], str]]:
    """(state, conditional, messages, next state) per row; a row is conditional when its
    state cell says more than the state."""
    return [
        (state_of(s), "," in s, message_names(legal), state_of(after))
        for s, legal, after in table(section(title), "State")
    ]


def legal(rows: list[tuple[str, bool, set[str], str]], state: str) -> dict[str, str]:
    """The messages the unconditional rows allow in ``state``, and the state each leads to."""
    return {
        name: after
        for s, conditional, names, after in rows
        if s in (state, "any") and not conditional
        for name in names
    }


def server_receiving_in(state: str) -> ServerConnection:
    conn = ServerConnection()
    if state in ("READY", "STREAMING"):
        conn.receive_data(encode(SAMPLES["CLIENT_HELLO"]))
        assert conn.next_event() is not None
    if state == "STREAMING":
        conn.receive_data(encode(SAMPLES["SUBSCRIBE"]))
        assert conn.next_event() is not None
    assert conn.their_state.name == state
    return conn


@pytest.mark.parametrize("state", ["AWAIT_HELLO", "READY", "STREAMING"])
def test_what_the_server_accepts(state: str) -> None:
    rows = state_table("What the server accepts from the client")
    assert set().union(*(names for _, _, names, _ in rows)) == sent_by("C→S") | {"ERROR"}
    allowed = legal(rows, state)
    for name, message in SAMPLES.items():
        conn = server_receiving_in(state)
        conn.receive_data(encode(message))
        try:
            conn.next_event()
        except RemoteProtocolError as exc:
            assert name not in allowed, f"{name} in {state}: {exc}"
            assert exc.code is ErrorCode.UNEXPECTED_MESSAGE
        else:
            assert name in allowed, f"the server accepts {name} in {state}"
            assert conn.their_state.name == allowed[name]


def server_sending_in(state: str) -> ServerConnection:
    conn = ServerConnection()
    if state == "AUTHENTICATING":
        conn.receive_data(encode(ClientHello(PROTOCOL_VERSION, "c", "billing:token")))
        assert conn.next_event() is not None
        conn.send(SAMPLES["SERVER_HELLO"])
    if state in ("READY", "STREAMING"):
        conn = server_receiving_in("READY")
        conn.send(SAMPLES["SERVER_HELLO"])
    if state == "STREAMING":
        conn.receive_data(encode(SAMPLES["SUBSCRIBE"]))
        conn.next_event()
        conn.send(SAMPLES["SUBSCRIBED"])
    assert conn.our_state.name == state
    return conn


@pytest.mark.parametrize("state", ["AWAIT_HELLO", "AUTHENTICATING", "READY", "STREAMING"])
def test_what_the_server_sends(state: str) -> None:
    rows = state_table("What the server sends")
    assert set().union(*(names for _, _, names, _ in rows)) == sent_by("S→C")
    allowed = legal(rows, state)
    for name in sent_by("S→C"):
        conn = server_sending_in(state)
        try:
            conn.send(SAMPLES[name])
        except LocalProtocolError as exc:
            assert name not in allowed, f"{name} in {state}: {exc}"
        else:
            assert name in allowed, f"the server may send {name} in {state}"
            assert conn.our_state.name == allowed[name]


@pytest.mark.parametrize("state", ["AWAIT_HELLO", "READY", "STREAMING"])
def test_what_the_client_sends(state: str) -> None:
    rows = state_table("What the client sends")
    assert set().union(*(names for _, _, names, _ in rows)) == sent_by("C→S") | {"ERROR"}
    allowed = legal(rows, state)
    for name in sent_by("C→S") | {"ERROR"}:
        conn = ClientConnection()
        for step in {"AWAIT_HELLO": [], "READY": ["CLIENT_HELLO"]}.get(
            state, ["CLIENT_HELLO", "SUBSCRIBE"]
        ):
            conn.send(SAMPLES[step])
        try:
            conn.send(SAMPLES[name])
        except LocalProtocolError as exc:
            assert name not in allowed, f"{name} in {state}: {exc}"
        else:
            assert name in allowed, f"the client may send {name} in {state}"
            assert conn.our_state.name == allowed[name]


# The requests as the client-accepts test sends them: ranges that hold seq 1.
ASKED: dict[str, Message] = {
    "GET_HEAD": GetHead("s"),
    "GET_RANGE": GetRange("s", 1, 5),
    "LIST_STREAMS": ListStreams(),
    "GET_STATUS": GetStatus(),
    "GET_HISTORY": GetHistory("s", b"k", 1, 5),
    "SEEK_TIME": SeekTime("s", 0),
    "REPORT_POSITION": ReportPosition("s", "c", 0),
    "WATCH_HEAD": WatchHead("s", 0),
}
ANSWER = re.compile(r"((?:`[A-Z_]+`(?: \(zero or more\))?(?: then )?)+) for `([A-Z_]+)`")


def client_accepting(situation: str) -> ClientConnection:
    """A client in one of the situations of "What the client accepts from the server"."""
    conn = ClientConnection()
    token = situation == "AUTHENTICATING"
    conn.send(ClientHello(PROTOCOL_VERSION, "c", "billing:token" if token else None))
    if situation == "AWAIT_HELLO":
        return conn
    conn.receive_data(encode(SAMPLES["SERVER_HELLO"]))
    assert conn.next_event() is not None
    if situation in ASKED:
        conn.send(ASKED[situation])
    elif situation in ("SUBSCRIBE", "STREAMING"):
        conn.send(SAMPLES["SUBSCRIBE"])
        if situation == "STREAMING":
            conn.receive_data(encode(SAMPLES["SUBSCRIBED"]))
            assert conn.next_event() is not None
    return conn


def client_accepts() -> dict[str, tuple[set[str], str]]:
    """Per situation, what the table lets the client accept, and the server's next state."""
    accepted: dict[str, tuple[set[str], str]] = {}
    for state_cell, legal_cell, after in table(
        section("What the client accepts from the server"), "State"
    ):
        state = state_of(state_cell)
        if "requests pending" in state_cell:
            for names, request in ANSWER.findall(legal_cell):
                accepted[request] = (message_names(names), state_of(after))
        elif "no request pending" in state_cell:
            accepted["READY"] = (set(), "READY")
        elif "SUBSCRIBE" in state_cell:
            accepted["SUBSCRIBE"] = (message_names(legal_cell), state_of(after))
        elif state != "any":
            accepted[state] = (message_names(legal_cell), state_of(after))
    return accepted


def test_what_the_client_accepts() -> None:
    accepted = client_accepts()
    situations = {"AWAIT_HELLO", "AUTHENTICATING", "READY", "SUBSCRIBE", "STREAMING"}
    assert set(accepted) == situations | set(ASKED)
    for situation, (allowed, after) in accepted.items():
        for name in sent_by("S→C") - {"ERROR"}:
            conn = client_accepting(situation)
            conn.receive_data(encode(SAMPLES[name]))
            try:
                conn.next_event()
            except RemoteProtocolError as exc:
                assert name not in allowed, f"{name} in {situation}: {exc}"
                assert exc.code is ErrorCode.UNEXPECTED_MESSAGE, f"{name} in {situation}: {exc}"
            else:
                assert name in allowed, f"the client accepts {name} in {situation}"
                if name not in ("RECORDS", "HEARTBEAT"):  # an answer's last frame moves it
                    assert conn.their_state.name == after, (situation, name)
        error = client_accepting(situation)
        error.receive_data(encode(SAMPLES["ERROR"]))
        assert isinstance(error.next_event(), Error) and error.their_state is State.CLOSED


# --- Errors: the table, the cases, the sections ------------------------------------------


def detail_keys(cell: str) -> set[str]:
    """The keys a details cell lists: each is written `key` (`type` ...)."""
    return set(re.findall(r"`(\w+)` \(`", cell))


def test_error_codes_and_classes_match() -> None:
    assert {name: int(row[0]) for name, row in ERRORS.items()} == {
        c.name: c.value for c in ErrorCode
    }
    for name, row in ERRORS.items():
        assert row[4].strip("`") == ERROR_CLASSES[ErrorCode[name]].__name__


def test_error_cases_agree_with_the_errors_table() -> None:
    """Each code's details in "Errors" are exactly the keys its cases send; "empty" means
    none at all; and each case's message is one the code's row names."""
    for name, row in ERRORS.items():
        cases = [c for c in CASES if c[2] == name]
        assert cases, f"no case in 'Error cases' for {name}"
        listed = detail_keys(row[3])
        assert set().union(*(keys for *_, keys in cases)) == listed, name
        if row[3].startswith("empty") and "except" not in row[3]:
            assert not listed, name
        for case, message, _, _ in cases:
            if message != "—":
                assert f"`{message}" in row[2], f"{name}'s row does not name {message} ({case})"


@pytest.mark.parametrize(
    "title",
    [
        "GET_HEAD → STREAM_INFO",
        "GET_RANGE → RECORDS* RANGE_END",
        "GET_HISTORY → RECORDS* RANGE_END",
        "SEEK_TIME → TIME_POSITION",
        "REPORT_POSITION → STREAM_INFO",
    ],
)
def test_each_request_section_lists_its_error_cases(title: str) -> None:
    """A request's "Errors:" names the codes of its cases (NOT_AUTHORIZED is every
    request's, "Authorization")."""
    text = section(title)
    match = re.search(r"Errors:(.*?)(?:\n\n|\n- |$)", text, re.S)
    assert match, f"{title} lists no errors"
    named = {c for c in ticked(match.group(1)) if c in ErrorCode.__members__}
    message = title.split()[0]
    cases = {code for _, m, code, _ in CASES if m == message} - {"NOT_AUTHORIZED"}
    assert named == cases


# --- Every case, on a real producer ------------------------------------------------------

Recipe = Callable[[str], Awaitable[Error]]
RECIPES: dict[tuple[str, str], Recipe] = {}
SETTINGS = ServerSettings(max_frame_size=64 * 1024, max_batch_bytes=32 * 1024)
SECRET = b"0123456789abcdef0123456789abcdef"
AUTH = TokenAuth(SECRET, {"billing": ["orders"]}, admins=["ops"])


def recipe(case: str, message: str = "—") -> Callable[[Recipe], Recipe]:
    def register(fn: Recipe) -> Recipe:
        RECIPES[case, message] = fn
        return fn

    return register


@contextlib.asynccontextmanager
async def producer(db: str, settings: ServerSettings = SETTINGS) -> AsyncIterator[Producer]:
    """A producer whose stream "orders" holds seqs 1..20."""
    async with Producer(db, settings=settings) as started:
        with contextlib.suppress(UnknownStreamError):  # a restart: "orders" exists already
            started.head("orders")
            yield started
            return
        async with started.transaction() as tx:
            await tx.publish_many("orders", [b"%d" % n for n in range(20)])
        yield started


async def answer(db: str, data: bytes, settings: ServerSettings = SETTINGS) -> Error:
    async with producer(db, settings) as started:
        return error_of(await exchange(started.address, data))


def simple(case: str, message: str, data: bytes) -> None:
    RECIPES[case, message] = lambda db: answer(db, data)


def raw(*items: Any) -> bytes:
    return frame(msgpack.packb(list(items), use_bin_type=True))


LONG_NAME = "c" * 256
REQUESTS: dict[str, Callable[[str], Message]] = {
    "SUBSCRIBE": lambda stream: Subscribe(stream, 1, "a", None),
    "GET_HEAD": GetHead,
    "GET_RANGE": lambda stream: GetRange(stream, 1, 2),
    "GET_HISTORY": lambda stream: GetHistory(stream, b"k", 1, 2),
    "SEEK_TIME": lambda stream: SeekTime(stream, 0),
    "REPORT_POSITION": lambda stream: ReportPosition(stream, "a", 1),
    "WATCH_HEAD": lambda stream: WatchHead(stream, 0),
}

simple("a frame body that is not valid MessagePack", "—", HELLO + frame(b"\xc1"))
simple("a frame of length 0", "—", HELLO + struct.pack(">I", 0))
simple("an unknown message type", "—", HELLO + raw(99))
simple("a field of the wrong type", "—", HELLO + raw(10, "orders", -1, 5))
simple(
    "an invalid `filter`",
    "SUBSCRIBE",
    HELLO + raw(3, "orders", 1, "a", None, None, {"share": [3, 2]}),
)
simple("an invalid `filter`", "GET_RANGE", HELLO + raw(10, "orders", 1, 5, None, {"t": b""}))
simple(
    "a consumer name over 255 characters",
    "SUBSCRIBE",
    HELLO + encode(Subscribe("orders", 1, LONG_NAME, None)),
)
simple(
    "a consumer name over 255 characters",
    "REPORT_POSITION",
    HELLO + encode(ReportPosition("orders", LONG_NAME, 1)),
)
simple("a frame longer than `max_frame_size`", "—", HELLO + struct.pack(">I", 2**31))
simple("a first frame that is not `CLIENT_HELLO`", "—", encode(GetHead("orders")))
simple("a second hello", "CLIENT_HELLO", HELLO + HELLO)
simple("an `ACK` outside a subscription", "ACK", HELLO + encode(Ack(1)))
simple(
    "a request after `SUBSCRIBE`",
    "—",
    HELLO + encode(Subscribe("orders", 1, "a", None)) + encode(GetHead("orders")),
)
simple("a version other than the integer 1", "CLIENT_HELLO", raw(1, 1.0, "c"))
for name, build in REQUESTS.items():
    simple("an unknown stream", name, HELLO + encode(build("nope")))
simple("`start_seq` 0", "SUBSCRIBE", HELLO + encode(Subscribe("orders", 0, "a", None)))
simple(
    "`start_seq` beyond `head + 1`", "SUBSCRIBE", HELLO + encode(Subscribe("orders", 22, "a", None))
)
simple("`start` 0", "GET_RANGE", HELLO + encode(GetRange("orders", 0, 5)))
simple("`start <= end <= head + 1` fails", "GET_RANGE", HELLO + encode(GetRange("orders", 5, 30)))
simple("`start` 0", "GET_HISTORY", HELLO + encode(GetHistory("orders", b"k", 0, 5)))
simple("another producer's id", "SUBSCRIBE", HELLO + encode(Subscribe("orders", 1, "a", "another")))


async def after_truncation(db: str, data: bytes) -> Error:
    async with producer(db) as started:
        await started.truncate("orders", 8)
        return error_of(await exchange(started.address, data))


@recipe("`start_seq` below `low` (retention)", "SUBSCRIBE")
async def _below_low_subscribe(db: str) -> Error:
    return await after_truncation(db, HELLO + encode(Subscribe("orders", 3, "a", None)))


@recipe("`start` below `low` (retention)", "GET_RANGE")
async def _below_low_range(db: str) -> Error:
    return await after_truncation(db, HELLO + encode(GetRange("orders", 3, 10)))


async def after_rewrite(db: str, data: bytes) -> Error:
    """Seqs 21 and 22 written by a second epoch; the request vouches for epoch 1 up to 29."""
    async with producer(db):
        pass
    async with producer(db) as started:
        async with started.transaction() as tx:
            await tx.publish_many("orders", [b"a", b"b"])
        return error_of(await exchange(started.address, data))


@recipe('`start_seq` beyond `head + 1`, seqs rewritten ("Epochs")', "SUBSCRIBE")
async def _rewritten_subscribe(db: str) -> Error:
    return await after_rewrite(db, HELLO + encode(Subscribe("orders", 30, "a", None, 1)))


@recipe('`start <= end <= head + 1` fails, seqs rewritten ("Epochs")', "GET_RANGE")
async def _rewritten_range(db: str) -> Error:
    return await after_rewrite(db, HELLO + encode(GetRange("orders", 30, 31, 1)))


async def deleted_while_sent(db: str, request: Message) -> Error:
    """A client that stops reading holds the server back a few frames into 64 large
    records; the stream is then truncated past them all, and the client reads on."""
    settings = ServerSettings(write_buffer_high=64 * 1024)
    async with Producer(db, settings=settings) as started:
        async with started.transaction() as tx:
            await tx.publish_many("orders", [bytes(256 * 1024)] * 64)
        server = started.server
        assert server is not None
        host, port = started.address.rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(HELLO + encode(request))
            await wait_for(lambda: "orders" in server.traffic and server.traffic["orders"].records)
            await started.truncate("orders", 64)
            decoder, messages = FrameDecoder(16 * 1024 * 1024), []
            async with asyncio.timeout(30):
                while chunk := await reader.read(1024 * 1024):
                    decoder.feed(chunk)
                    while (body := decoder.next_frame()) is not None:
                        messages.append(decode_message(body))
            assert any(isinstance(m, Records) for m in messages)
            return error_of(messages)
        finally:
            writer.close()


@recipe("the next seq deleted during the subscription", "SUBSCRIBE")
async def _deleted_subscription(db: str) -> Error:
    return await deleted_while_sent(db, Subscribe("orders", 1, "a", None))


@recipe("the next seq deleted while the range is sent", "GET_RANGE")
async def _deleted_range(db: str) -> Error:
    return await deleted_while_sent(db, GetRange("orders", 1, 65))


@recipe("one connection more than `max_connections`")
async def _too_many(db: str) -> Error:
    async with producer(db, ServerSettings(max_connections=1)) as started:
        host, port = started.address.rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        try:
            await wait_for(lambda: started.server is not None and started.server.connections == 1)
            return error_of(await exchange(started.address, HELLO))
        finally:
            writer.close()


@recipe("no complete `CLIENT_HELLO` within `handshake_timeout`")
async def _handshake_timeout(db: str) -> Error:
    return await answer(db, HELLO[:3], ServerSettings(handshake_timeout=0.2))


@recipe("no complete request within `idle_timeout`")
async def _idle_timeout(db: str) -> Error:
    return await answer(db, HELLO, ServerSettings(idle_timeout=0.2))


@recipe("a frame incomplete for `frame_timeout` on a subscription")
async def _frame_timeout(db: str) -> Error:
    data = HELLO + encode(Subscribe("orders", 21, "a", None)) + encode(Ack(1))[:3]
    return await answer(db, data, ServerSettings(frame_timeout=0.2))


@recipe("the producer closes")
async def _shutting_down(db: str) -> Error:
    async with producer(db) as started:
        server = started.server
        assert server is not None
        data = HELLO + encode(Subscribe("orders", 21, "a", None))
        reading = asyncio.create_task(exchange(started.address, data))
        await wait_for(lambda: bool(server.subscriptions))
        await started.close()
        return error_of(await reading)


@recipe("the database fails under a request")
async def _internal_error(db: str) -> Error:
    async with producer(db) as started:
        with contextlib.closing(sqlite3.connect(db)) as other:
            other.execute("ALTER TABLE streamq_time RENAME TO streamq_time_gone")
            other.commit()
        return error_of(await exchange(started.address, HELLO + encode(SeekTime("orders", 0))))


def hello_with(token: str) -> bytes:
    return encode(ClientHello(PROTOCOL_VERSION, "c", token))


AUTH_SETTINGS = ServerSettings(auth=AUTH)
RECIPES["no token, with `auth`", "CLIENT_HELLO"] = lambda db: answer(db, HELLO, AUTH_SETTINGS)
RECIPES["a token not issued with the secret", "CLIENT_HELLO"] = lambda db: answer(
    db, hello_with("billing:" + "0" * 64), AUTH_SETTINGS
)
RECIPES["a token naming a consumer without grants", "CLIENT_HELLO"] = lambda db: answer(
    db, hello_with(make_token(SECRET, "nobody")), AUTH_SETTINGS
)


def as_billing(request: Message) -> Recipe:
    """The request from "billing", which may read "orders" only and is no admin."""
    data = hello_with(make_token(SECRET, "billing")) + encode(request)
    return lambda db: answer(db, data, AUTH_SETTINGS)


for name, build in REQUESTS.items():
    RECIPES["a stream outside the grants", name] = as_billing(build("audit"))
RECIPES["the status report, not an admin", "GET_STATUS"] = as_billing(GetStatus())


def test_every_case_has_a_recipe() -> None:
    assert {(case, message) for case, message, _, _ in CASES} == set(RECIPES)


@pytest.mark.parametrize(
    ("case", "message", "code", "keys"), CASES, ids=[f"{c[2]}: {c[0]} ({c[1]})" for c in CASES]
)
async def test_error_case_on_a_real_producer(
    case: str, message: str, code: str, keys: set[str], producer_db: str
) -> None:
    error = await RECIPES[case, message](producer_db)
    assert (ErrorCode(error.code).name, set(error.details)) == (code, keys), error


# --- "Handshake": the announced heartbeat interval ----------------------------------------


async def test_server_hello_announces_the_heartbeat_interval_when_told_to(
    producer_db: str,
) -> None:
    # A short handshake deadline: ``exchange`` reads until the server closes the socket.
    quiet_settings = ServerSettings(heartbeat_interval=0.5, handshake_timeout=0.5)
    async with producer(producer_db, quiet_settings) as quiet:
        # Off by default: clients that predate the field refuse a 5-field SERVER_HELLO.
        hello = (await exchange(quiet.address, b"", timeout=30))[0]
        assert isinstance(hello, ServerHello)
        first_epoch = hello.epoch
        assert hello == ServerHello(PROTOCOL_VERSION, hello.producer_id, first_epoch, 16 * 1024**2)
        async with Consumer(quiet.address, "orders") as default:
            assert default.subscription.heartbeat_timeout == 30.0
    settings = ServerSettings(
        heartbeat_interval=0.5, announce_heartbeat=True, handshake_timeout=0.5
    )
    async with producer(producer_db, settings) as started:
        hello = (await exchange(started.address, b"", timeout=30))[0]
        assert isinstance(hello, ServerHello)
        # The same database opened again: a later epoch.
        assert hello.epoch > first_epoch
        assert hello == ServerHello(
            PROTOCOL_VERSION, hello.producer_id, hello.epoch, 16 * 1024**2, 500
        )
        async with Consumer(started.address, "orders") as default:
            # 6 intervals, at least 2 s ("Handshake").
            assert default.subscription.heartbeat_timeout == heartbeat_timeout(None, 500) == 3.0
        async with Consumer(started.address, "orders", heartbeat_timeout=0.9) as explicit:
            assert explicit.subscription.heartbeat_timeout == 0.9
    assert heartbeat_timeout(None, None) == 30.0  # a producer that predates the field
    assert heartbeat_timeout(None, 100) == 2.0
    assert heartbeat_timeout(None, 60_000) == 360.0

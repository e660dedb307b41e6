"""Which message may come when: the connection states of both roles as one table.

Split from the events and the codec so the protocol's order rules live in one place
(as h11's ``_state.py``): ``_TRANSITIONS`` says, for each role in each state, what it
may send and where that leads, and ``ClientConnection`` adds what a table cannot say
(answers matched to requests, seqs only moving forward). ``ServerConnection`` and
``ClientConnection`` are what the server, the consumer and the client drive: bytes in,
events out; events in, bytes out. No sockets, no event loop, no database.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import Enum
from typing import Any, ClassVar, cast

from ..errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from .codec import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_ACCEPTED_FRAME_SIZE,
    FrameDecoder,
    decode_message,
    encode,
    malformed,
    records_frame,
)
from .events import (
    RECORDS_MESSAGES,
    Ack,
    Authenticated,
    ClientHello,
    Error,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    Heartbeat,
    ListStreams,
    Message,
    RangeEnd,
    RecordsMessage,
    ReportPosition,
    Request,
    SeekTime,
    ServerHello,
    StatusReport,
    StreamInfo,
    StreamList,
    Subscribe,
    Subscribed,
    TimePosition,
    WatchHead,
    first_and_last_seq,
)

# --- Connection state ("Connection states" in docs/protocol.md) --------------


def lost_seqs(position: int, head: int, rewritten_from: int) -> range | None:
    """The seqs up to ``position`` that the producer's log no longer holds ("Epochs"): those
    beyond its ``head``, and those from ``rewritten_from`` (if not 0) on; None if none."""
    first = rewritten_from or head + 1
    return range(first, position + 1) if 0 < first <= position else None


class State(Enum):
    AWAIT_HELLO = "await hello"
    AUTHENTICATING = "authenticating"  # the server owes AUTHENTICATED: the hello had a token
    READY = "ready"
    STREAMING = "streaming"
    CLOSED = "closed"

    # Members are singletons, so identity hashes them; Enum's own hash is Python code,
    # and every message sent or received looks up a state (a few per request).
    __hash__ = object.__hash__


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"

    __hash__ = object.__hash__  # as State's


# What the client may receive while the oldest request waiting for its answer is of each
# kind; the last message of an answer ends it. SUBSCRIBE is answered by SUBSCRIBED.
_RESPONSES: dict[type[Any], tuple[type[Any], ...]] = {
    Subscribe: (Subscribed,),
    GetHead: (StreamInfo,),
    GetRange: (*RECORDS_MESSAGES, RangeEnd),
    ListStreams: (StreamList,),
    GetStatus: (StatusReport,),
    ReportPosition: (StreamInfo,),
    GetHistory: (*RECORDS_MESSAGES, RangeEnd),
    SeekTime: (TimePosition,),
    WatchHead: (StreamInfo,),
}
_FINAL_RESPONSES = (Subscribed, StreamInfo, RangeEnd, StreamList, StatusReport, TimePosition)
_REQUESTS = tuple(r for r in _RESPONSES if r is not Subscribe)

# "Connection states", in one place: for each role, in each state, the messages that
# role may send and the state each leads to. A message missing from its sender's row is
# out of order. ERROR is legal in every state and closes the connection (``Connection``).
_TRANSITIONS: dict[Role, dict[State, dict[type[Any], State]]] = {
    Role.CLIENT: {
        State.AWAIT_HELLO: {ClientHello: State.READY},
        State.READY: {**dict.fromkeys(_REQUESTS, State.READY), Subscribe: State.STREAMING},
        State.STREAMING: {Ack: State.STREAMING},
    },
    Role.SERVER: {
        State.AWAIT_HELLO: {ServerHello: State.READY},
        State.AUTHENTICATING: {Authenticated: State.READY},
        State.READY: {
            **dict.fromkeys(
                (StreamInfo, *RECORDS_MESSAGES, RangeEnd, StreamList, StatusReport),
                State.READY,
            ),
            TimePosition: State.READY,
            Subscribed: State.STREAMING,
        },
        State.STREAMING: dict.fromkeys((*RECORDS_MESSAGES, Heartbeat), State.STREAMING),
    },
}
# Why a message is out of order, where the list of legal ones would not say it.
_HINTS: dict[tuple[Role, State], str] = {
    (Role.CLIENT, State.STREAMING): "ACK (one subscription per connection)",
    (Role.CLIENT, State.READY): "a request",
    (Role.SERVER, State.AUTHENTICATING): (
        "AUTHENTICATED: it answers a CLIENT_HELLO with a token, before anything else"
    ),
    (Role.SERVER, State.STREAMING): "RECORDS or HEARTBEAT (on a subscription)",
}


class _States:
    """Both roles' states on one connection, moved only by ``_TRANSITIONS``; ERROR closes.

    "Authentication": a CLIENT_HELLO with a token puts the server in AUTHENTICATING as
    soon as it has sent SERVER_HELLO, whichever of the two hellos came first.
    """

    def __init__(self) -> None:
        self.of = {Role.CLIENT: State.AWAIT_HELLO, Role.SERVER: State.AWAIT_HELLO}
        self._token = False  # a hello with a token, not yet answered

    def next_state(self, role: Role, message: Message) -> State | None:
        """Where ``role`` goes by sending ``message`` now; None if it may not."""
        return _TRANSITIONS[role].get(self.of[role], {}).get(type(message))

    def move(self, role: Role, message: Message, state: State) -> None:
        self.of[role] = state
        if isinstance(message, ClientHello) and message.token is not None:
            self._token = True
        if self._token and self.of[Role.SERVER] is State.READY:
            self.of[Role.SERVER] = State.AUTHENTICATING
            self._token = False

    def expected(self, role: Role) -> str:
        """What ``role`` may send now, for error messages."""
        state = self.of[role]
        hint = _HINTS.get((role, state))
        if hint is not None:
            return hint
        names = dict.fromkeys(cls.TYPE.name for cls in _TRANSITIONS[role].get(state, {}))
        return " or ".join(names) or "nothing"

    def close(self, *roles: Role) -> None:
        for role in roles:
            self.of[role] = State.CLOSED


class Connection:
    """One side of a connection: the frame decoder and both roles' states."""

    our_role: ClassVar[Role]
    their_role: ClassVar[Role]

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._decoder = FrameDecoder(max_frame_size)
        self.raw_records = False  # RECORDS as RecordRows (see there), e.g. for Arrow
        self.columnar_records = False  # and as RecordColumns where the compiled path runs
        self._states = _States()
        self.received = 0  # bytes fed to receive_data so far

    @property
    def our_state(self) -> State:
        return self._states.of[self.our_role]

    @property
    def their_state(self) -> State:
        return self._states.of[self.their_role]

    def receive_data(self, data: bytes | memoryview) -> None:
        self._decoder.feed(data)
        self.received += len(data)

    @property
    def buffered(self) -> int:
        return self._decoder.buffered

    def next_event(self) -> Message | None:
        """The next message from the peer, or None if more data is needed."""
        if self.their_state is State.CLOSED:
            return None
        message = self._next_message()
        return None if message is None else self._accept(message)

    def _next_message(self) -> Message | None:
        """The next whole frame's message, decoded but not yet checked against the states;
        None until one has arrived."""
        body = self._decoder.next_frame()
        if body is None:
            return None
        return decode_message(body, raw_records=self.raw_records, columnar=self.columnar_records)

    def _accept(self, message: Message) -> Message:
        """``message`` from the peer, checked against both roles' states and moved on."""
        if isinstance(message, Error):
            # "Errors": the last frame on a connection, for both directions.
            self._states.close(Role.CLIENT, Role.SERVER)
            return message
        state = self._states.next_state(self.their_role, message)
        if state is None:
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name} while {self.their_state.value}: "
                f"expected {self._states.expected(self.their_role)}",
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        self._check_received(message)
        self._states.move(self.their_role, message, state)
        return message

    def send(self, message: Message) -> bytes:
        """The bytes for ``message``; raises ``LocalProtocolError`` if it is out of order."""
        if self.our_state is State.CLOSED:
            raise LocalProtocolError(f"cannot send {message.TYPE.name}: connection closed")
        if isinstance(message, Error):
            self._states.close(self.our_role)
            return encode(message)
        state = self._states.next_state(self.our_role, message)
        if state is None:
            raise LocalProtocolError(
                f"cannot send {message.TYPE.name} while {self.our_state.value}: "
                f"expected {self._states.expected(self.our_role)}"
            )
        self._check_sent(message)
        self._states.move(self.our_role, message, state)
        return encode(message)

    def _check_received(self, message: Message) -> None:
        """What the table cannot say about a message it allows (a role's own rules)."""

    def _check_sent(self, message: Message) -> None:
        """As ``_check_received``, for what this side sends."""


class ServerConnection(Connection):
    """The producer's side of one connection."""

    our_role = Role.SERVER
    their_role = Role.CLIENT

    def send_records(
        self,
        encoded_records: Sequence[bytes],
        epoch: int | None = None,
        through: int | None = None,
        count: int | None = None,
    ) -> bytes:
        """A RECORDS frame from stored record encodings (the hot path: no table lookup,
        RECORDS leaves the server's state as it is); ``count`` as ``records_frame``'s."""
        if self.our_state not in (State.READY, State.STREAMING):
            raise LocalProtocolError(f"cannot send RECORDS while {self.our_state.value}")
        return records_frame(encoded_records, epoch, through, count)


class ClientConnection(Connection):
    """A consumer's or client's side of one connection.

    Tracks the requests in flight so every response is checked against what
    was asked, and checks that a subscription's records only move forward.
    """

    our_role = Role.CLIENT
    their_role = Role.SERVER

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(max_frame_size)
        self._pending: deque[Request] = deque()  # answers owed, oldest first
        self._subscription: Subscribe | None = None
        self.last_seq = 0

    @property
    def answering(self) -> Request | None:
        """The oldest request still waiting for (the rest of) its answer."""
        return self._pending[0] if self._pending else None

    @property
    def owed(self) -> int:
        """How many requests still wait for (the rest of) their answers."""
        return len(self._pending)

    def next_event(self) -> Message | None:
        """As ``Connection.next_event``; a subscription's RECORDS, the consumer's hot path,
        go by their one check (``_check_pushed``): the table keeps the producer streaming."""
        if self._states.of[Role.SERVER] is not State.STREAMING:
            return super().next_event()
        message = self._next_message()
        if message is None:
            return None
        if type(message) in RECORDS_MESSAGES:
            self._check_pushed(cast(RecordsMessage, message))
            return message
        return self._accept(message)

    def _check_sent(self, message: Message) -> None:
        if isinstance(message, Subscribe):
            if self._pending:
                raise LocalProtocolError("SUBSCRIBE while requests are still pending")
            self._subscription = message
            self.last_seq = max(0, message.start_seq - 1)
        if type(message) in _RESPONSES:
            self._pending.append(cast(Request, message))

    def _check_received(self, message: Message) -> None:
        if isinstance(message, ServerHello):
            # "Limits": accept frames as large as the producer may send.
            decoder = self._decoder
            decoder.max_frame_size = max(
                decoder.max_frame_size, min(message.max_frame_size, MAX_ACCEPTED_FRAME_SIZE)
            )
        elif self.their_state is State.STREAMING:
            if isinstance(message, RECORDS_MESSAGES):
                self._check_pushed(message)
        elif not isinstance(message, Authenticated):
            self._check_answer(message)

    def _check_answer(self, message: Message) -> None:
        """An answer must be to the oldest request waiting for one, within what it asked."""
        if not self._pending:
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name}: no request pending", ErrorCode.UNEXPECTED_MESSAGE
            )
        request = self._pending[0]
        allowed = _RESPONSES[type(request)]
        if not isinstance(message, allowed):
            raise RemoteProtocolError(
                f"unexpected {message.TYPE.name} while {self.their_state.value}: expected "
                + " or ".join(dict.fromkeys(c.TYPE.name for c in allowed)),  # RECORDS once
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        if isinstance(message, RECORDS_MESSAGES):
            assert isinstance(request, GetRange | GetHistory)
            self._check_range_records(message, request)
        elif isinstance(message, RangeEnd):
            assert isinstance(request, GetRange | GetHistory)
            _check_range_end(message, request, self.last_seq)
        if isinstance(message, _FINAL_RESPONSES):
            self._pending.popleft()
            if not isinstance(message, Subscribed):  # a subscription counts from its start
                self.last_seq = 0

    def _check_range_records(self, message: RecordsMessage, request: GetRange | GetHistory) -> None:
        # "Epochs": a frame carries an epoch if and only if its range asked for epochs.
        if (message.epoch is not None) != _with_epochs(request):
            raise malformed(
                "RECORDS with an epoch in answer to a request that did not ask for epochs"
                if message.epoch is not None
                else "RECORDS without an epoch in answer to a range that asked for epochs"
            )
        # "Filters": a frame carries ``through`` if and only if its range has a filter.
        filtered = isinstance(request, GetRange) and request.filter is not None
        if (message.through is not None) != filtered:
            raise malformed(
                "RECORDS with through in answer to a request without a filter"
                if message.through is not None
                else "RECORDS without through in answer to a range with a filter"
            )
        # A range or a history holds only seqs in [start, end), in increasing order.
        seqs = first_and_last_seq(message)
        if seqs is not None:
            first, last = seqs
            end = request.end
            if not (request.start <= first and last < end and first > self.last_seq):
                raise malformed(f"RECORDS outside the requested range [{request.start}, {end})")
            self.last_seq = last
        if message.through is not None:
            if not self.last_seq <= message.through < request.end or (
                seqs is None and message.through == self.last_seq
            ):
                raise malformed(
                    f"RECORDS.through {message.through} is not after seq {self.last_seq} "
                    f"and within the requested range [{request.start}, {request.end})"
                )
            self.last_seq = message.through

    def _check_pushed(self, message: RecordsMessage) -> None:
        """A subscription's records only move forward, ``through`` with its filter."""
        through = message.through
        filtered = self._subscription is not None and self._subscription.filter is not None
        if (through is not None) != filtered:
            raise malformed(
                "RECORDS without through on a subscription with a filter"
                if filtered
                else "RECORDS with through on a subscription without a filter"
            )
        seqs = first_and_last_seq(message)
        if seqs is not None:
            if seqs[0] <= self.last_seq:
                raise malformed(f"RECORDS went backwards: seq {seqs[0]} after {self.last_seq}")
            self.last_seq = seqs[1]
        if through is not None:
            if through < self.last_seq or (seqs is None and through == self.last_seq):
                raise malformed(f"RECORDS.through went backwards: {through}")
            self.last_seq = through


def _with_epochs(request: GetRange | GetHistory) -> bool:
    return isinstance(request, GetRange) and request.seen_epoch is not None


def _check_range_end(message: RangeEnd, request: GetRange | GetHistory, last_seq: int) -> None:
    """Per "Epochs", RANGE_END carries the vouch if and only if the range asked for epochs; a
    range whose seqs up to ``start - 1`` were rewritten is answered by RANGE_END alone."""
    if not _with_epochs(request):
        if message.after_epoch is not None or message.rewritten_from is not None:
            raise malformed("RANGE_END with epochs for a request that did not ask for epochs")
        return
    rewritten = message.rewritten_from
    if message.after_epoch is None or rewritten is None:
        raise malformed("RANGE_END of a range with epochs needs after_epoch and rewritten_from")
    if rewritten and last_seq:
        raise malformed(f"RANGE_END.rewritten_from {rewritten} after RECORDS")
    if rewritten and rewritten >= request.start:
        raise malformed(
            f"RANGE_END.rewritten_from {rewritten} is not before the range's start {request.start}"
        )

"""Driver-side planning: where the producers are, which seqs each micro-batch reads, and how
the work splits into partitions.

Offsets are JSON maps ``{producer id: next seq}``; a streaming query's offsets add
``"epochs": {producer id: epoch}`` beside them (docs/protocol.md, "Epochs"): what lets a
producer say whether it still holds the seqs the query read as the query read them.
Everything here is plain Python; the only I/O is the blocking ``streamq.Client``, a few
short requests per producer: pipelined to every producer at once from one thread for
discovery (``_ask_all``), in parallel threads elsewhere. Between a streaming query's
triggers each kept connection watches its producer's head (``_Watch``), so a trigger asks
only the producers whose head moved.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import math
import select
import time
from collections.abc import (
    Callable,
    Collection,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from streamq import (
    Client,
    ClientTLS,
    ConnectionLostError,
    OffsetOutOfRangeError,
    StreamQError,
    UnknownStreamError,
)
from streamq.errors import (
    IdleTimeoutError,
    MalformedFrameError,
    ShuttingDownError,
    TooManyConnectionsError,
)
from streamq.protocol import (
    GetHead,
    ListStreams,
    Message,
    RangeEnd,
    ReportPosition,
    StreamInfo,
    StreamList,
    WatchHead,
    lost_seqs,
)
from streamq.wire.client import (
    Parallel,
    answers_ready,
    vouch_answer,
    vouch_request,
    watch_request,
)
from streamq.wire.endpoints import ProviderError, listed_endpoints

Offsets = dict[str, int]

logger = logging.getLogger("spark_source")

T = TypeVar("T")
U = TypeVar("U")

EARLIEST, LATEST = -2, -1  # in JSON offsets, as in Spark's Kafka source
# The key of a streaming offset that holds the epochs beside the seqs: never a producer id
# of the reference producer (32 hexadecimal digits).
EPOCHS = "epochs"


class StreamQSourceError(Exception):
    """A streamq source cannot go on; the message says which producer and why."""


@dataclass(frozen=True, slots=True)
class Connect:
    """How the driver and executors reach producers. Plain data: it is pickled into every
    partition, so certificate files (``tls``) must exist on the executors too."""

    timeout: float = 30.0  # per request, connect included
    tls: ClientTLS | None = None
    token: str | None = None
    # How long a trigger waits for a producer the query already reads to answer a round
    # of questions (or to connect) before it plans without its new records (``_Down``).
    patience: float = 2.0
    # How long a planned range's read tries again a producer it cannot reach (restarting
    # since the batch was planned) before its task fails: Spark's ``spark.network.timeout``.
    unreachable: float = 120.0

    def client(self, endpoint: str, name: str, timeout: float | None = None) -> Client:
        """A connection to ``endpoint``; ``timeout``, if given, for the connect and hello
        only (then each request has ``self.timeout``)."""
        client = Client(
            endpoint,
            timeout=self.timeout if timeout is None else timeout,
            name=name,
            tls=self.tls,
            token=self.token,
        )
        if timeout is not None:
            client.timeout = self.timeout
        return client

    def clients(
        self,
        endpoints: Sequence[str],
        name: str,
        hurried: Collection[str] = (),
        parallel: Parallel | None = None,
    ) -> list[Client | StreamQError]:
        """A connection to each of ``endpoints`` (one each, an endpoint listed twice
        included), their handshakes together (``Client.connect_all``, its connects mapped
        by ``parallel``): ``hurried`` ones within ``patience``, the others within
        ``timeout``."""
        made: list[Client | StreamQError | None] = [None] * len(endpoints)
        for timeout in (self.patience, self.timeout):
            group = [
                i for i, e in enumerate(endpoints) if (e in hurried) == (timeout == self.patience)
            ]
            if not group:
                continue
            found = Client.connect_all(
                [endpoints[i] for i in group],
                timeout=timeout,
                name=name,
                tls=self.tls,
                token=self.token,
                parallel=parallel,
            )
            for i, client in zip(group, found, strict=True):
                if isinstance(client, Client):
                    client.timeout = self.timeout
                made[i] = client
        return [client for client in made if client is not None]


@dataclass(frozen=True, slots=True)
class ProducerState:
    producer_id: str
    endpoint: str
    head: int  # last committed seq
    low: int  # first seq still held
    # Asked for a streaming query only ("Epochs"): the epoch that wrote the head (None: not
    # asked, or a producer that predates epochs), and the seqs up to the query's position
    # that the producer's log no longer holds as the query read them (None: none).
    epoch: int | None = None
    lost: range | None = None
    # Why a producer the query already reads could not be asked this trigger (it is down,
    # restarting, or too slow to answer): its state is the last one known, and the query
    # reads nothing of it until it is back (``discover``'s ``known``).
    down: str | None = None


@dataclass(frozen=True, slots=True)
class Position:
    """Where a streaming query stands with one producer: the next seq it reads, and the
    epoch stored beside it (the highest that wrote what it read; None if its offset has
    none, as one an older version wrote)."""

    seq: int
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class BatchEpochs:
    """What a micro-batch knows of one producer's epochs, handed to its partitions: the seq
    the batch starts at with the epoch stored beside it (None: none), and the epoch that
    wrote the producer's head when the batch was planned, at least that of every seq the
    batch reads (epochs never decrease along a stream)."""

    start: int
    start_epoch: int | None
    end_epoch: int


def split_offset(offset: Mapping[str, Any]) -> tuple[Offsets, dict[str, int]]:
    """A streaming offset's seqs and epochs (none in an offset an older version wrote)."""
    seqs = {pid: seq for pid, seq in offset.items() if pid != EPOCHS}
    epochs = offset.get(EPOCHS) or {}
    if not all(isinstance(v, int) for v in seqs.values()) or not isinstance(epochs, dict):
        raise StreamQSourceError(f"not a streamq offset: {offset!r}")
    return seqs, {pid: int(e) for pid, e in epochs.items() if pid in seqs}


def join_offset(seqs: Mapping[str, int], epochs: Mapping[str, int]) -> dict[str, Any]:
    """The offset JSON for ``seqs`` with their ``epochs`` beside them. Keys are sorted: Spark
    compares offsets as JSON text, so the same position must always be the same text."""
    offset: dict[str, Any] = {pid: seqs[pid] for pid in sorted(seqs)}
    kept = {pid: epochs[pid] for pid in sorted(epochs) if pid in seqs}
    if kept:
        offset[EPOCHS] = kept
    return offset


@dataclass(frozen=True, slots=True)
class Range:
    """Seqs ``start <= seq < end`` of one producer's stream."""

    producer_id: str
    endpoint: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def parse_endpoints(
    endpoints: str | None, endpoints_file: str | None, provider: str | None = None
) -> list[str]:
    """Endpoints from the options ``endpoints`` (comma-separated), ``endpointsFile`` (one
    per line, # comments) and ``endpointsProvider`` (``module:function`` returning
    host:port strings, e.g. from a service registry): ``streamq.wire.endpoints``.

    The source calls this at every trigger, so producers added to the file or the registry
    join a running query.
    """
    try:
        found = listed_endpoints(endpoints, endpoints_file, provider)
    except ProviderError as exc:
        raise StreamQSourceError(f"endpointsProvider {exc}") from exc
    except ValueError as exc:
        raise StreamQSourceError(f"endpoints: {exc}") from None
    if not found:
        raise StreamQSourceError(
            "set option 'endpoints' (host:port,...), 'endpointsFile' or 'endpointsProvider'"
        )
    return found


# How a kept connection may have ended between triggers: the producer stopped (it says so on
# its open connections), closed it after its idle timeout, or is gone.
_CLOSED_WHILE_KEPT = (ConnectionLostError, ShuttingDownError, IdleTimeoutError)


class Connections:
    """The driver's connections to producers, one per endpoint, kept open across triggers:
    a trigger then costs each producer a round trip or two, not a connect, a hello (and a
    TLS handshake) and a close. Each is used by one thread at a time. A kept connection
    found closed (the producer restarted, or closed it after its idle timeout) is made
    anew, once; one whose request failed is closed (an ERROR ends a connection)."""

    def __init__(self, connect: Connect, name: str = "spark driver") -> None:
        self.connect = connect
        self.name = name  # the client name connections say in their hello
        self._open: dict[str, Client] = {}
        self._pool: ThreadPoolExecutor | None = None
        # Streaming discovery's: kept connections that watch their producer's head, and
        # producers that refused WATCH_HEAD (older versions: MALFORMED_FRAME).
        self.watches: dict[str, _Watch] = {}
        self.unwatchable: set[str] = set()
        # Producers found down: when to try again, and the wait after that (``_Down``).
        self.retry: dict[str, tuple[float, float]] = {}
        # Producers too slow to answer a trigger: the connection owing their answers.
        self.late: dict[str, _Late] = {}
        # The watching connections, registered once as each watch is sent, so that an idle
        # trigger is one epoll that names the few that answered (``answered``), at a cost
        # in what is ready, not in how many are watched: a file descriptor's endpoint, and
        # those whose answer was already in the client's buffer as the watch was sent (a
        # poll misses it).
        self._poller = select.epoll()
        self._polled: dict[int, str] = {}
        self._buffered: set[str] = set()
        # When the last streaming discovery found every producer's watch quiet: the time
        # the first of those watches stops being believed (``_quiet``); else None.
        self.still: float | None = None

    def peek(self, endpoint: str) -> Client | None:
        """The endpoint's kept connection, left kept (to look at, not to use)."""
        return self._open.get(endpoint)

    def take(self, endpoint: str) -> Client | None:
        """The endpoint's kept connection, for the caller alone until it ``keep``s it."""
        return self._open.pop(endpoint, None)

    def keep(self, endpoint: str, client: Client) -> None:
        self._open[endpoint] = client

    def ask(self, endpoint: str, request: Callable[[Client], T]) -> T:
        """``request(client)`` on the endpoint's connection."""
        client = self._open.pop(endpoint, None)
        if client is not None:
            try:
                return self._kept(endpoint, client, request)
            except _CLOSED_WHILE_KEPT:
                pass  # once more, on a new connection
        return self._kept(endpoint, self.connect.client(endpoint, self.name), request)

    def _kept(self, endpoint: str, client: Client, request: Callable[[Client], T]) -> T:
        try:
            result = request(client)
        except BaseException:
            client.close()
            raise
        self._open[endpoint] = client
        return result

    def poll_watch(self, endpoint: str, client: Client) -> None:
        """``client`` has just sent the endpoint's watch: ``answered`` will name it once
        there is something to read."""
        fd = client.fileno()
        try:
            self._poller.register(fd, select.EPOLLIN)
        except FileExistsError:  # watched again on the same connection
            self._poller.modify(fd, select.EPOLLIN)
        else:
            client.keep_alive(*KEEP_ALIVE)
        self._polled[fd] = endpoint
        if client.answer_ready:
            self._buffered.add(endpoint)

    def answered(self) -> set[str]:
        """The endpoints whose watching connection can be read without waiting (an answer,
        an ERROR, or its end), in one poll that does not wait. Any doubt names one: it is
        then asked, as it would be without watches. A file descriptor no longer its
        endpoint's kept connection's leaves the poll (a closed one leaves by itself)."""
        ready, self._buffered = self._buffered, set()
        for fd, _ in self._poller.poll(0):
            endpoint = self._polled.get(fd)
            client = None if endpoint is None else self.peek(endpoint)
            if endpoint is not None:
                ready.add(endpoint)
            if client is None or client.fileno() != fd:
                with contextlib.suppress(OSError):
                    self._poller.unregister(fd)
                self._polled.pop(fd, None)
        return ready

    def map(self, function: Callable[[U], T], items: Sequence[U]) -> list[T]:
        """``function`` over ``items`` in parallel (up to 32 threads, kept as well)."""
        if len(items) <= 1:
            return [function(item) for item in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="streamq")
        return list(self._pool.map(function, items))

    def close(self) -> None:
        for client in [*self._open.values(), *(late.client for late in self.late.values())]:
            client.close()
        self._open.clear()
        self.watches.clear()
        self.late.clear()
        self._poller.close()
        self._poller, self._polled, self._buffered = select.epoll(), {}, set()
        self.still = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __del__(self) -> None:
        """Closed with whatever dropped them (a reader Spark never stopped, say)."""
        self.close()


def _via(via: Connect | Connections) -> tuple[Connections, Callable[[], None]]:
    """Kept connections, or connections for one call (closed by the returned function)."""
    if isinstance(via, Connections):
        return via, lambda: None
    connections = Connections(via)
    return connections, connections.close


@dataclass(frozen=True, slots=True)
class _Missing:
    """A producer without the stream asked for, and the streams it has (those the query's
    token may read): reading it as empty would be a silent wrong answer (a misspelt name)."""

    endpoint: str
    streams: list[str]


# What discovery asks one producer, a round at a time (sans-IO): the probe yields a
# round's requests and is sent back their answers, in order; an ERROR's exception stands
# in for its answer, and ends the list (the producer answers nothing after it).
Answers = list["Message | StreamQError"]
Probe = Generator[list[Message], Answers, "ProducerState | _Missing"]


def _never(producer_id: str) -> None:
    return None


@dataclass
class Reports:
    """Positions a streaming query reports to its producers (``{producer id: last seq its
    sink holds}``, advisory: retention and lag), sent with discovery's first questions on
    the same connections, or with a new watch to a producer not asked (``_unchanged``);
    ``sent`` names those the producers answered or were sent without a wait for answers.

    ``again``: a position the producer heard long enough ago to hear again, told only
    with a request sent anyway (questions, a watch renewed at its wait's end), so that a
    query idle at the head stays heard of at no write of its own."""

    consumer: str
    seqs: Mapping[str, int]
    again: Callable[[str], int | None] = _never
    sent: set[str] = field(default_factory=set)
    told: int = 0  # of them sent with a new watch (``_unchanged``)

    def held(self, producer_id: str, anyway: bool) -> int | None:
        """The position to tell the producer, if any: with requests sent ``anyway``, also
        one it heard long enough ago."""
        held = self.seqs.get(producer_id)
        return self.again(producer_id) if held is None and anyway else held


# Reports a trigger sends with new watches at most: the others wait for a later trigger
# (they are advisory), so that the trigger after a batch over a thousand producers does not
# write to every one of them (0.5 to 1 ms a write with the producers on the same cores: at
# 64, the idle triggers after a batch over 1,024 producers took up to 63 ms).
TOLD_PER_TRIGGER = 32


def _probe(
    endpoint: str,
    producer_id: str,
    stream: str,
    positions: Mapping[str, Position] | None,
    reports: Reports | None = None,
    watch: bool = True,
) -> Probe:
    """The questions for one producer: its head and low; for a streaming query
    (``positions``) also the epoch that wrote the head and the seqs up to the query's
    position that the producer's log no longer holds as the query read them ("Epochs").
    An idle trigger (nothing new since the query's position) takes one round. A report
    in ``reports`` goes last in the first round. A second round also has the connection
    watch the head it found (WATCH_HEAD, left unanswered: ``_Watch``)."""
    position = None if positions is None else positions.get(producer_id)
    seq, seen = (0, 0) if position is None else (position.seq, position.epoch or 0)
    if seq <= 1:
        seen = 0  # nothing read yet: nothing to vouch for
    first: list[Message] = [GetHead(stream)]
    if seen:
        first.append(vouch_request(stream, seq - 1, seen))
    held = None if reports is None else reports.held(producer_id, anyway=True)
    if reports is not None and held is not None:
        first.append(ReportPosition(stream, reports.consumer, held))
    answers = yield first
    if reports is not None and held is not None and len(answers) == len(first):
        if isinstance(answers[-1], StreamQError):  # it ended the connection: no harm done
            logger.warning("could not report position to %s: %s", endpoint, answers[-1])
        else:
            reports.sent.add(producer_id)
    if isinstance(answers[0], UnknownStreamError):
        listed = _answer((yield [ListStreams()])[0], StreamList)
        return _Missing(endpoint, sorted(info.stream for info in listed.streams))
    info = _answer(answers[0], StreamInfo)
    head = info.head
    if positions is None:
        return ProducerState(producer_id, endpoint, head, info.low)
    lost = lost_seqs(seq - 1, head, 0)
    if seen:
        check = answers[1]
        if isinstance(check, OffsetOutOfRangeError):  # beyond the head, or before low
            now = int(check.details.get("head", head))
            lost = lost_seqs(seq - 1, now, int(check.details.get("rewritten_from", 0)))
        elif isinstance(check, MalformedFrameError):  # a producer that predates epochs
            return ProducerState(producer_id, endpoint, head, info.low, None, lost)
        else:
            vouch = vouch_answer(_answer(check, RangeEnd))
            lost = lost_seqs(seq - 1, seq - 1, vouch.rewritten_from)
            if seq - 1 == head:  # nothing new: the position's epoch is the head's
                return ProducerState(producer_id, endpoint, head, info.low, vouch.after_epoch, lost)
    last: list[Message] = [vouch_request(stream, head)]
    if watch:
        last.append(watch_request(stream, head, WATCH_WAIT))
    at_head = (yield last)[0]
    if isinstance(at_head, MalformedFrameError):
        return ProducerState(producer_id, endpoint, head, info.low, None, lost)
    epoch = vouch_answer(_answer(at_head, RangeEnd)).after_epoch
    return ProducerState(producer_id, endpoint, head, info.low, epoch, lost)


M = TypeVar("M", bound=Message)


def _answer(answer: Message | StreamQError, kind: type[M]) -> M:
    """``answer``, raised if it is an error."""
    if isinstance(answer, StreamQError):
        raise answer
    assert isinstance(answer, kind), answer
    return answer


@dataclass
class _Asking:
    """One producer's probe under way: on which connection, and the round it asks now."""

    endpoint: str
    client: Client
    probe: Probe
    requests: list[Message]
    kept: bool  # on a connection kept from earlier (it may have been closed meanwhile)
    answered: bool = False  # a round of it has been answered

    @property
    def restartable(self) -> bool:
        """Found closed now, it starts over once on a new connection: a kept one may
        have been closed meanwhile (a restart, the idle timeout), before any answer."""
        return self.kept and not self.answered


def _ask_all(
    connections: Connections,
    endpoints: Sequence[str],
    stream: str,
    positions: Mapping[str, Position] | None,
    reports: Reports | None = None,
    known: Mapping[str, ProducerState] | None = None,
) -> list[ProducerState | _Missing]:
    """Every producer's probe at once, from this thread: a round's requests go to every
    producer before any answer is read, so a round costs about the slowest producer's
    answer, not the sum of all (and no thread per producer fights for the GIL). Missing
    connections are made first, in parallel; all are kept for the next trigger. With
    ``positions`` (streaming), a producer whose watch says its head has not moved is not
    asked at all (``_unchanged``), and every connection asked is left watching.

    ``reports`` go only on connections kept from the last discovery: that one vouched
    for the query's position, and a producer that lost commits since has restarted,
    ending the connection. Sent to it then, a report could claim seqs it no longer holds
    as applied, for its retention to delete before the query reads them again.

    ``known``: the states of producers the query already reads, by endpoint: one of them
    that cannot be reached, or does not answer within ``Connect.patience``, is its known
    state, ``down`` (``_Down``), not a failure and not a wait for the whole trigger."""

    def start(endpoint: str, client: Client, kept: bool) -> _Asking:
        report = reports if kept else None
        watch = endpoint not in connections.unwatchable
        probe = _probe(endpoint, client.producer_id, stream, positions, report, watch)
        return _Asking(endpoint, client, probe, next(probe), kept)

    def begin(endpoint: str, client: Client | StreamQError) -> _Asking | StreamQSourceError:
        try:
            with _about(endpoint):
                if isinstance(client, StreamQError):
                    raise client
                return start(endpoint, client, False)
        except StreamQSourceError as error:
            return error

    results: dict[str, ProducerState | _Missing] = {}
    down = _Down(connections, known or {}, results)
    listed = set(endpoints)
    for endpoint in dict.fromkeys([*connections.late, *connections.retry]):
        if endpoint in listed:  # the others are asked, or answer their watch
            down.waiting(endpoint)
    connections.still = None
    if positions is not None:
        now, answered = time.monotonic(), connections.answered()
        still = _quiet(connections, endpoints, positions, reports, answered, now, results)
    kept = {e: c for e in endpoints if e not in results and (c := connections.take(e)) is not None}
    if positions is not None:
        for endpoint, client in list(kept.items()):
            state = _unchanged(
                connections, endpoint, client, stream, positions, reports, answered, now
            )
            if isinstance(state, _Ended):
                del kept[endpoint]  # a new one, with no report (see above)
            elif state is not None:
                results[endpoint] = state
                connections.keep(endpoint, kept.pop(endpoint))
    asking = {e: start(e, c, True) for e, c in kept.items()}
    new = [e for e in endpoints if e not in kept and e not in results]
    clients = connections.connect.clients(new, connections.name, down.known, connections.map)
    made = [begin(e, client) for e, client in zip(new, clients, strict=True)]
    asking.update((e, one) for e, one in zip(new, made, strict=True) if isinstance(one, _Asking))
    try:
        for endpoint, failed in zip(new, made, strict=True):
            if isinstance(failed, StreamQSourceError) and not down.found(endpoint, failed):
                raise failed  # every connection made is closed below
        while asking:
            for one in list(asking.values()):
                with down.tolerated(one.endpoint, asking):
                    _send_round(connections, one, asking, start)
            answering = down.answering(asking, time.monotonic() + connections.connect.patience)
            for one in list(asking.values()):
                if one.endpoint not in answering:
                    down.late(one, asking)
                    continue
                with down.tolerated(one.endpoint, asking):
                    _read_round(connections, one, asking, start, results)
    finally:
        for one in asking.values():
            one.client.close()
    if positions is not None:
        for endpoint in set(kept) | set(new):
            _watch(connections, endpoint, stream, results[endpoint])
    for endpoint in list(connections.retry):
        result = results.get(endpoint)
        if not isinstance(result, ProducerState) or result.down is None:
            del connections.retry[endpoint]
    if positions is not None:
        connections.still = still
    return [results[e] for e in endpoints]


def _quiet(
    connections: Connections,
    endpoints: Sequence[str],
    positions: Mapping[str, Position],
    reports: Reports | None,
    answered: set[str],
    now: float,
    results: dict[str, ProducerState | _Missing],
) -> float | None:
    """Into ``results``, the state of every producer whose watch is quiet (most of them, in
    an idle trigger over a thousand): its kept connection still waits for the answer and
    has nothing to read, the watch is trusted, the query's position is one it vouched for,
    and no report is due to it (up to what this trigger may tell). One pass of lookups,
    with no connection taken out; the others go through ``_unchanged``.

    Returns, if every producer was quiet, when the first of their watches stops being
    believed: until then, with nothing answered, a trigger at the same position would
    find the same (``Connections.still``); else None."""
    watches = connections.watches
    seqs = {} if reports is None else reports.seqs
    tellable = 0 if reports is None else TOLD_PER_TRIGGER - reports.told
    still = not results
    first = now
    for endpoint in endpoints:
        watch = watches.get(endpoint)
        if watch is None or endpoint in answered or endpoint in results:
            still = False
            continue
        state = watch.state
        position = positions.get(state.producer_id)
        if position is not None and position.seq > state.head + 1:
            still = False
            continue
        if tellable > 0 and state.producer_id in seqs:
            tellable -= 1
            still = False
            continue
        client = connections.peek(endpoint)
        if client is None or client.watching != watch.since or now - watch.since >= WATCH_TRUST:
            still = False
            continue
        results[endpoint] = state
        first = min(first, watch.since)
    return first + WATCH_TRUST if still else None


def tend(
    connections: Connections,
    stream: str,
    positions: Mapping[str, Position],
    reports: Reports,
    states: Mapping[str, ProducerState],
) -> float | None:
    """An idle trigger after one that found every watch quiet (``Connections.still``),
    without a pass over the producers: only the kept connections with something to read
    (a watch answered at its wait's end, the head unchanged; a report's answer) are read
    and watch again, and reports (``states``: where each producer is) go with new watches,
    up to ``TOLD_PER_TRIGGER``. An idle trigger then costs what answered since the last,
    not how many producers are watched, however long the query idles.

    Returns when the first watch stops being believed, as ``still`` is; None when
    discovery must ask: a head moved, a connection ended, a watch is past belief, a
    producer is late or down. Every endpoint read is settled either way (watching again,
    or left for discovery to ask), so nothing answered is lost to the pass that follows."""
    still, now = connections.still, time.monotonic()
    if still is None or now >= still or connections.late or connections.retry:
        return None
    answered = connections.answered()
    told = (states[pid].endpoint for pid in reports.seqs if pid in states)
    asked = False
    for endpoint in dict.fromkeys([*answered, *itertools.islice(told, TOLD_PER_TRIGGER)]):
        client = connections.take(endpoint)
        if client is None:
            asked = True
            continue
        state = _unchanged(connections, endpoint, client, stream, positions, reports, answered, now)
        if isinstance(state, _Ended):
            asked = True
            continue
        connections.keep(endpoint, client)
        asked |= state is None
    if asked:
        connections.still = None
        return None
    first = min((watch.since for watch in connections.watches.values()), default=now)
    connections.still = first + WATCH_TRUST
    return connections.still


# How a producer the query reads may be down: it refuses connections, its machine does
# not answer (a timeout), it is shutting down, or it is at its connection limit: taken as
# down by discovery (``_Down``), tried again by a planned read (``unreachableTimeoutMs``).
UNREACHABLE = (ConnectionLostError, ShuttingDownError, TooManyConnectionsError)
# A producer found down is tried again after this, doubling up to the last.
RETRY_FIRST, RETRY_MOST = 1.0, 30.0


@dataclass
class _Late:
    """A producer's connection left owing the answers to a round it was too slow for."""

    client: Client
    unread: int  # answers still owed, not counting a WATCH_HEAD's
    since: float  # time.monotonic() when the trigger passed it over


@dataclass
class _Down:
    """Producers that a streaming query already reads and that cannot be asked now: each
    is its last known state with ``down`` set, so the query goes on with the others and
    reads it again once it is back, instead of failing or waiting.

    One that cannot be reached (or does not say hello within ``Connect.patience``) is
    tried again ``RETRY_FIRST`` after it was found down, then at doubling intervals up to
    ``RETRY_MOST``: a machine that does not answer costs a trigger that wait only that
    often. One that is connected but does not answer within ``Connect.patience`` (paused,
    overloaded) keeps its connection (``_Late``): a later trigger reads the answers it
    owes once they have come, then asks it again; after ``Connect.timeout`` without them
    it is down."""

    connections: Connections
    known: Mapping[str, ProducerState]
    results: dict[str, ProducerState | _Missing]

    def waiting(self, endpoint: str) -> None:
        """Leave the endpoint out of this trigger if it is down and not due for a retry,
        or still owes the answers of a round it was late for."""
        late = self.connections.late.pop(endpoint, None)
        if late is not None and self._still_late(endpoint, late):
            return
        retry = self.connections.retry.get(endpoint)
        state = self.known.get(endpoint)
        if retry is not None and state is not None and time.monotonic() < retry[0]:
            self._carry(endpoint, state, state.down or "down")

    def _still_late(self, endpoint: str, late: _Late) -> bool:
        """Read what ``late`` owes without waiting; whether it still owes some (and is
        left out of this trigger). Paid up, its connection is kept, to be asked again."""
        client, state = late.client, self.known.get(endpoint)
        try:
            while late.unread and client.answer_ready:
                client.next_answer()
                late.unread -= 1
        except StreamQError:  # it ended the connection: asked on a new one
            return False
        if not late.unread:
            self.connections.keep(endpoint, client)
            return False
        if state is None:  # not a trigger that tolerates its absence: asked anew
            client.close()
            return False
        timeout = self.connections.connect.timeout
        if time.monotonic() - late.since >= timeout:
            client.close()
            self._mark(endpoint, state, f"producer at {endpoint}: no answer in {timeout:g} s")
            return True
        self.connections.late[endpoint] = late
        self._carry(endpoint, state, self._slow(endpoint))
        return True

    def found(self, endpoint: str, error: StreamQSourceError) -> bool:
        """Whether ``error`` says the known producer at ``endpoint`` is down (and noted)."""
        state = self.known.get(endpoint)
        if state is None or not isinstance(error.__cause__, UNREACHABLE):
            return False
        self._mark(endpoint, state, str(error))
        return True

    def _mark(self, endpoint: str, state: ProducerState, why: str) -> None:
        wait = self.connections.retry.get(endpoint, (0.0, RETRY_FIRST / 2))[1] * 2
        wait = min(wait, RETRY_MOST)
        self.connections.retry[endpoint] = (time.monotonic() + wait, wait)
        self._carry(endpoint, state, why)

    def _carry(self, endpoint: str, state: ProducerState, why: str) -> None:
        """The producer's known state carried forward for this trigger, ``down`` for ``why``."""
        self.results[endpoint] = replace(state, down=why, lost=None)

    def answering(self, asking: Mapping[str, _Asking], until: float) -> set[str]:
        """The producers whose round to read now: those that have answered by ``until``
        (``time.monotonic()``), and those the query does not know yet (waited for)."""
        if not any(endpoint in self.known for endpoint in asking):
            return set(asking)
        ready = answers_ready([one.client for one in asking.values()], until)
        answered = {id(client) for client in ready}
        return {e for e, one in asking.items() if id(one.client) in answered or e not in self.known}

    def late(self, one: _Asking, asking: dict[str, _Asking]) -> None:
        """``one``, a known producer that has not answered in time, leaves the trigger."""
        del asking[one.endpoint]
        one.probe.close()
        unread = len(_answered(one.requests))
        self.connections.late[one.endpoint] = _Late(one.client, unread, time.monotonic())
        self._carry(one.endpoint, self.known[one.endpoint], self._slow(one.endpoint))

    def _slow(self, endpoint: str) -> str:
        patience = self.connections.connect.patience
        return f"producer at {endpoint}: no answer within {patience:g} s"

    @contextlib.contextmanager
    def tolerated(self, endpoint: str, asking: dict[str, _Asking]) -> Iterator[None]:
        """A round with the producer at ``endpoint``; if it is down, it leaves ``asking``."""
        try:
            yield
        except StreamQSourceError as error:
            if not self.found(endpoint, error):
                raise
            asking.pop(endpoint).client.close()


@dataclass(frozen=True, slots=True)
class _Watch:
    """A kept connection watching its producer's head (WATCH_HEAD) for streaming
    discovery: until it answers, the producer's state is the one its last probe found."""

    state: ProducerState
    since: float  # ``Client.watching``: when the watch was sent


# How long a producer may leave a watch unanswered while its head stays (WATCH_HEAD's
# ``wait_ms``; producers answer from half of it on, at random): each such answer costs the
# driver a read and a new watch's write (about 0.1 ms of its CPU, and as much of the
# producer's); at the producers' 5 s heartbeat interval, 1,024 idle producers took a
# tenth of the driver's core, and at 30 s an idle trigger every second read and wrote 45.
# A producer gone without a word is found by TCP keepalive instead (``KEEP_ALIVE``).
WATCH_WAIT = 120.0
# How long a watch not answered is believed: a producer answers one within WATCH_WAIT,
# whatever happened; one that did not is asked (a round).
WATCH_TRUST = WATCH_WAIT + 10.0
# A watching connection's TCP keepalive (``Client.keep_alive``: quiet seconds, seconds
# between probes, probes): a producer whose machine crashed or rebooted ends its watch
# within about 35 s, at no cost to the producer's process.
KEEP_ALIVE = (20.0, 5.0, 3)


def _watch(
    connections: Connections, endpoint: str, stream: str, state: ProducerState | _Missing
) -> None:
    """Have the endpoint's kept connection watch the head ``state`` found."""
    if not isinstance(state, ProducerState) or state.lost is not None or state.down:
        return  # asked again next trigger
    if endpoint in connections.unwatchable:
        return
    client = connections.take(endpoint)
    if client is None:
        return
    try:
        _arm(connections, endpoint, client, stream, state)
    except StreamQError:
        client.close()
        return
    connections.keep(endpoint, client)


def _arm(
    connections: Connections,
    endpoint: str,
    client: Client,
    stream: str,
    state: ProducerState,
    *told: Message,
) -> None:
    """Have ``client`` watch the head of ``state``, unless its last round already asked
    (and nothing is ``told``: requests sent first whose answers nobody reads)."""
    if client.watching is None or told:
        client.watch_head(stream, state.head, *told, wait=WATCH_WAIT)
    assert client.watching is not None
    connections.watches[endpoint] = _Watch(state, client.watching)
    connections.poll_watch(endpoint, client)


class _Ended:
    """``_unchanged``'s answer for a kept connection its watch's answer ended."""


_ENDED = _Ended()


def _unchanged(
    connections: Connections,
    endpoint: str,
    client: Client,
    stream: str,
    positions: Mapping[str, Position],
    reports: Reports | None,
    answered: set[str],
    now: float,
) -> ProducerState | _Ended | None:
    """The producer's state without a round trip, if its kept connection's watch says the
    head has not moved since the last probe (no answer yet, or one with the same head:
    then it watches again); None when it must be asked; ``_ENDED`` when the watch's answer
    was the connection's end or an ERROR (``client`` is closed then, and a producer that
    refused WATCH_HEAD is ``unwatchable``). ``answered``: the endpoints whose kept
    connection can be read now (``Connections.answered``).

    Nothing else can have changed on a connection kept open: a producer that lost commits
    restarted, which ended it. A report to send goes with a new watch, its answer not
    waited for (``Client.watch_head``'s ``told``; a query's last reports, as it stops, go
    with a discovery that asks every producer and reads every answer)."""
    watch = connections.watches.pop(endpoint, None)
    if watch is None or client.watching != watch.since:  # none, or a read took its answer
        return None
    state = watch.state
    position = positions.get(state.producer_id)
    if position is not None and position.seq > state.head + 1:
        return None  # not a position this connection vouched for
    renewed = False  # the watch answered at its wait's end: watched again anyway
    try:
        if endpoint in answered and client.watch_answered():
            info = client.watched()
            if info.head != state.head:
                return None  # asked, the report with the questions
            state, renewed = replace(state, low=info.low), True
        elif now - watch.since >= WATCH_TRUST:
            return None
        report = _told(reports, stream, state.producer_id, renewed)
        if not (renewed or report):
            connections.watches[endpoint] = watch
            return state
        _arm(connections, endpoint, client, stream, state, *report)
    except StreamQError as error:
        if isinstance(error, MalformedFrameError):
            connections.unwatchable.add(endpoint)
        client.close()
        if reports is not None:
            reports.sent.discard(state.producer_id)  # told to no one: told again later
        return _ENDED
    return state


def _told(reports: Reports | None, stream: str, producer_id: str, renewed: bool) -> list[Message]:
    """The report to send with a new watch, counted as sent (advisory: its answer is not
    waited for): the producer's new position, if this trigger may still write one
    (``TOLD_PER_TRIGGER``); with a watch ``renewed`` anyway, also one heard long ago."""
    if reports is None:
        return []
    held = reports.held(producer_id, anyway=renewed)
    owed = producer_id in reports.seqs and not renewed
    if held is None or (owed and reports.told >= TOLD_PER_TRIGGER):
        return []
    reports.sent.add(producer_id)
    reports.told += owed
    return [ReportPosition(stream, reports.consumer, held)]


def _send_round(
    connections: Connections,
    one: _Asking,
    asking: dict[str, _Asking],
    start: Callable[[str, Client, bool], _Asking],
) -> None:
    with _about(one.endpoint):
        if one.client.closed:  # an ERROR ended it: the next round on a new one
            client = connections.connect.client(one.endpoint, connections.name)
            if client.producer_id != one.client.producer_id:
                client.close()
                raise StreamQError(f"now serves producer {client.producer_id}")
            one.client = client
        try:
            one.client.send_requests(*one.requests)
        except _CLOSED_WHILE_KEPT:
            if not one.restartable:
                raise
            asking[one.endpoint] = restarted = _fresh(connections, one, start)
            restarted.client.send_requests(*restarted.requests)


def _read_round(
    connections: Connections,
    one: _Asking,
    asking: dict[str, _Asking],
    start: Callable[[str, Client, bool], _Asking],
    results: dict[str, ProducerState | _Missing],
) -> None:
    one = asking[one.endpoint]  # restarted when sending, perhaps
    with _about(one.endpoint):
        answers: Answers = []
        for _ in _answered(one.requests):
            try:
                answers.append(one.client.next_answer())
            except _CLOSED_WHILE_KEPT:
                if not one.restartable:
                    raise
                asking[one.endpoint] = _fresh(connections, one, start)
                return
            except StreamQError as error:  # an ERROR: the producer answers nothing after it
                answers.append(error)
                break
        one.answered = True
        try:
            one.requests = one.probe.send(answers)
        except StopIteration as done:
            results[one.endpoint] = done.value
            del asking[one.endpoint]
            if not one.client.closed:
                connections.keep(one.endpoint, one.client)


def _answered(requests: list[Message]) -> list[Message]:
    """The requests of a round whose answers the round reads: not a WATCH_HEAD's."""
    return [r for r in requests if not isinstance(r, WatchHead)]


def _fresh(
    connections: Connections, one: _Asking, start: Callable[[str, Client, bool], _Asking]
) -> _Asking:
    one.client.close()
    return start(one.endpoint, connections.connect.client(one.endpoint, connections.name), False)


@contextlib.contextmanager
def _about(endpoint: str) -> Iterator[None]:
    """A producer's failure, as the query's error naming it."""
    try:
        yield
    except StreamQError as exc:
        raise StreamQSourceError(f"producer at {endpoint}: {exc}") from exc


def discover(
    endpoints: Sequence[str],
    stream: str,
    via: Connect | Connections,
    positions: Mapping[str, Position] | None = None,
    reports: Reports | None = None,
    known: Mapping[str, ProducerState] | None = None,
) -> dict[str, ProducerState]:
    """Every producer's id, head and low, asked of all at once; raises naming what failed,
    and if any producer lacks ``stream``, naming each such producer and its streams.

    With ``positions`` (a streaming query's, possibly empty), also the epoch of each head
    and the seqs each producer lost under the query's position (``ProducerState.lost``).
    ``reports``: positions to report on the way (``Reports``, ``_ask_all``). ``known``: the
    states the last discovery found (by producer id); one of those producers that cannot
    be reached now is its known state with ``down`` set, not an error.
    """
    connections, done = _via(via)
    by_endpoint = {s.endpoint: s for s in (known or {}).values()}
    try:
        found = _ask_all(connections, endpoints, stream, positions, reports, by_endpoint)
    finally:
        done()
    missing = [m for m in found if isinstance(m, _Missing)]
    if missing:
        token = connections.connect.token is not None
        raise StreamQSourceError(_unknown_stream(stream, missing, len(found), token))
    by_id: dict[str, ProducerState] = {}
    for state in found:
        assert isinstance(state, ProducerState)
        if state.producer_id in by_id:
            other = by_id[state.producer_id].endpoint
            raise StreamQSourceError(
                f"{state.endpoint} and {other} serve the same producer {state.producer_id}"
            )
        by_id[state.producer_id] = state
    return by_id


_MISSING_SHOWN = 5  # producers an unknown stream's error lists; it counts the others


def _unknown_stream(stream: str, missing: Sequence[_Missing], producers: int, token: bool) -> str:
    """One line for a stream some producers lack, like the CLI's "unknown stream 'ordres';
    this producer has ['orders']", with the streams each of them has."""

    def has(m: _Missing) -> str:
        names = m.streams or "no streams"
        return f"lets this query's token read {names}" if token else f"has {names}"

    hint = (
        "every producer the query reads must have the stream: check its name, or create it "
        "(Producer.create_stream) before a query reads the producer"
    )
    if producers == 1:
        only = missing[0]
        where = f"producer at {only.endpoint}"
        return f"{where}: unknown stream {stream!r}; this producer {has(only)} ({hint})"
    shown = "; ".join(f"the producer at {m.endpoint} {has(m)}" for m in missing[:_MISSING_SHOWN])
    if len(missing) > _MISSING_SHOWN:
        shown += f"; and {len(missing) - _MISSING_SHOWN} more"
    return f"unknown stream {stream!r} at {len(missing)} of {producers} producers: {shown} ({hint})"


def _seek(state: ProducerState, stream: str, timestamp: int, connect: Connect) -> int:
    try:
        with connect.client(state.endpoint, "spark driver") as client:
            if client.producer_id != state.producer_id:
                raise StreamQSourceError(
                    f"{state.endpoint} now serves producer {client.producer_id}, "
                    f"not {state.producer_id}"
                )
            return client.seek_time(stream, timestamp).seq
    except StreamQError as exc:
        raise StreamQSourceError(f"producer at {state.endpoint}: {exc}") from exc


def seek_time(
    states: Mapping[str, ProducerState], stream: str, timestamp: int, connect: Connect
) -> Offsets:
    """Each producer's first seq stamped at or after ``timestamp`` (its head + 1 if none):
    one index seek per producer, asked in parallel."""
    if not states:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(states))) as pool:
        seqs = pool.map(lambda s: _seek(s, stream, timestamp, connect), states.values())
        return dict(zip(states, seqs, strict=True))


def resolve(
    spec: str, states: Mapping[str, ProducerState], option: str, missing: int = EARLIEST
) -> Offsets:
    """``earliest``, ``latest`` or a JSON map into offsets for every known producer.

    Producers a JSON map leaves out get ``missing`` (EARLIEST or LATEST).
    """
    spec = spec.strip()
    if spec == "earliest":
        return {pid: s.low for pid, s in states.items()}
    if spec == "latest":
        return {pid: s.head + 1 for pid, s in states.items()}
    given = _json_offsets(spec, option)[0]
    unknown = sorted(set(given) - set(states))
    if unknown:
        raise StreamQSourceError(f"{option} names producers no endpoint serves: {unknown}")
    offsets = {}
    for pid, state in states.items():
        seq = given.get(pid, missing)
        offsets[pid] = state.low if seq == EARLIEST else state.head + 1 if seq == LATEST else seq
    return offsets


def _json_offsets(spec: str, option: str) -> tuple[Offsets, dict[str, int]]:
    """A JSON map producer id -> seq, with an offset's ``epochs`` beside them if given."""
    try:
        given = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise StreamQSourceError(
            f"{option} must be 'earliest', 'latest' or a JSON map producer id -> seq: {exc}"
        ) from None
    if not isinstance(given, dict):
        raise StreamQSourceError(f"{option} JSON must map producer ids to integer seqs")
    try:
        return split_offset(given)
    except StreamQSourceError:
        raise StreamQSourceError(f"{option} JSON must map producer ids to integer seqs") from None


def given_epochs(spec: str | None) -> dict[str, int]:
    """The epochs of a JSON ``startingOffsets`` copied from a query's offsets (none else)."""
    if spec is None or spec.strip() in ("earliest", "latest"):
        return {}
    seqs, epochs = _json_offsets(spec, "startingOffsets")
    return {pid: e for pid, e in epochs.items() if seqs[pid] >= 1}


def check_producers(start: Mapping[str, int], states: Mapping[str, ProducerState]) -> None:
    """Fail when a producer the query reads from vanished or went backwards (without
    ``ProducerState.lost``, as for a batch read; see ``data_loss`` for a streaming query)."""
    for pid, seq in start.items():
        state = states.get(pid)
        if state is None:
            serving = ", ".join(f"{s.endpoint} = {s.producer_id}" for s in states.values())
            raise StreamQSourceError(
                f"producer {pid}, read up to seq {seq - 1}, is at none of the endpoints "
                f"({serving}): was its database replaced? Refusing to read another log "
                "silently; start a new query (new checkpoint) to read the new producers."
            )
        if state.lost is None and seq > state.head + 1:
            raise StreamQSourceError(data_loss(state, "", range(state.head + 1, seq)))


def data_loss(state: ProducerState, stream: str, lost: range | None = None) -> str:
    """Why a query cannot go on from its position with this producer, as the Consumer's
    ``SeqsReusedError``/``ConsumerPositionError`` say it: ``lost`` (default
    ``state.lost``) are the seqs up to the query's position that the producer's log no
    longer holds as the query read them. ``stream`` may be "" (not named)."""
    lost = state.lost if lost is None else lost
    assert lost is not None
    first, last, head = lost[0], lost[-1], state.head
    where = f"producer {state.producer_id} at {state.endpoint}"
    of_stream = f" of stream {stream!r}" if stream else ""
    if first <= head:
        return (
            f"{where} lost commits{of_stream} and re-used their seqs: the query already read "
            f"up to seq {last}, but the producer's log no longer holds seqs {first}..{last} "
            f"as the query read them (head {head}; other records now stand under seqs "
            f"{first}..{min(head, last)}). A power loss rolled back commits that were not "
            "synced (durability='normal')."
        )
    return (
        f"{where} has head {head}{' for stream ' + repr(stream) if stream else ''}, but the "
        f"query already read up to seq {last}: seqs {first}..{last} are no longer in the "
        "producer's log. The producer's database lost commits or was restored from an "
        "older copy."
    )


def limit(start: Mapping[str, int], end: Mapping[str, int], max_rows: int) -> Offsets:
    """At most ``max_rows`` in all, shared in proportion to each producer's backlog."""
    backlog = {pid: end[pid] - start[pid] for pid in end}
    total = sum(backlog.values())
    if total <= max_rows:
        return dict(end)
    shares = {pid: max_rows * b // total for pid, b in backlog.items()}
    # Hand out what rounding left, largest remainders first (ties by id: deterministic).
    left = max_rows - sum(shares.values())
    by_remainder = sorted(backlog, key=lambda pid: (-(max_rows * backlog[pid] % total), pid))
    for pid in by_remainder[:left]:
        shares[pid] += 1
    return {pid: start[pid] + shares[pid] for pid in end}


def plan(
    ranges: Sequence[Range], min_partitions: int, max_records_per_partition: int
) -> list[Range]:
    """Split ranges so that none is larger than ``max_records_per_partition`` and there
    are pieces enough to fill ``min_partitions``: a range's pieces are in proportion to
    its size, and equal (to within one record)."""
    ranges = [r for r in ranges if r.size > 0]
    total = sum(r.size for r in ranges)
    if not total:
        return []
    planned = []
    for r in ranges:
        pieces = max(
            1,
            math.ceil(r.size / max_records_per_partition),
            round(r.size * min_partitions / total),
        )
        pieces = min(pieces, r.size)
        bounds = [r.start + r.size * i // pieces for i in range(pieces + 1)]
        planned += [Range(r.producer_id, r.endpoint, a, b) for a, b in itertools.pairwise(bounds)]
    return planned


def pack(
    pieces: Sequence[Range], min_partitions: int, max_records_per_partition: int
) -> list[list[Range]]:
    """The pieces as Spark partitions, each reading several producers' ranges: at least
    ``min_partitions`` (as pieces allow), and enough that none holds much more than
    ``max_records_per_partition``. Each Python task costs Spark tens of milliseconds,
    whatever it reads: one per producer made a trigger over hundreds of producers cost
    seconds. The largest piece goes first to the lightest partition, so partitions stay
    within one piece of each other; within one, ranges are in producer order."""
    total = sum(p.size for p in pieces)
    if not total:
        return []
    count = max(min_partitions, math.ceil(total / max_records_per_partition))
    count = min(count, len(pieces))
    loads = [(0, i) for i in range(count)]  # a heap: (records, partition)
    partitions: list[list[Range]] = [[] for _ in range(count)]
    for piece in sorted(pieces, key=lambda p: (-p.size, p.producer_id, p.start)):
        load, i = heapq.heappop(loads)
        partitions[i].append(piece)
        heapq.heappush(loads, (load + piece.size, i))
    return [sorted(p, key=lambda r: (r.producer_id, r.start)) for p in partitions]

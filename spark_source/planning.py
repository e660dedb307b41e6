"""Driver-side planning: where the producers are, which seqs each micro-batch reads, and how
the work splits into partitions.

Offsets are JSON maps ``{producer id: next seq}``. Everything here is plain
Python; the only I/O is the blocking ``streamq.Client``, one short request per
producer, in parallel.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from streamq import Client, ClientTLS, StreamQError, UnknownStreamError

Offsets = dict[str, int]

EARLIEST, LATEST = -2, -1  # in JSON offsets, as in Spark's Kafka source


class StreamQSourceError(Exception):
    """A streamq source cannot go on; the message says which producer and why."""


@dataclass(frozen=True, slots=True)
class Connect:
    """How the driver and executors reach producers. Plain data: it is pickled into every
    partition, so certificate files (``tls``) must exist on the executors too."""

    timeout: float = 30.0  # per request, connect included
    tls: ClientTLS | None = None
    token: str | None = None

    def client(self, endpoint: str, name: str) -> Client:
        return Client(endpoint, timeout=self.timeout, name=name, tls=self.tls, token=self.token)


@dataclass(frozen=True, slots=True)
class ProducerState:
    producer_id: str
    endpoint: str
    head: int  # last committed seq
    low: int  # first seq still held


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
    """Endpoints from a comma-separated list, a file with one per line (# comments), and a
    provider: ``module:function`` returning host:port strings (e.g. from a service registry).

    The source calls this at every trigger, so producers added to the file or the registry
    join a running query.
    """
    found: list[str] = []
    if endpoints:
        found += [e.strip() for e in endpoints.split(",") if e.strip()]
    if endpoints_file:
        with open(endpoints_file) as lines:
            found += [
                line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()
            ]
    if provider:
        found += [str(e).strip() for e in _load_provider(provider)()]
    if not found:
        raise StreamQSourceError(
            "set option 'endpoints' (host:port,...), 'endpointsFile' or 'endpointsProvider'"
        )
    return list(dict.fromkeys(found))


def _load_provider(spec: str) -> Callable[[], Iterable[str]]:
    module_name, sep, function = spec.partition(":")
    if not sep:
        raise StreamQSourceError(f"endpointsProvider must be module:function, not {spec!r}")
    try:
        provider = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise StreamQSourceError(f"endpointsProvider {spec!r}: {exc}") from exc
    if not callable(provider):
        raise StreamQSourceError(f"endpointsProvider {spec!r} is not callable")
    return cast(Callable[[], Iterable[str]], provider)


def _probe(endpoint: str, stream: str, connect: Connect) -> ProducerState:
    try:
        with connect.client(endpoint, "spark driver") as client:
            producer_id = client.producer_id
            try:
                info = client.head(stream)
            except UnknownStreamError:
                return ProducerState(producer_id, endpoint, 0, 1)  # nothing published yet
    except StreamQError as exc:
        raise StreamQSourceError(f"producer at {endpoint}: {exc}") from exc
    return ProducerState(producer_id, endpoint, info.head, info.low)


def discover(endpoints: Sequence[str], stream: str, connect: Connect) -> dict[str, ProducerState]:
    """Every producer's id, head and low, asked in parallel; raises naming what failed."""
    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        states = list(pool.map(lambda e: _probe(e, stream, connect), endpoints))
    by_id: dict[str, ProducerState] = {}
    for state in states:
        if state.producer_id in by_id:
            other = by_id[state.producer_id].endpoint
            raise StreamQSourceError(
                f"{state.endpoint} and {other} serve the same producer {state.producer_id}"
            )
        by_id[state.producer_id] = state
    return by_id


def _seek(state: ProducerState, stream: str, timestamp: int, connect: Connect) -> int:
    try:
        with connect.client(state.endpoint, "spark driver") as client:
            if client.producer_id != state.producer_id:
                raise StreamQSourceError(
                    f"{state.endpoint} now serves producer {client.producer_id}, "
                    f"not {state.producer_id}"
                )
            return client.seek_time(stream, timestamp).seq
    except UnknownStreamError:
        return state.low  # nothing published yet: its first record will be late enough
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
    try:
        given = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise StreamQSourceError(
            f"{option} must be 'earliest', 'latest' or a JSON map producer id -> seq: {exc}"
        ) from None
    if not isinstance(given, dict) or not all(isinstance(v, int) for v in given.values()):
        raise StreamQSourceError(f"{option} JSON must map producer ids to integer seqs")
    unknown = sorted(set(given) - set(states))
    if unknown:
        raise StreamQSourceError(f"{option} names producers no endpoint serves: {unknown}")
    offsets = {}
    for pid, state in states.items():
        seq = given.get(pid, missing)
        offsets[pid] = state.low if seq == EARLIEST else state.head + 1 if seq == LATEST else seq
    return offsets


def check_producers(start: Mapping[str, int], states: Mapping[str, ProducerState]) -> None:
    """Fail when a producer the query reads from vanished or went backwards."""
    for pid, seq in start.items():
        state = states.get(pid)
        if state is None:
            serving = ", ".join(f"{s.endpoint} = {s.producer_id}" for s in states.values())
            raise StreamQSourceError(
                f"producer {pid}, read up to seq {seq - 1}, is at none of the endpoints "
                f"({serving}): was its database replaced? Refusing to read another log "
                "silently; start a new query (new checkpoint) to read the new producers."
            )
        if seq > state.head + 1:
            raise StreamQSourceError(
                f"producer {pid} at {state.endpoint} has head {state.head}, but the query "
                f"already read up to seq {seq - 1}: the producer's database lost commits or "
                "was restored from an older copy."
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
    """Split ranges so there are at least ``min_partitions`` and none is too large.

    Splits are proportional to size, so partitions stay balanced across producers.
    """
    ranges = [r for r in ranges if r.size > 0]
    total = sum(r.size for r in ranges)
    if not total:
        return []
    target = max(min_partitions, len(ranges))
    planned = []
    for r in ranges:
        pieces = max(
            1,
            math.ceil(r.size / max_records_per_partition),
            round(r.size * target / total),
        )
        pieces = min(pieces, r.size)
        bounds = [r.start + r.size * i // pieces for i in range(pieces + 1)]
        planned += [Range(r.producer_id, r.endpoint, a, b) for a, b in itertools.pairwise(bounds)]
    return planned

"""What the console shows, gathered without the web: each producer's status report,
asked every interval over a kept connection; each consumer's lag over the last minutes;
each consumer database's groups and dead letters. The web layer (``app``) serves what
``Watch.latest`` holds and passes the page's requests (a stream's newest records, a
dead letter's retry) to ``Watch``: nothing here knows HTTP.

Everything here blocks (``Client`` is the blocking client): the web layer calls it in a
thread. ``poll`` is called by one task at a time; ``latest`` is the last poll's result,
built whole, so a reader never sees half a poll."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..captured import record_json
from ..consumer.database import list_dead_letters, mark_for_retry
from ..errors import (
    AuthenticationFailedError,
    NotAuthorizedError,
    RemoteProtocolError,
    StreamQError,
)
from ..groups.report import describe_groups, status_lags, with_answers
from ..wire.client import Client
from ..wire.security import ClientTLS
from ..wire.status_report import consumer_rows

HISTORY_SECONDS = 300  # the lag charts' span
RATE_SECONDS = 10.0  # a stream's rate: its head's growth over about this long
TAIL_LIMIT = 50  # the newest records a tail shows at most


@dataclass
class _Producer:
    """One producer watched: its kept connection and what its reports said over time."""

    address: str
    client: Client | None = None
    status: dict[str, Any] | None = None
    error: str | None = None
    heads: deque[tuple[float, dict[str, int]]] = field(default_factory=deque)
    lags: dict[tuple[str, str], deque[tuple[float, int]]] = field(default_factory=dict)


class Watch:
    """The producers at ``addresses()`` (called at every poll: a file or registry may
    list new ones, as for the Spark source) and the consumer databases ``databases``."""

    def __init__(
        self,
        addresses: Callable[[], Sequence[str]],
        databases: Sequence[str] = (),
        *,
        tls: ClientTLS | None = None,
        token: str | None = None,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._addresses = addresses
        self.databases = list(databases)
        self._tls, self._token, self._timeout = tls, token, timeout
        self._clock = clock
        self._producers: dict[str, _Producer] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="streamq-console")
        self.latest: dict[str, Any] = {
            "time": 0,
            "listing_error": None,
            "producers": [],
            "databases": [],
            "groups": [],
            "parked": [],
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for producer in self._producers.values():
            if producer.client is not None:
                producer.client.close()

    def check(self, addresses: Sequence[str]) -> list[tuple[str, str]]:
        """The addresses whose peer is not a streamq producer, or refuses this console its
        status report: mistakes to say at once, with why. One that cannot be reached is
        not (it may start later): the page shows it unreachable."""

        def ask(address: str) -> tuple[str, str] | None:
            try:
                with self._client(address) as client:
                    client.status()
            except RemoteProtocolError as exc:
                return address, str(exc)
            except (AuthenticationFailedError, NotAuthorizedError) as exc:
                return (
                    address,
                    f"{exc} (the console reads the status report: give an admin "
                    "token, --producer-token-file)",
                )
            except (OSError, StreamQError):
                return None
            return None

        return [wrong for wrong in self._pool.map(ask, addresses) if wrong is not None]

    # --- polling ------------------------------------------------------------------

    def poll(self) -> dict[str, Any]:
        """Ask every producer and database once; the new snapshot."""
        now = self._clock()
        listing = None
        try:
            addresses = list(dict.fromkeys(self._addresses()))
        except (OSError, ValueError) as exc:  # a file gone, a line mistyped: the last list
            addresses, listing = list(self._producers), f"endpoints: {exc}"
        for gone in set(self._producers) - set(addresses):
            self._forget(gone)
        watched = [self._producers.setdefault(a, _Producer(a)) for a in addresses]
        list(self._pool.map(lambda p: self._ask(p, now), watched))
        databases = list(self._pool.map(self._read_database, self.databases))
        self.latest = {
            "time": int(now * 1000),
            "listing_error": listing,
            "producers": [self._producer_view(p) for p in watched],
            "databases": [d["view"] for d in databases],
            "groups": with_statuses(
                [g for d in databases for g in d["groups"]],
                {p.address: p.status for p in watched if p.status is not None},
            ),
            "parked": [p for d in databases for p in d["parked"]],
        }
        return self.latest

    def _forget(self, address: str) -> None:
        producer = self._producers.pop(address)
        if producer.client is not None:
            producer.client.close()

    def _ask(self, producer: _Producer, now: float) -> None:
        """``producer``'s status, on its kept connection (made anew after a failure)."""
        try:
            if producer.client is None or producer.client.closed:
                producer.client = self._client(producer.address)
            status = producer.client.status()
        except (OSError, StreamQError) as exc:
            if producer.client is not None:
                producer.client.close()
                producer.client = None
            producer.status, producer.error = None, str(exc)
            return
        producer.status, producer.error = status, None
        producer.heads.append((now, {s["stream"]: s["head"] for s in status["streams"]}))
        while producer.heads and producer.heads[0][0] < now - RATE_SECONDS:
            producer.heads.popleft()
        for row in consumer_rows(status):
            history = producer.lags.setdefault((row["consumer"], row["stream"]), deque())
            history.append((now, row["lag"]))
        for history in producer.lags.values():
            while history and history[0][0] < now - HISTORY_SECONDS:
                history.popleft()

    def _client(self, address: str) -> Client:
        return Client(
            address, timeout=self._timeout, name="streamq console", tls=self._tls, token=self._token
        )

    def _producer_view(self, producer: _Producer) -> dict[str, Any]:
        view: dict[str, Any] = {"address": producer.address, "error": producer.error}
        status = producer.status
        if status is None:
            return view
        rates = _rates(producer.heads)
        rows = consumer_rows(status)
        for row in rows:
            history = producer.lags.get((row["consumer"], row["stream"]), ())
            row["history"] = [[round(t, 3), lag] for t, lag in history]
        return {
            **view,
            **{k: status.get(k) for k in ("producer_id", "epoch", "build", "connections")},
            "streams": [{**s, "rate": rates.get(s["stream"])} for s in status["streams"]],
            "consumers": rows,
            "capture": status.get("capture"),
            "publishing": status.get("publishing"),
            "open_transactions": status.get("open_transactions"),
        }

    def _read_database(self, db: str) -> dict[str, Any]:
        """A consumer database's groups (members, shares, positions) and parked records."""
        try:
            groups = describe_groups(db, heads=False)
            parked = list_dead_letters(db)
        except Exception as exc:  # a database gone or locked: shown, the others go on
            return {"view": {"database": db, "error": _one_line(exc)}, "groups": [], "parked": []}
        return {
            "view": {"database": db, "error": None},
            "groups": [{"database": db, "report": g} for g in groups],
            "parked": [{"database": db, **_parked(p.as_json())} for p in parked],
        }

    # --- the page's requests --------------------------------------------------------

    def tail(self, address: str, stream: str, after: int | None = None) -> dict[str, Any]:
        """``stream``'s newest records at ``address`` (at most ``TAIL_LIMIT``; those after
        seq ``after`` if given), decoded as ``streamq tail --json`` prints them."""
        if address not in self._producers:
            raise LookupError(f"this console does not watch a producer at {address}")
        with self._client(address) as client:
            info = client.head(stream)
            start = max(info.low, info.head - TAIL_LIMIT + 1, 1 if after is None else after + 1)
            records: list[dict[str, Any]] = []
            if start <= info.head:
                for batch in client.read_range(stream, start, info.head + 1):
                    records.extend(record_json(r) for r in batch)
        return {"stream": stream, "head": info.head, "low": info.low, "records": records}

    def retry(self, database: str, consumer: str, stream: str, seq: int) -> int:
        """Mark one parked record for its consumer to re-apply; how many were marked (0:
        none matched, perhaps retried already)."""
        if database not in self.databases:
            raise LookupError(f"this console does not watch a consumer database {database}")
        return mark_for_retry(database, consumer, stream, seq)


def with_statuses(
    groups: list[dict[str, Any]], statuses: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each group's report as JSON, its shares' heads and lags taken from the status
    reports of the producers watched (by the endpoint each position was stored for)."""
    heads = {
        (address, s["stream"]): s["head"]
        for address, status in statuses.items()
        for s in status["streams"]
    }
    lags = {}
    for address, status in statuses.items():
        lags.update(status_lags(address, status))
    reports = with_answers([g["report"] for g in groups], heads, lags, {})
    return [
        {"database": g["database"], **report.as_json()}
        for g, report in zip(groups, reports, strict=True)
    ]


def _rates(heads: deque[tuple[float, dict[str, int]]]) -> dict[str, float]:
    """Records a second per stream, from the oldest and newest heads kept."""
    if len(heads) < 2:
        return {}
    (then, old), (now, new) = heads[0], heads[-1]
    if now <= then:
        return {}
    return {s: max(0, head - old.get(s, head)) / (now - then) for s, head in new.items()}


def _parked(parked: dict[str, Any]) -> dict[str, Any]:
    """A dead letter as the page lists it: the error's last line, not its traceback."""
    error = parked.get("error") or ""
    return {**parked, "error": error.strip().splitlines()[-1] if error.strip() else ""}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

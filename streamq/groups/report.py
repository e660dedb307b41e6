"""A consumer group as an operator reads it (``streamq groups``), from the consumer's
database: its split, its members (alive, when each must renew), each share's holder and
lease token, the positions its shares stored (per producer) and the records they parked;
with each producer's head where it answers, how far behind each position is.

What a "kafka-consumer-groups --describe" shows, read from the rows the members write
(``engines/leases.py``) and their positions, so it answers with every member stopped too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

from ..consumer.database import consumer_database
from ..errors import StreamQError
from ..filters import share_name, shared_as
from ..wire.client import Client
from .membership import Member


@dataclass(frozen=True, slots=True)
class MemberRow:
    member: int  # its random id
    alive: bool  # its process holds its liveness lock, and its row has not expired
    expires_in_ms: int  # until its row expires unless renewed (negative: expired)
    shares: list[int]  # the shares it holds
    host: str | None = None  # where its process runs (None: a member of an older streamq)
    pid: int | None = None  # its process id there


@dataclass(frozen=True, slots=True)
class ShareRow:
    share: int
    holder: int | None  # the member holding its lease (None: free)
    token: int  # the lease's take counter: new at every take
    producer_id: str | None  # the producer a position is stored for (None: none yet)
    applied: int | None  # the position stored for that producer
    endpoint: str | None  # where that producer was last reached
    head: int | None  # the stream's head there now (None: not asked, or no answer)
    parked: int  # records of this share in the dead letters
    lag: int | None = None  # its keys' records it owes, as the producer counts them
    exact: bool = False  # ``lag`` is that count, not head - applied (its upper bound)
    held_ms: int | None = None  # since its holder took its lease, while it holds it
    lease: str = "free"  # "held" (by a live member), "expired" (its holder is not alive:
    # any member may take it) or "free" (given back, or never taken)
    expired_ms: int | None = None  # since an expired lease's holder's row expired (None:
    # not known: its process ended before its row expired, or its row is gone)

    @property
    def behind(self) -> int | None:
        """What the share still owes: the producer's count of its keys' records after its
        position (its status report, where it gives it), else head minus applied, every
        key's, an upper bound (docs/guides/operations.md, "What lag counts")."""
        if self.lag is not None:
            return self.lag
        if self.head is None or self.applied is None:
            return None
        return max(0, self.head - self.applied)


@dataclass(frozen=True, slots=True)
class GroupReport:
    name: str
    stream: str
    shares: int
    members: list[MemberRow]
    rows: list[ShareRow]  # one per share and producer it stored a position for
    unreachable: dict[str, str] = field(default_factory=dict)  # endpoint -> why no head

    def as_json(self) -> dict[str, Any]:
        return {
            "group": self.name,
            "stream": self.stream,
            "shares": self.shares,
            "members": [
                {
                    "member": f"{m.member:016x}",
                    "host": m.host,
                    "pid": m.pid,
                    "alive": m.alive,
                    "expires_in_ms": m.expires_in_ms,
                    "shares": m.shares,
                }
                for m in self.members
            ],
            "positions": [
                {
                    "share": r.share,
                    "holder": None if r.holder is None else f"{r.holder:016x}",
                    "token": r.token,
                    "lease": r.lease,
                    "held_ms": r.held_ms,
                    "expired_ms": r.expired_ms,
                    "producer_id": r.producer_id,
                    "applied": r.applied,
                    "endpoint": r.endpoint,
                    "head": r.head,
                    "behind": r.behind,
                    "exact": r.exact,
                    "parked": r.parked,
                }
                for r in self.rows
            ],
            "unreachable": self.unreachable,
        }


def describe_groups(
    db: str, name: str | None = None, *, heads: bool = True, timeout: float = 2.0
) -> list[GroupReport]:
    """Every consumer group in the consumer database ``db`` (or the one named ``name``),
    with the producers' heads asked of them (``heads``, within ``timeout`` each)."""
    engine = consumer_database(db)
    if "streamq_groups" not in engine.tables(db).names:
        return []
    found = [g for g in engine.open_leases(db, "", "").groups() if name in (None, g[0])]
    reports = [_report(engine.open_leases(db, group, stream)) for group, stream in found]
    return _with_heads(reports, timeout) if heads else reports


def _report(table: Any) -> GroupReport:
    found = table.inspect()
    view = found.view
    held: dict[int, list[int]] = {}
    for lease in view.leases:
        if lease.member is not None:
            held.setdefault(lease.member, []).append(lease.share)
    members = [
        MemberRow(
            m.id, m.alive(view.now), m.expires_at - view.now, sorted(held.get(m.id, [])),
            *found.processes.get(m.id, (None, None)),
        )
        for m in sorted(view.members, key=lambda m: m.id)
    ]  # fmt: skip
    by_id = {m.id: m for m in view.members}
    leases = {lease.share: lease for lease in view.leases}
    stored: dict[int, list[tuple[Any, ...]]] = {}
    for consumer, producer_id, seq, endpoint, _ in found.positions:
        # Only this split's shares: an earlier split's stay until every producer passes them.
        split = shared_as(table.name, consumer)
        if split is not None and split[1] == view.shares:
            stored.setdefault(split[0], []).append((producer_id, int(seq), endpoint))
    rows = []
    for share in range(view.shares):
        lease = leases.get(share)
        holder, token = (None, 0) if lease is None else (lease.member, lease.token)
        count = found.parked.get(share_name(table.name, (share, view.shares)), 0)
        holding = None if holder is None else by_id.get(holder)
        state, held_ms, expired_ms = _lease(holder, holding, found.taken.get(share), view.now)
        for producer_id, seq, endpoint in stored.get(share) or [(None, None, None)]:
            rows.append(
                ShareRow(share, holder, token, producer_id, seq, endpoint, None, count,
                         held_ms=held_ms, lease=state, expired_ms=expired_ms)
            )  # fmt: skip
    return GroupReport(table.name, table.stream, view.shares, members, rows)


def _lease(
    holder: int | None, member: Member | None, taken: int | None, now: int
) -> tuple[str, int | None, int | None]:
    """A share's lease as ``ShareRow`` shows it (lease, held_ms, expired_ms): held, for how
    long, while its holder is alive; expired once it is not, whoever it names (any member
    may take it), since its holder's row expired where it did."""
    if holder is None:
        return "free", None, None
    if member is not None and member.alive(now):
        return "held", None if taken is None else now - taken, None
    if member is not None and member.expires_at <= now:
        return "expired", None, now - member.expires_at
    return "expired", None, None  # its process ended before its row expired, or it is gone


def _with_heads(reports: list[GroupReport], timeout: float) -> list[GroupReport]:
    """``reports`` with each position's producer's head, and each share's lag as it counts it
    (its status report, which a producer checking tokens gives an admin token only:
    without it, heads alone), asked of it: one connection per endpoint."""
    wanted = sorted({(r.endpoint, g.stream) for g in reports for r in g.rows if r.endpoint})
    endpoints = sorted({endpoint for endpoint, _ in wanted})
    heads: dict[tuple[str, str], int] = {}
    # (endpoint, name, stream) -> (applied, lag, exact), as the producer knows them
    lags: dict[tuple[str, str, str], tuple[int, int, bool]] = {}
    unreachable: dict[str, str] = {}
    clients = Client.connect_all(endpoints, timeout=timeout, name="streamq groups")
    for endpoint, client in zip(endpoints, clients, strict=True):
        if isinstance(client, StreamQError):
            unreachable[endpoint] = str(client)
            continue
        with client:
            try:
                for asked, stream in wanted:
                    if asked == endpoint:
                        heads[(endpoint, stream)] = client.head(stream).head
            except StreamQError as exc:
                unreachable[endpoint] = str(exc)
                continue
            with contextlib.suppress(StreamQError):  # last: an ERROR ends the connection
                lags.update(status_lags(endpoint, client.status()))
    return with_answers(reports, heads, lags, unreachable)


def status_lags(
    endpoint: str, status: dict[str, Any]
) -> dict[tuple[str, str, str], tuple[int, int, bool]]:
    """A producer's status report as ``with_answers`` takes its lags: by (endpoint,
    consumer, stream), (applied, lag, exact)."""
    return {
        (endpoint, p["consumer"], p["stream"]): (
            int(p["applied"]),
            int(p["lag"]),
            bool(p.get("exact", True)),
        )
        for p in status.get("positions", [])
    }


def with_answers(
    reports: list[GroupReport],
    heads: dict[tuple[str, str], int],
    lags: dict[tuple[str, str, str], tuple[int, int, bool]],
    unreachable: dict[str, str],
) -> list[GroupReport]:
    """``reports`` with what producers answered: ``heads`` by (endpoint, stream), ``lags``
    by (endpoint, consumer, stream) as (applied, lag, exact) from their status reports,
    and the endpoints that did not answer (why)."""
    answered = []
    for report in reports:
        rows = [_answered(r, report, heads, lags) if r.endpoint else r for r in report.rows]
        reached = {r.endpoint for r in rows}
        missing = {e: why for e, why in unreachable.items() if e in reached}
        answered.append(replace(report, rows=rows, unreachable=missing))
    return answered


def _answered(
    row: ShareRow,
    report: GroupReport,
    heads: dict[tuple[str, str], int],
    lags: dict[tuple[str, str, str], tuple[int, int, bool]],
) -> ShareRow:
    """``row`` with what its producer answered: the head, and the share's lag where the
    producer counted it for the position this row shows (the database's)."""
    assert row.endpoint is not None
    head = heads.get((row.endpoint, report.stream))
    name = share_name(report.name, (row.share, report.shares))
    known = lags.get((row.endpoint, name, report.stream))
    if known is None or known[0] != row.applied or not known[2]:
        return replace(row, head=head)
    return replace(row, head=head, lag=known[1], exact=True)

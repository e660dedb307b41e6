"""Who holds which share of a consumer group: leases in the consumer's own database.

A group is a consumer name and a stream split into ``n`` shares by key
(``filters.share_of``), applied by any number of worker processes. There is no
coordinator: each worker is a *member* with a row in the consumer's database, and holds
each of its shares through a *lease* row naming it. Everything that decides is here,
pure (no SQL, no sockets): ``plan`` says what one member should take and give back, from
a ``View`` of the rows. Each engine stores the rows (``engines/*/leases.py``), and
``group_consumer.GroupConsumer`` runs the loop around them.

- **A member is alive** while it renews its row before ``expires_at`` *and* the process
  still holds its liveness lock: an open-file-description lock on a file beside a SQLite
  database, a session-level advisory lock on PostgreSQL. The kernel (or the server)
  drops that lock the moment the process dies, so a worker killed with ``kill -9`` is
  known dead at the others' next look, not a timeout later; a worker that is alive but
  stalled (paused, partitioned from the database) stops renewing, and its row expires.
- **A share is free** when no lease names a live member. A member takes a free share by
  compare-and-set on the lease's ``token``, which each take increments; the share's
  position is then read after that write, so it includes every batch the previous holder
  committed.
- **Fencing.** Every batch applied under a lease carries its token (``batch.Fence``),
  and the position's turn check refuses it once the token has moved on
  (``LeaseLostError``), inside the same transaction: a stalled worker that wakes up after
  its share was taken cannot commit into it. On PostgreSQL the check locks the lease row
  until COMMIT, so a take waits for an apply in progress; SQLite has one writer at a time.
- **Balance.** The live members, ordered by id, each aim at ``n // m`` shares, the first
  ``n % m`` one more. A member below its aim takes free shares; one above it gives back
  its highest shares once another live member is below its own. Members beyond ``n`` hold
  nothing: standbys that take over when a holder dies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEASES_VERSION = 1  # of the group tables; a database with a newer one is refused


@dataclass(frozen=True, slots=True)
class Member:
    """A member's row, and whether its process still holds its liveness lock."""

    id: int
    expires_at: int  # milliseconds since the Unix epoch, by the database's clock
    locked: bool  # its liveness lock is held (False: the process is gone)

    def alive(self, now: int) -> bool:
        return self.locked and self.expires_at > now


@dataclass(frozen=True, slots=True)
class Lease:
    """A share's lease row: who holds it (None: nobody) and its take counter."""

    share: int
    member: int | None
    token: int


@dataclass(frozen=True, slots=True)
class View:
    """A group as one member read it: the split, its members and leases, and the
    database's clock at the time."""

    shares: int
    members: tuple[Member, ...]
    leases: tuple[Lease, ...]
    now: int

    def live(self) -> list[int]:
        """The ids of the live members, in order."""
        return sorted(m.id for m in self.members if m.alive(self.now))

    def held_by(self, member: int) -> list[Lease]:
        return [lease for lease in self.leases if lease.member == member]

    def free(self) -> list[Lease]:
        """The shares no live member holds (a lease row not yet written is one too)."""
        live = set(self.live())
        rows = {lease.share: lease for lease in self.leases}
        return [
            rows.get(share, Lease(share, None, 0))
            for share in range(self.shares)
            if share not in rows or rows[share].member not in live
        ]


@dataclass(frozen=True, slots=True)
class Plan:
    take: tuple[Lease, ...]  # free shares to take, as read (compare-and-set on the token)
    give_back: tuple[int, ...]  # shares held to release, for a member below its aim


def aims(live: Sequence[int], shares: int) -> dict[int, int]:
    """How many shares each live member should hold."""
    if not live:
        return {}
    each, extra = divmod(shares, len(live))
    return {member: each + (1 if rank < extra else 0) for rank, member in enumerate(live)}


def plan(view: View, me: int) -> Plan:
    """What member ``me`` should do now: take free shares up to its aim, or give back
    those above it when another live member is short. Nothing if ``me`` is not live."""
    live = view.live()
    if me not in live:
        return Plan((), ())
    aim = aims(live, view.shares)
    held = sorted(lease.share for lease in view.held_by(me))
    if len(held) < aim[me]:
        # Spread the takers: each starts at its own place among the free shares, so
        # members taking at once mostly ask for different ones (the token decides).
        free = view.free()
        start = live.index(me) * len(free) // len(live) if free else 0
        order = free[start:] + free[:start]
        return Plan(tuple(order[: aim[me] - len(held)]), ())
    if len(held) > aim[me]:
        short = any(len(view.held_by(m)) < aim[m] for m in live if m != me)
        if short:
            return Plan((), tuple(held[aim[me] :]))
    return Plan((), ())


def taken_from(view: View, me: int, held: dict[int, int]) -> list[int]:
    """Of the shares ``me`` believes it holds (share -> token), those the rows say it no
    longer does: taken by another member after ``me`` was seen dead or expired."""
    rows = {lease.share: lease for lease in view.leases}
    return [
        share
        for share, token in held.items()
        if (row := rows.get(share)) is None or row.member != me or row.token != token
    ]

"""A consumer group's rows in a PostgreSQL consumer database (``engines.leases``).

A member's liveness lock is a session-level advisory lock on its id, held by its own
connection: the server drops it when that session ends (the process died, or its
connection was cut), and every member sees the advisory locks held in ``pg_locks``.
A take locks the lease row (``FOR UPDATE``), so it waits for a batch being applied under
that lease: the turn check holds the row ``FOR SHARE`` until COMMIT.
"""

from __future__ import annotations

from typing import Any

from ..leases import SCHEMA, LeaseTable
from .driver import connect, database

_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('streamq_leases'))"
# bigint advisory keys show in pg_locks as (classid: high half, objid: low half, objsubid 1).
_HELD = (
    "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks WHERE locktype = 'advisory' "
    "AND objsubid = 1 AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


class PostgresLeases(LeaseTable):
    NOW = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    FOR_UPDATE = " FOR UPDATE"

    def __init__(self, db: str, name: str, stream: str) -> None:
        super().__init__(db, name, stream)
        self.where = database(db)

    def _connect(self) -> Any:
        return connect(self.db, self.where, application_name="streamq group", autocommit=True)

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s")

    def _create_tables(self) -> None:
        exists = self._one("SELECT to_regclass('streamq_leases') IS NOT NULL")
        if exists[0]:
            self._add_columns()
            return
        self._begin()  # two members making the tables at once would race on the catalog
        try:
            self._execute(_SCHEMA_LOCK)
            for statement in SCHEMA:
                self._execute(statement)
        except BaseException:
            self._execute("ROLLBACK")
            raise
        self._execute("COMMIT")

    def _hold_liveness(self) -> None:
        self._execute("SELECT pg_advisory_lock(?)", (self.member,))

    def _alive(self, members: list[int]) -> set[int]:
        held = {int(key) for (key,) in self._execute(_HELD).fetchall()}
        return {member for member in members if member in held}

    def _release_liveness(self) -> None:
        """Closing the session releases it."""

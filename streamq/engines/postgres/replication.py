"""A logical replication slot read over PostgreSQL's streaming replication protocol: the
server pushes each committed transaction's pgoutput messages as it decodes them, on one
long-lived connection, instead of a decoding session started anew for each look.

psycopg 3 does not speak the protocol's COPY BOTH mode; psycopg2 does
(``LogicalReplicationConnection``), so this one connection is psycopg2's
(``pip install 'streamq[postgres]'`` installs both). Its reads never block: the asyncio
layer (``capture.Capture``) waits on ``fileno()`` and drains ``messages()``.
"""

from __future__ import annotations

from typing import Any

from ...errors import DatabaseOpenError
from .driver import cannot_open
from .pgoutput import format_lsn, parse_lsn

STATUS_INTERVAL = 1.0  # s between the feedback messages psycopg2 sends by itself


def _psycopg2() -> Any:
    try:
        import psycopg2
        import psycopg2.extras
    except ImportError as exc:
        raise ImportError(
            "capturing tables reads PostgreSQL's replication protocol through psycopg2: "
            "pip install 'streamq[postgres]'"
        ) from exc
    return psycopg2


class SlotReader:
    """Streams the slot's changes from ``start_lsn`` on (the server starts at the slot's
    confirmed position if that is later). ``confirm(lsn)`` moves the slot: every
    transaction ending at or before ``lsn`` is stored, the server may recycle its WAL."""

    def __init__(
        self,
        url: str,
        where: str,
        slot: str,
        publication: str,
        start_lsn: int,
        *,
        messages: bool = False,  # logical messages too (``pgoutput.LogicalMessage``)
        name: str = "streamq capture",
    ) -> None:
        psycopg2 = _psycopg2()
        options = {"proto_version": "1", "publication_names": publication}
        if messages:
            options["messages"] = "true"
        try:
            self._conn = _replication_connection(psycopg2, url, name)
            self._cursor = self._conn.cursor()
            self._cursor.start_replication(
                slot_name=slot,
                decode=False,
                start_lsn=format_lsn(start_lsn),
                options=options,
                status_interval=STATUS_INTERVAL,
            )
        except psycopg2.Error as exc:
            self.close()
            raise cannot_open(where, url, exc) from exc
        self._errors = psycopg2.Error
        self._where = where

    def fileno(self) -> int:
        return int(self._cursor.fileno())

    def read(self, limit: int) -> tuple[list[bytes], bool]:
        """The pgoutput messages that have come, ``limit`` at most, without waiting, and
        whether that was all of them (then wait on ``fileno()`` for more)."""
        messages: list[bytes] = []
        read = self._cursor.read_message
        try:
            while len(messages) < limit:
                message = read()
                if message is None:
                    return messages, True
                messages.append(bytes(message.payload))
        except self._errors as exc:
            raise DatabaseOpenError(f"replication from {self._where}: {exc}") from exc
        return messages, False

    @property
    def wal_end(self) -> int:
        """How far the server has decoded, as it last said: nothing of ours before it is
        still to come once what has come is read."""
        return int(self._cursor.wal_end)

    def confirm(self, lsn: int) -> None:
        try:
            self._cursor.send_feedback(write_lsn=lsn, flush_lsn=lsn, force=True)
        except self._errors as exc:
            raise DatabaseOpenError(f"replication from {self._where}: {exc}") from exc

    def close(self) -> None:
        _close(self)


class ExportedSnapshot:
    """A snapshot of the database consistent with a slot's start, for the rows a capture
    streams first (``--snapshot``): a temporary slot made with ``EXPORT_SNAPSHOT``.
    ``name`` is for ``SET TRANSACTION SNAPSHOT`` (valid until ``close``); every
    transaction whose commit record is before ``lsn`` is in it, every later one is not.
    Making it waits for the transactions open at that moment to end."""

    def __init__(self, url: str, where: str, slot: str, *, temporary: bool = True) -> None:
        psycopg2 = _psycopg2()
        try:
            self._conn = _replication_connection(psycopg2, url, "streamq snapshot")
            cursor = self._conn.cursor()
            # A temporary slot goes with this connection; the snapshot while it runs
            # nothing else.
            kind = "TEMPORARY LOGICAL" if temporary else "LOGICAL"
            cursor.execute(f'CREATE_REPLICATION_SLOT "{slot}" {kind} pgoutput EXPORT_SNAPSHOT')
            _, consistent_point, self.name, _ = cursor.fetchone()
        except psycopg2.Error as exc:
            self.close()
            raise cannot_open(where, url, exc) from exc
        self.lsn = parse_lsn(consistent_point)

    def close(self) -> None:
        _close(self)


def _replication_connection(psycopg2: Any, url: str, name: str) -> Any:
    return psycopg2.connect(
        url,
        connection_factory=psycopg2.extras.LogicalReplicationConnection,
        application_name=name,
        connect_timeout=10,
    )


def _close(holder: Any) -> None:
    conn = getattr(holder, "_conn", None)
    if conn is not None and not conn.closed:
        conn.close()

"""PostgreSQL's ``pgoutput`` logical decoding messages, protocol version 1, decoded: pure
functions of bytes, no connection (the capture's sans-IO layer, ``capture.py``).

The format is PostgreSQL's "Logical Replication Message Formats" (chapter 55.9 of its
manual). Version 1 is what every server since 10 speaks, without streamed (in-progress)
transactions: a transaction arrives whole, after its commit, as BEGIN, its changes, then
COMMIT; RELATION describes a table before its first change in a session and again after
its columns change; values are in their text form (``TupleData``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# PostgreSQL's epoch (2000-01-01 UTC) in microseconds since the Unix epoch.
_PG_EPOCH_US = 946_684_800_000_000

_INT8, _INT16, _INT32, _INT64 = (
    struct.Struct("!b"),
    struct.Struct("!h"),
    struct.Struct("!i"),
    struct.Struct("!q"),
)
_UINT32, _UINT64 = struct.Struct("!I"), struct.Struct("!Q")


class DecodeError(ValueError):
    """Bytes that are not a pgoutput message of protocol version 1."""


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int  # the commit record's LSN
    commit_time_us: int  # microseconds since the Unix epoch
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int  # just past the commit record: a slot advanced here has passed it
    commit_time_us: int


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool  # part of the replica identity (the primary key, or every column if FULL)


@dataclass(frozen=True, slots=True)
class Relation:
    relation_id: int  # the table's OID
    namespace: str
    name: str
    replica_identity: str  # "d" default, "n" nothing, "f" full, "i" index
    columns: tuple[Column, ...]

    @property
    def table(self) -> str:
        return f"{self.namespace or 'pg_catalog'}.{self.name}"


# A row's values in column order: the text form, None for NULL, UNCHANGED for a TOASTed
# value the change did not touch (its value is not in the WAL).
Value = bytes | None


class Unchanged:
    """The type of ``UNCHANGED``."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = Unchanged()
Tuple = tuple[Value | Unchanged, ...]


@dataclass(frozen=True, slots=True)
class Insert:
    relation_id: int
    new: Tuple


@dataclass(frozen=True, slots=True)
class Update:
    relation_id: int
    new: Tuple
    # The old row's replica identity ("K": its key columns, only when the key changed) or
    # whole row ("O": REPLICA IDENTITY FULL); None when the server sent neither.
    old: Tuple | None
    old_kind: str | None


@dataclass(frozen=True, slots=True)
class Delete:
    relation_id: int
    old: Tuple
    old_kind: str  # "K" or "O", as for Update


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_ids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Type:
    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """What ``pg_logical_emit_message`` wrote (sent with the ``messages`` option): a
    transactional one arrives inside its transaction, between BEGIN and COMMIT."""

    transactional: bool
    lsn: int  # the message's own position in the WAL
    prefix: str
    content: bytes


Message = (
    Begin | Commit | Relation | Insert | Update | Delete | Truncate | Origin | Type | LogicalMessage
)


class _Reader:
    """A cursor over one message's bytes."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, size: int) -> bytes:
        end = self.at + size
        if size < 0 or end > len(self.data):
            raise DecodeError(f"message ends at byte {len(self.data)}, {size} more wanted")
        chunk, self.at = self.data[self.at : end], end
        return chunk

    def unpack(self, form: struct.Struct) -> int:
        value: int = form.unpack(self.take(form.size))[0]
        return value

    def byte(self) -> str:
        return chr(self.take(1)[0])

    def string(self) -> str:
        end = self.data.find(b"\0", self.at)
        if end < 0:
            raise DecodeError("a string without its terminating NUL")
        text, self.at = self.data[self.at : end], end + 1
        return text.decode("utf-8")

    def done(self) -> None:
        if self.at != len(self.data):
            raise DecodeError(f"{len(self.data) - self.at} bytes after the message")


def _time(reader: _Reader) -> int:
    return reader.unpack(_INT64) + _PG_EPOCH_US


def _tuple(reader: _Reader) -> Tuple:
    values: list[Value | Unchanged] = []
    for _ in range(reader.unpack(_INT16)):
        kind = reader.byte()
        if kind == "n":
            values.append(None)
        elif kind == "u":
            values.append(UNCHANGED)
        elif kind == "t":
            values.append(reader.take(reader.unpack(_INT32)))
        else:  # "b" needs the binary option, which the capture never asks for
            raise DecodeError(f"a column of kind {kind!r}")
    return tuple(values)


def _relation(reader: _Reader) -> Relation:
    relation_id, namespace, name = reader.unpack(_UINT32), reader.string(), reader.string()
    identity = reader.byte()
    columns = []
    for _ in range(reader.unpack(_INT16)):
        flags = reader.unpack(_INT8)
        column_name = reader.string()
        columns.append(
            Column(column_name, reader.unpack(_UINT32), reader.unpack(_INT32), bool(flags & 1))
        )
    return Relation(relation_id, namespace, name, identity, tuple(columns))


def _update(reader: _Reader) -> Update:
    relation_id = reader.unpack(_UINT32)
    kind = reader.byte()
    old, old_kind = None, None
    if kind in ("K", "O"):
        old, old_kind = _tuple(reader), kind
        kind = reader.byte()
    if kind != "N":
        raise DecodeError(f"an UPDATE's new row marked {kind!r}")
    return Update(relation_id, _tuple(reader), old, old_kind)


def _delete(reader: _Reader) -> Delete:
    relation_id, kind = reader.unpack(_UINT32), reader.byte()
    if kind not in ("K", "O"):
        raise DecodeError(f"a DELETE's old row marked {kind!r}")
    return Delete(relation_id, _tuple(reader), kind)


def _insert(reader: _Reader) -> Insert:
    relation_id, kind = reader.unpack(_UINT32), reader.byte()
    if kind != "N":
        raise DecodeError(f"an INSERT's row marked {kind!r}")
    return Insert(relation_id, _tuple(reader))


def _truncate(reader: _Reader) -> Truncate:
    count, options = reader.unpack(_INT32), reader.unpack(_INT8)
    ids = tuple(reader.unpack(_UINT32) for _ in range(count))
    return Truncate(ids, bool(options & 1), bool(options & 2))


def decode(data: bytes) -> Message:
    """One pgoutput message (protocol version 1); ``DecodeError`` if it is not one."""
    if not data:
        raise DecodeError("an empty message")
    reader = _Reader(data)
    kind = reader.byte()
    message: Message
    try:
        if kind == "B":
            message = Begin(reader.unpack(_UINT64), _time(reader), reader.unpack(_UINT32))
        elif kind == "C":
            reader.unpack(_INT8)  # flags, unused
            message = Commit(reader.unpack(_UINT64), reader.unpack(_UINT64), _time(reader))
        elif kind == "R":
            message = _relation(reader)
        elif kind == "I":
            message = _insert(reader)
        elif kind == "U":
            message = _update(reader)
        elif kind == "D":
            message = _delete(reader)
        elif kind == "T":
            message = _truncate(reader)
        elif kind == "O":
            message = Origin(reader.unpack(_UINT64), reader.string())
        elif kind == "M":
            transactional, lsn = bool(reader.unpack(_INT8) & 1), reader.unpack(_UINT64)
            prefix = reader.string()
            message = LogicalMessage(transactional, lsn, prefix, reader.take(reader.unpack(_INT32)))
        elif kind == "Y":
            message = Type(reader.unpack(_UINT32), reader.string(), reader.string())
        else:
            raise DecodeError(f"unknown message type {kind!r}")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"a name that is not UTF-8: {exc}") from exc
    reader.done()
    return message


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL writes it: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)

"""Captured row changes as streamq records: pgoutput messages in, each committed
transaction's records out. Sans-IO: no connection, the capture (``capture.py``) feeds it.

A change record's value is a msgpack map (docs/guides/capture.md, "The change format"):

- ``op``: ``"insert"``, ``"update"``, ``"delete"`` or ``"truncate"``, and ``"snapshot"``
  for a row as a snapshot read it (``--snapshot``: the table's rows before its changes);
- ``table``: the table, ``schema.name``;
- ``new``: the row after the change, ``{column: value}`` (None for a delete or truncate);
  a TOASTed value an update left as it was is not in the WAL: that column is missing
  from ``new`` and named in ``unchanged``;
- ``old``: before an update or delete, what the table's ``REPLICA IDENTITY`` gives: its
  key columns (the default: on a delete, and on an update that changed the key), the
  whole row (``FULL``), else None;
- ``xid``, ``lsn`` (the commit record's, as an integer), ``commit_time`` (ms since the
  Unix epoch, also the record's timestamp), ``index`` and ``changes``: this change's
  place among the transaction's captured changes, and how many there are, over every
  captured table: a consumer of several tables' streams regroups a transaction by
  ``(lsn, xid)``, and knows when it holds all of it. A snapshot is one such group: its
  LSN is the point it is consistent with (what committed before it is in the rows, what
  committed after comes as changes), its xid None.

The record's key is the row's primary key as compact JSON (``{"id":42}``), or its
replica identity's columns for a table without one. Values are plain msgpack (and JSON)
types: bool, integers and floats, text, ``bytea`` as bytes, ``json``/``jsonb`` as what
they hold, arrays as lists; ``numeric`` as its exact text (``"12.50"``); dates, times
and timestamps in ISO 8601 (``timestamptz`` in UTC); every other type as PostgreSQL's
text form of it (``interval``, ``uuid``, enums, ranges, ...).
"""

from __future__ import annotations

import datetime
import functools
import json
import json.encoder
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ...captured import HEADER, HEADER_VALUE, json_default
from ...records import CheckedRecord
from . import pgoutput
from .pgoutput import UNCHANGED, Relation

# Types whose text form is loaded into a plain value (psycopg's loaders), their arrays
# too; every other type stays text (the module docstring). The text ones are decoded.
_LOADED = (
    "bool", "int2", "int4", "int8", "oid", "float4", "float8", "numeric", "bytea", "json",
    "jsonb", "timestamptz", "timestamp", "date", "time",
)  # fmt: skip
_TEXT = ("text", "varchar", "bpchar", "name", "uuid")
# Of those, the types psycopg loads as plain values already, which never fail to load.
_PLAIN = ("bool", "int2", "int4", "int8", "oid", "float4", "float8")


@functools.cache
def _oids() -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """The OIDs of the types loaded (with their arrays, and the text types' arrays), of
    the text types, and of the types loaded as plain values."""
    from psycopg.postgres import types

    loaded = {types[name].oid for name in _LOADED}
    arrays = {types[name].array_oid for name in (*_LOADED, *_TEXT)}
    text = frozenset(types[name].oid for name in _TEXT)
    return frozenset(loaded | arrays), text, frozenset(types[name].oid for name in _PLAIN)


# Tuples, not ``bool | int | ...``: a union is a new object at each evaluation, which made
# half of a change's cost.
_AS_THEY_ARE = (bool, int, float, str, bytes)
_ISO_8601 = (datetime.date, datetime.time)
_PASSED_OVER = (pgoutput.Origin, pgoutput.Type)  # messages no change comes from


def plain(value: Any) -> Any:
    """A loaded value as msgpack and JSON types (the module docstring)."""
    if value is None or isinstance(value, _AS_THEY_ARE):
        return value
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, _ISO_8601):
        return value.isoformat()
    return str(value)  # Decimal: its exact text; UUID


def _loader(type_oid: int) -> Callable[[bytes], Any]:
    """How a column's text form becomes its value."""
    loaded, text, plain_types = _oids()
    if type_oid in text:
        return lambda data: data.decode("utf-8")
    if type_oid not in loaded:
        return lambda data: data.decode("utf-8", "backslashreplace")
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    load: Callable[[bytes], Any] = Transformer().get_loader(type_oid, Format.TEXT).load
    if type_oid in plain_types:
        return load  # no conversion, nothing to catch: one call less per value

    def loaded_value(data: bytes) -> Any:
        try:
            return plain(load(data))
        except Exception:  # beyond Python's types ('infinity', year 10000): as text
            return data.decode("utf-8", "backslashreplace")

    return loaded_value


@dataclass
class _Table:
    relation: Relation
    stream: str | None  # None: not captured (any more)
    loaders: list[Callable[[bytes], Any]]
    key: list[int]  # the key's columns, by position
    key_names: list[str]  # as JSON, each followed by ":" (``_key``)

    def value(self, column: int, value: pgoutput.Value | pgoutput.Unchanged) -> Any:
        """A column's value, loaded (UNCHANGED: None)."""
        if value is None or value is UNCHANGED:
            return None
        return self.loaders[column](value)  # type: ignore[arg-type]


def table_of(
    relation: Relation, streams: Mapping[str, str], keys: Mapping[str, Sequence[str]]
) -> _Table:
    """How a table's changes become records: its stream (None: not captured), each
    column's loader, and its key's columns (the primary key's, else the replica
    identity's)."""
    names = [c.name for c in relation.columns]
    primary = keys.get(relation.table, [])
    if primary and all(name in names for name in primary):
        key = [names.index(name) for name in primary]
    else:
        key = [i for i, c in enumerate(relation.columns) if c.key]
    loaders = [_loader(c.type_oid) for c in relation.columns]
    key_names = [_json_string(names[i]) + ":" for i in key]
    return _Table(relation, streams.get(relation.table), loaders, key, key_names)


@dataclass(frozen=True, slots=True)
class Captured:
    """One committed transaction's captured changes, as records of their streams in
    commit order, the slot position just past it, and its (32-bit) transaction id."""

    end_lsn: int
    records: list[tuple[str, CheckedRecord]]
    xid: int = 0


@dataclass
class _Open:
    begin: pgoutput.Begin
    changes: list[tuple[str, bytes | None, dict[str, Any]]] = field(default_factory=list)


class ChangeDecoder:
    """pgoutput messages (``feed``), in the order the slot gives them, to ``Captured``
    transactions. ``streams``: each captured table's stream (``schema.name``: stream);
    ``keys``: each table's primary key columns, where it has one. A change to a table not
    in ``streams`` is left out: the WAL from before a table left the capture still has
    it in the publication. ``snapshots``: the tables whose rows were published as of a
    snapshot, with its LSN: their changes committed before it are in it, left out."""

    def __init__(
        self,
        streams: Mapping[str, str],
        keys: Mapping[str, Sequence[str]],
        snapshots: Mapping[str, int] | None = None,
    ) -> None:
        self.streams, self.keys = dict(streams), {t: list(k) for t, k in keys.items()}
        self.snapshots = dict(snapshots or {})
        self._tables: dict[int, _Table] = {}
        self._open: _Open | None = None

    @property
    def between_transactions(self) -> bool:
        """No transaction begun and not yet committed."""
        return self._open is None

    def feed(self, data: bytes) -> Captured | None:
        """One message; the transaction it ends, if it is a COMMIT."""
        message = pgoutput.decode(data)
        if isinstance(message, pgoutput.Begin):
            self._open = _Open(message)
            return None
        if isinstance(message, pgoutput.Relation):
            self._relation(message)
            return None
        if isinstance(message, _PASSED_OVER):
            return None
        tx = self._open
        if tx is None:
            raise pgoutput.DecodeError(f"{type(message).__name__} outside a transaction")
        if isinstance(message, pgoutput.Commit):
            self._open = None
            return self._captured(tx, message)
        if isinstance(message, pgoutput.Truncate):
            for relation_id in message.relation_ids:
                table = self._table(relation_id)
                if (stream := self._stream(tx, table)) is not None:
                    tx.changes.append((stream, None, _change("truncate", table, None, None)))
            return None
        if not isinstance(message, pgoutput.LogicalMessage):  # capture asks for none
            self._change(tx, message)
        return None

    def _relation(self, relation: Relation) -> None:
        self._tables[relation.relation_id] = table_of(relation, self.streams, self.keys)

    def _table(self, relation_id: int) -> _Table:
        table = self._tables.get(relation_id)
        if table is None:
            raise pgoutput.DecodeError(f"a change to relation {relation_id} before its RELATION")
        return table

    def _change(
        self, tx: _Open, message: pgoutput.Insert | pgoutput.Update | pgoutput.Delete
    ) -> None:
        table = self._table(message.relation_id)
        if (stream := self._stream(tx, table)) is None:
            return
        if isinstance(message, pgoutput.Insert):
            op, new, old, old_kind = "insert", message.new, None, None
        elif isinstance(message, pgoutput.Update):
            op, new, old, old_kind = "update", message.new, message.old, message.old_kind
        else:
            op, new, old, old_kind = "delete", None, message.old, message.old_kind
        new_row = None if new is None else _row(table, new)
        old_row = None if old is None else _row(table, old, only_key=old_kind == "K")
        change = _change(op, table, new_row, old_row)
        if new is not None and (unchanged := _unchanged(table, new)):
            change["unchanged"] = unchanged
        keyed = new if new is not None else old
        key = None if keyed is None else _key(table, keyed)
        tx.changes.append((stream, key, change))

    def _stream(self, tx: _Open, table: _Table) -> str | None:
        """The stream a change of ``tx`` to ``table`` goes to; None if the table is not
        captured, or the change is in the snapshot its rows were published as of."""
        snapshot = self.snapshots.get(table.relation.table)
        if snapshot is not None and tx.begin.final_lsn < snapshot:
            return None
        return table.stream

    def _captured(self, tx: _Open, commit: pgoutput.Commit) -> Captured:
        commit_ms = commit.commit_time_us // 1000
        total = len(tx.changes)
        records = [
            _record(stream, key, change, tx.begin.xid, commit.commit_lsn, commit_ms, i, total)
            for i, (stream, key, change) in enumerate(tx.changes)
        ]
        return Captured(commit.end_lsn, records, tx.begin.xid)


def snapshot_records(
    table: _Table,
    rows: Sequence[pgoutput.Tuple],
    lsn: int,
    time_ms: int,
    first: int,
    total: int,
) -> list[tuple[str, CheckedRecord]]:
    """Rows a snapshot read (each column's text form, or None for NULL) as records of
    the table's stream: ``"op": "snapshot"``, the row in ``new``, the snapshot's LSN, no
    xid; ``first``: the first's index among the ``total`` rows of the snapshot."""
    assert table.stream is not None
    return [
        _record(
            table.stream,
            _key(table, values),
            _change("snapshot", table, _row(table, values), None),
            None,
            lsn,
            time_ms,
            first + i,
            total,
        )
        for i, values in enumerate(rows)
    ]


def _record(
    stream: str,
    key: bytes | None,
    change: dict[str, Any],
    xid: int | None,
    lsn: int,
    time_ms: int,
    index: int,
    total: int,
) -> tuple[str, CheckedRecord]:
    change.update(xid=xid, lsn=lsn, commit_time=time_ms, index=index, changes=total)
    value = _pack(change)
    return stream, (value, key, {HEADER: HEADER_VALUE}, time_ms)


def _change(
    op: str, table: _Table, new: dict[str, Any] | None, old: dict[str, Any] | None
) -> dict[str, Any]:
    return {"op": op, "table": table.relation.table, "new": new, "old": old}


def _row(table: _Table, values: pgoutput.Tuple, only_key: bool = False) -> dict[str, Any]:
    """The row's columns (only its replica identity's with ``only_key``: the others are
    NULL in such an old row, not known)."""
    columns = table.relation.columns
    wanted = [i for i, c in enumerate(columns) if c.key] if only_key else range(len(values))
    return {
        columns[i].name: table.value(i, values[i]) for i in wanted if values[i] is not UNCHANGED
    }


def _unchanged(table: _Table, values: pgoutput.Tuple) -> list[str]:
    return [c.name for c, v in zip(table.relation.columns, values, strict=True) if v is UNCHANGED]


def _key(table: _Table, values: pgoutput.Tuple) -> bytes | None:
    """The row's key as compact JSON, its columns in key order; None without a key.

    Keys of integers and text (nearly all) are written here, as the encoder would write
    them, at a fifth of its cost a change; any other goes through the encoder."""
    if not table.key:
        return None
    key = [table.value(i, values[i]) for i in table.key]
    parts = []
    for name, value in zip(table.key_names, key, strict=True):
        if type(value) is int:
            parts.append(name + str(value))
        elif type(value) is str:
            parts.append(name + _json_string(value))
        else:
            columns = table.relation.columns
            named = {columns[i].name: v for i, v in zip(table.key, key, strict=True)}
            return _KEY_JSON(named).encode()
    return ("{" + ",".join(parts) + "}").encode()


# One encoder for every key: ``json.dumps`` with options makes one per call.
_KEY_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=json_default).encode
# A str as that encoder writes it (``ensure_ascii=False``), in C.
_json_string: Callable[[str], str] = json.encoder.encode_basestring
# One packer for every change: ``msgpack.packb`` makes one per call.
_pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack

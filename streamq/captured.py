"""Captured tables, engine-free: which tables a producer captures (as
``Producer(capture=...)`` names them, checked before any database is opened), and the
change records' format as a consumer reads them (docs/guides/capture.md). The capture
itself is PostgreSQL's: ``engines/postgres/capture.py`` and ``changes.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from .protocol import Record

# A change record's one header: what its value is.
HEADER, HEADER_VALUE = "streamq-change", b"msgpack/1"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")  # an identifier PostgreSQL takes unquoted


def capture_streams(capture: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``{schema.table: stream}`` from what ``Producer(capture=...)`` was given: table
    names (``orders`` is ``public.orders``; its stream is ``public.orders``), or a map of
    table names to stream names."""
    pairs = capture.items() if isinstance(capture, Mapping) else ((t, None) for t in capture)
    streams: dict[str, str] = {}
    for table, stream in pairs:
        if not isinstance(table, str) or not all(_NAME.match(p) for p in table.split(".")):
            raise ValueError(f"capture: not a table name (schema.table): {table!r}")
        if table.count(".") > 1:
            raise ValueError(f"capture: not a table name (schema.table): {table!r}")
        qualified = table if "." in table else f"public.{table}"
        if qualified in streams:
            raise ValueError(f"capture: {qualified} named twice")
        streams[qualified] = stream or qualified
    if not streams:
        raise ValueError("capture: no table named")
    return streams


def decode_change(value: bytes) -> dict[str, Any]:
    """A captured change record's value as a dict: ``op``, ``table``, ``new``, ``old``,
    ``xid``, ``lsn``, ``commit_time``, ``index``, ``changes`` (and ``unchanged``, when an
    update left TOASTed values out); docs/guides/capture.md has the format."""
    change: dict[str, Any] = msgpack.unpackb(value, raw=False)
    return change


def change_json(value: bytes) -> str:
    """A captured change record's value as one line of JSON (bytes as hex strings)."""
    return json.dumps(decode_change(value), separators=(",", ":"), default=json_default)


def text(data: bytes | None) -> str | None:
    """Bytes a person reads: UTF-8, anything else escaped (``\\xff``)."""
    return None if data is None else data.decode("utf-8", "backslashreplace")


def record_json(record: Record) -> dict[str, Any]:
    """A record as JSON takes it (``streamq tail --json``, the console): a captured
    change's value as its dict, other bytes as text (``json_default`` for what is left)."""
    captured = record.headers.get(HEADER) == HEADER_VALUE
    return {
        "seq": record.seq,
        "timestamp": record.timestamp,
        "key": text(record.key),
        "value": decode_change(record.value) if captured else text(record.value),
        "headers": {k: text(v) for k, v in record.headers.items()},
    }


def json_default(value: Any) -> Any:
    """What JSON lacks: bytes as hex strings."""
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"not JSON: {type(value).__name__}")

"""Server-side filters: which records a subscription or a range read wants ("Filters" in
docs/protocol.md).

A consumer that wants 1 % of a stream asks the producer for that 1 %, and the producer
skips the rest before it reaches the socket. A filter is a key prefix, header matches
and a share of the keys (``share=(index, count)``: the records whose key hashes to
``index`` modulo ``count``), all of which must hold. Pure data and matching: the
protocol decodes filters with ``Filter.from_wire``, the server matches stored record
encodings with ``Filter.select``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

# Bounds on what a peer may ask: a filter is evaluated on every record the producer reads.
MAX_KEY_PREFIX = 1024  # bytes
MAX_HEADER_MATCHES = 16
MAX_HEADER_VALUE = 1024  # bytes
MAX_SHARES = 1 << 16
_FIELDS = frozenset(("key_prefix", "headers", "share"))


class FilterError(ValueError):
    """A filter that cannot be evaluated (the protocol reports it as MALFORMED_FRAME)."""


def share_of(key: bytes | None, count: int) -> int:
    """The share a key belongs to among ``count``: CRC-32 (zlib's, ISO-HDLC) of the key
    modulo ``count``. Records without a key are share 0. Every producer computes it the
    same way, so a share is the same set of keys whoever serves it."""
    if key is None:
        return 0
    return zlib.crc32(key) % count


def share_name(consumer: str, share: tuple[int, int]) -> str:
    """The name a share of ``consumer`` stores its position and reports it under:
    ``billing[2/8]``. Each share is a consumer of its own to retention and lag."""
    return f"{consumer}[{share[0]}/{share[1]}]"


def names_for(consumer: str, shares: int) -> tuple[str, ...]:
    """The position names of a split into ``shares`` (1: the consumer's own name)."""
    if shares == 1:
        return (consumer,)
    return tuple(share_name(consumer, (i, shares)) for i in range(shares))


def split_share_name(name: str) -> tuple[str, tuple[int, int]] | None:
    """``share_name`` backwards, whoever the consumer: (consumer, (index, count)), or None
    if ``name`` is no share's."""
    consumer, bracket, _ = name.rpartition("[")
    share = shared_as(consumer, name) if bracket else None
    return None if share is None else (consumer, share)


def shared_as(consumer: str, name: str) -> tuple[int, int] | None:
    """``share_name`` backwards: (index, count) if ``name`` is a share of ``consumer``'s
    (``consumer[i/n]``, a valid share), else None."""
    prefix = consumer + "["
    if not (name.startswith(prefix) and name.endswith("]")):
        return None
    index, slash, count = name[len(prefix) : -1].partition("/")
    if not (slash and index.isdigit() and count.isdigit()):
        return None
    share = int(index), int(count)
    return share if 0 <= share[0] < share[1] <= MAX_SHARES else None


@dataclass(frozen=True, slots=True)
class Filter:
    """Records whose key starts with ``key_prefix``, whose headers include every entry of
    ``headers`` (same name, same bytes), and, with ``share=(index, count)``, whose key is
    in that share (``share_of``). Unset parts match everything; a key prefix never
    matches a record without a key."""

    key_prefix: bytes | None = None
    headers: Mapping[str, bytes] = field(default_factory=dict)
    share: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.key_prefix is not None:
            if type(self.key_prefix) is not bytes:
                raise FilterError(f"key_prefix must be bytes, not {type(self.key_prefix).__name__}")
            if len(self.key_prefix) > MAX_KEY_PREFIX:
                raise FilterError(f"key_prefix of {len(self.key_prefix)} bytes: at most 1024")
        if type(self.headers) is not dict:
            object.__setattr__(self, "headers", dict(self.headers))
        if len(self.headers) > MAX_HEADER_MATCHES:
            raise FilterError(f"{len(self.headers)} header matches: at most {MAX_HEADER_MATCHES}")
        for name, value in self.headers.items():
            if type(name) is not str or type(value) is not bytes:
                raise FilterError("header matches map names (str) to values (bytes)")
            if len(value) > MAX_HEADER_VALUE:
                raise FilterError(
                    f"header {name!r}: value of {len(value)} bytes, at most {MAX_HEADER_VALUE}"
                )
        if self.share is not None:
            share = tuple(self.share)
            if not (
                len(share) == 2
                and all(type(n) is int for n in share)
                and 1 <= share[1] <= MAX_SHARES
                and 0 <= share[0] < share[1]
            ):
                raise FilterError(
                    f"share must be (index, count) with 0 <= index < count <= {MAX_SHARES}, "
                    f"not {self.share!r}"
                )
            object.__setattr__(self, "share", share)

    def __hash__(self) -> int:
        return hash((self.key_prefix, tuple(sorted(self.headers.items())), self.share))

    @property
    def everything(self) -> bool:
        """True if the filter passes every record (no part is set)."""
        return (
            self.key_prefix is None
            and not self.headers
            and (self.share is None or self.share[1] == 1)
        )

    def matches(self, key: bytes | None, headers: Mapping[str, bytes]) -> bool:
        """True if a record with this key and these headers passes the filter."""
        prefix = self.key_prefix
        if prefix is not None and (key is None or not key.startswith(prefix)):
            return False
        for name, value in self.headers.items():
            if headers.get(name) != value:
                return False
        share = self.share
        return share is None or share_of(key, share[1]) == share[0]

    def select(self, encoded_records: Sequence[bytes]) -> list[bytes]:
        """The stored record encodings (``protocol.encode_record``) that match."""
        unpack = msgpack.unpackb
        matches = self.matches
        chosen = []
        for encoded in encoded_records:
            record = unpack(encoded, raw=False)
            if matches(record[2], record[4]):
                chosen.append(encoded)
        return chosen

    def to_wire(self) -> dict[str, Any]:
        """The filter map of SUBSCRIBE and GET_RANGE; unset parts are left out."""
        wire: dict[str, Any] = {}
        if self.key_prefix is not None:
            wire["key_prefix"] = self.key_prefix
        if self.headers:
            wire["headers"] = dict(self.headers)
        if self.share is not None:
            wire["share"] = list(self.share)
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> Filter:
        """A filter map as a peer sent it; raises ``FilterError`` saying what is wrong."""
        if type(wire) is not dict:
            raise FilterError("a filter must be a map")
        unknown = set(wire) - _FIELDS
        if unknown:
            raise FilterError(f"unknown filter fields: {', '.join(sorted(map(str, unknown)))}")
        headers = wire.get("headers", {})
        if type(headers) is not dict:
            raise FilterError("filter.headers must be a map")
        share = wire.get("share")
        if share is not None:
            if type(share) is not list:
                raise FilterError("filter.share must be [index, count]")
            share = tuple(share)
        return cls(wire.get("key_prefix"), headers, share)

    def describe(self) -> str:
        """For status and logs: ``key_prefix=b'order-' type=b'paid' share=2/8``."""
        parts = []
        if self.key_prefix is not None:
            parts.append(f"key_prefix={self.key_prefix!r}")
        parts += [f"{name}={value!r}" for name, value in self.headers.items()]
        if self.share is not None:
            parts.append(f"share={self.share[0]}/{self.share[1]}")
        return " ".join(parts) or "everything"

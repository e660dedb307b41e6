"""``streamq`` (also ``python -m streamq``): serve, publish, tail, history, status, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table

from . import _loop, store
from .client import Client
from .consumer import Consumer, parse_address
from .errors import StreamQError
from .log import Log
from .producer import Producer
from .protocol import Record, decode_record

DEFAULT_PORT = 7400


def _header(text: str) -> tuple[str, bytes]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"header must be NAME=VALUE, not {text!r}")
    return name, value.encode()


def _timestamp(text: str) -> int:
    """Milliseconds since the epoch, or an ISO 8601 date-time (UTC unless it names a zone)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"time must be milliseconds since the epoch or ISO 8601, not {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamq",
        description="Producer-owned streams: the log lives in the producer's SQLite database.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve a producer database to consumers")
    serve.add_argument("db", help="the producer's SQLite database")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    serve.add_argument(
        "--durability",
        choices=["normal", "full"],
        default="normal",
        help="SQLite synchronous mode: full survives power loss",
    )
    serve.add_argument("--create", action="store_true", help="create the database if missing")

    publish = commands.add_parser("publish", help="publish records in one transaction")
    publish.add_argument("db", help="the producer's SQLite database (created if missing)")
    publish.add_argument("stream")
    publish.add_argument("values", nargs="*", help="record values; none: one per stdin line")
    publish.add_argument("--key", help="key for every record")
    publish.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="header for every record (repeatable)",
    )

    tail = commands.add_parser("tail", help="print a stream's records as they are committed")
    tail.add_argument("address", help="producer HOST:PORT")
    tail.add_argument("stream")
    tail.add_argument(
        "--from",
        dest="start",
        type=int,
        default=None,
        metavar="SEQ",
        help="first seq (default: only new records)",
    )
    tail.add_argument(
        "--from-time",
        dest="start_time",
        type=_timestamp,
        default=None,
        metavar="TIME",
        help="start at the first record stamped at or after TIME "
        "(ms since the epoch, or ISO 8601 such as 2026-11-22T09:00, UTC unless given)",
    )
    tail.add_argument("--count", type=int, default=None, help="stop after this many records")
    tail.add_argument("--json", action="store_true", help="one JSON object per record")

    history = commands.add_parser(
        "history",
        help="every record of one key, in seq order (an index seek if the stream has key_index)",
    )
    history.add_argument("source", metavar="DB_OR_ADDRESS", help="database file or HOST:PORT")
    history.add_argument("stream")
    history.add_argument("key", help="the key (UTF-8)")
    history.add_argument(
        "--from", dest="start", type=int, default=1, metavar="SEQ", help="first seq to consider"
    )
    history.add_argument("--json", action="store_true", help="one JSON object per record")

    status = commands.add_parser("status", help="streams, heads, consumers and their lag")
    status.add_argument("address", help="producer HOST:PORT")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")

    demo = commands.add_parser(
        "demo", help="an embedded producer and a crashing consumer, applied exactly once"
    )
    demo.add_argument("--seconds", type=float, default=12.0, help="how long to produce")
    demo.add_argument("--kills", type=int, default=3, help="times the consumer is killed -9")
    demo.add_argument("--dir", default=None, help="where the databases go (default: a temp dir)")
    demo_consumer = commands.add_parser("demo-consumer")  # the demo's consumer process
    demo_consumer.add_argument("address")
    demo_consumer.add_argument("db")
    return parser


async def _serve(args: argparse.Namespace) -> None:
    if not args.create and not os.path.exists(args.db):
        raise SystemExit(f"streamq serve: {args.db} does not exist (use --create to make it)")
    async with Producer(args.db, host=args.host, port=args.port, durability=args.durability) as p:
        streams = ", ".join(f"{s.name}@{s.head}" for s in p.log.streams.values()) or "none yet"
        print(f"serving producer {p.producer_id} (epoch {p.epoch}) on {p.address}", flush=True)
        print(f"streams: {streams}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()


async def _publish(args: argparse.Namespace) -> None:
    values = [v.encode() for v in args.values] or [line.rstrip("\n").encode() for line in sys.stdin]
    key = None if args.key is None else args.key.encode()
    headers = dict(args.header)
    async with Producer(args.db, serve=False) as producer, producer.transaction() as tx:
        seqs = [await tx.publish(args.stream, v, key=key, headers=headers) for v in values]
    if seqs:
        print(f"published {len(seqs)} record(s) to {args.stream!r}: seq {seqs[0]}..{seqs[-1]}")


def _format(record: Record, as_json: bool) -> str:
    def text(data: bytes | None) -> str | None:
        return None if data is None else data.decode("utf-8", "backslashreplace")

    if as_json:
        return json.dumps(
            {
                "seq": record.seq,
                "timestamp": record.timestamp,
                "key": text(record.key),
                "value": text(record.value),
                "headers": {k: text(v) for k, v in record.headers.items()},
            }
        )
    key = "" if record.key is None else f" key={text(record.key)}"
    return f"{record.seq}\t{record.timestamp}{key}\t{text(record.value)}"


async def _tail(args: argparse.Namespace) -> None:
    if args.start is not None and args.start_time is not None:
        raise SystemExit("streamq tail: give --from or --from-time, not both")
    start = args.start
    if start is None and args.start_time is None:
        start = await asyncio.to_thread(_head, args.address, args.stream) + 1
    printed = 0
    async with Consumer(
        args.address,
        args.stream,
        start_seq=start or 1,
        start_time=args.start_time,
        name="streamq-tail",
    ) as c:
        async for batch in c:
            for record in batch:
                print(_format(record, args.json), flush=True)
                printed += 1
                if args.count is not None and printed >= args.count:
                    return


async def _history_from_file(path: str, stream: str, key: bytes, start: int) -> list[Record]:
    """Read a producer's database directly, read-only: no producer needs to run."""
    log = Log(path, tail_bytes=0, readers=1)
    try:
        conn = await store.open_reader(path)
        try:
            rows = await store.load_streams(conn)
        finally:
            await conn.close()
        await log.open(rows)
        encoded = await log.full_history(log.stream(stream), key, start)
    finally:
        await log.close()
    return [decode_record(record) for record in encoded]


def _history(args: argparse.Namespace) -> None:
    key = args.key.encode()
    if os.path.exists(args.source):
        records = _loop.run(_history_from_file(args.source, args.stream, key, args.start))
    else:
        try:
            parse_address(args.source)
        except ValueError:
            raise SystemExit(
                f"streamq history: {args.source} is neither a database file nor HOST:PORT"
            ) from None
        with Client(args.source) as client:
            records = client.history(args.stream, key, args.start)
    for record in records:
        print(_format(record, args.json))


def _head(address: str, stream: str) -> int:
    with Client(address) as client:
        return client.head(stream).head


def _status(args: argparse.Namespace) -> None:
    with Client(args.address) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return
    console = Console()
    console.print(
        f"producer [bold]{status['producer_id']}[/] epoch {status['epoch']} at {args.address}, "
        f"{status['connections']} connection(s)"
    )
    heads = {s["stream"]: s["head"] for s in status["streams"]}
    streams = Table("stream", "head", "first held", title="streams")
    for s in status["streams"]:
        streams.add_row(s["stream"], str(s["head"]), str(s["low"]))
    console.print(streams)
    consumers = Table("consumer", "stream", "peer", "sent", "applied", "lag", title="consumers")
    for c in status["consumers"]:
        lag = heads.get(c["stream"], 0) - c["acked"]
        consumers.add_row(
            c["consumer"], c["stream"], c["peer"], str(c["sent"]), str(c["acked"]), str(lag)
        )
    console.print(consumers)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            _loop.run(_serve(args))
        elif args.command == "publish":
            _loop.run(_publish(args))
        elif args.command == "tail":
            with contextlib.suppress(KeyboardInterrupt):
                _loop.run(_tail(args))
        elif args.command == "history":
            _history(args)
        elif args.command == "status":
            _status(args)
        elif args.command == "demo":
            from .demo import run_demo

            return run_demo(args.seconds, args.kills, args.dir)
        elif args.command == "demo-consumer":
            from .demo import consumer_main

            _loop.run(consumer_main(args.address, args.db))
    except (StreamQError, OSError, sqlite3.Error) as exc:
        print(f"streamq {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0

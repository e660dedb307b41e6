"""``streamq`` (also ``python -m streamq``): serve, publish, tail, status, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from . import _loop
from .client import Client
from .consumer import Consumer
from .errors import StreamQError
from .producer import Producer
from .protocol import Record

DEFAULT_PORT = 7400


def _header(text: str) -> tuple[str, bytes]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"header must be NAME=VALUE, not {text!r}")
    return name, value.encode()


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
        help="full: every commit synced before it returns, survives power loss; normal "
        "(default): survives process crashes, a power loss may roll back the last commits "
        "(consumers that applied them stop with an error naming the seqs)",
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
    tail.add_argument("--count", type=int, default=None, help="stop after this many records")
    tail.add_argument("--json", action="store_true", help="one JSON object per record")

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
    start = args.start
    if start is None:
        start = await asyncio.to_thread(_head, args.address, args.stream) + 1
    printed = 0
    async with Consumer(args.address, args.stream, start_seq=start, name="streamq-tail") as c:
        async for batch in c:
            for record in batch:
                print(_format(record, args.json), flush=True)
                printed += 1
                if args.count is not None and printed >= args.count:
                    return


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
        elif args.command == "status":
            _status(args)
        elif args.command == "demo":
            from .demo import run_demo

            return run_demo(args.seconds, args.kills, args.dir)
        elif args.command == "demo-consumer":
            from .demo import consumer_main

            _loop.run(consumer_main(args.address, args.db))
    except (StreamQError, OSError) as exc:
        print(f"streamq {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0

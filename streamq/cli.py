"""``streamq`` (also ``python -m streamq``): serve, publish, tail, history, status, consumers,
dead-letters, token, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import signal
import sqlite3
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console
from rich.table import Table

from . import __version__, _loop, native
from .captured import HEADER as CHANGE_HEADER
from .captured import HEADER_VALUE as CHANGE_HEADER_VALUE
from .captured import capture_streams, change_json, json_default, record_json, text
from .consumer.consumer import Consumer
from .consumer.database import consumer_database, list_dead_letters, mark_for_retry, reshare
from .consumer.resharing import OnlineMove
from .engines import Engine, for_target, is_postgres_url, open_storage
from .errors import SchemaMissingError, StreamQError
from .filters import Filter, split_share_name
from .producer.committed_log import Log
from .producer.producer import Producer
from .producer.server import ServerSettings
from .protocol import Record, decode_record
from .records import check_stream_name
from .wire.client import Client
from .wire.endpoints import ProviderError, listed_endpoints
from .wire.security import (
    MIN_SECRET_BYTES,
    ClientTLS,
    ServerTLS,
    TokenAuth,
    make_token,
    read_secret,
)
from .wire.status_report import consumer_rows
from .wire.transport import parse_address

if TYPE_CHECKING:
    from .groups.report import MemberRow, ShareRow

DEFAULT_PORT = 7400
TOKEN_ENV = "STREAMQ_TOKEN"
SECRET_ENV = "STREAMQ_TOKEN_SECRET"


class _Parser(argparse.ArgumentParser):
    """A malformed command line is reported in one line, as every other mistake is: what
    is wrong, and where the usage is (argparse's own error prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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


def _stream(text: str) -> str:
    try:
        return check_stream_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _capture(text: str) -> dict[str, str]:
    """``--capture orders,public.customers``: the tables, each into its own stream."""
    try:
        return capture_streams([t.strip() for t in text.split(",") if t.strip()])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _name(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a consumer's name cannot be empty")
    return text


def _token_name(text: str) -> str:
    """A name a token can carry: the token is NAME:DIGEST."""
    if ":" in _name(text):
        raise argparse.ArgumentTypeError(f"a token's consumer name has no ':', not {text!r}")
    return text


def _integer(text: str, low: int, high: int | None = None) -> int:
    """``text`` as an int from ``low`` (to ``high``), or the argument's error saying so."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f"{low} to {high}" if high is not None else f"{low} or more"
        raise argparse.ArgumentTypeError(f"must be {span}, not {text!r}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _port(text: str) -> int:
    """A port to listen on; 0 picks a free one. Larger than 65535 would wrap around."""
    return _integer(text, 0, 65535)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text!r}")
    return value


def _host(text: str) -> str:
    """A host to listen on: a name or an IP address, the port given apart (--port)."""
    if "://" in text:
        raise argparse.ArgumentTypeError(f"give a host name or IP address, not a URL: {text!r}")
    if text.count(":") == 1:  # IPv6 addresses have two or more
        raise argparse.ArgumentTypeError(f"give the host alone and the port with --port: {text!r}")
    return text


def _grant(text: str) -> tuple[str, list[str]]:
    name, sep, patterns = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"grant must be CONSUMER=PATTERN[,PATTERN...], not {text!r}"
        )
    return name, [p for p in patterns.split(",") if p]


def _add_server_security(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "security", "TLS 1.3 and token authentication (default: plain TCP, no tokens)"
    )
    group.add_argument("--tls-cert", metavar="PEM", help="the producer's certificate chain")
    group.add_argument("--tls-key", metavar="PEM", help="its private key")
    group.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA"
    )
    group.add_argument(
        "--token-secret-file",
        metavar="FILE",
        help=f"require tokens made with this secret (or set ${SECRET_ENV}); needs --grant",
    )
    group.add_argument(
        "--grant",
        type=_grant,
        action="append",
        default=[],
        metavar="CONSUMER=PATTERNS",
        help="streams a consumer may read, comma-separated fnmatch patterns (repeatable)",
    )
    group.add_argument(
        "--admin", action="append", default=[], metavar="CONSUMER", help="may read the status"
    )


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security", "for producers serving TLS or requiring tokens")
    group.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    group.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA (implies --tls)")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    group.add_argument("--tls-key", metavar="PEM", help="its private key")
    group.add_argument("--tls-server-name", metavar="NAME", help="name the certificate must have")
    group.add_argument(
        "--token-file", metavar="FILE", help=f"file holding the token (or set ${TOKEN_ENV})"
    )
    group.add_argument("--token", help="the token itself (visible to other users: prefer a file)")


_EPILOG = """\
beyond a broker:
  one key's events     streamq history DB_OR_ADDRESS STREAM KEY
  start at a time      streamq tail ADDRESS STREAM --from-time 2026-11-22T10:00
  lag per consumer     streamq status ADDRESS; Prometheus: serve --metrics-port PORT
  keep until applied   streamq consumers add DB CONSUMER STREAM;
                       serve --retention-ms/--retention-bytes
  TLS and tokens       serve --tls-cert/--tls-key/--token-secret-file/--grant;
                       streamq token
  poison records       Consumer(on_failure=DeadLetter());
                       streamq dead-letters list|retry DB
  consumer groups      streamq groups DB: members, shares, positions
  web console          streamq console ADDRESS DB: streams, lag charts, groups,
                       dead letters, newest records
  only what you want   streamq tail ADDRESS STREAM --key-prefix P --header N=V;
                       Consumer(filter=)
  per-key workers      GroupConsumer(..., shares=n), Consumer(share=(i, n));
                       streamq reshare DB CONSUMER --shares N
In Python: compaction (create_stream(compact=True)), wait_applied, FanInConsumer;
see the documentation (docs/, `make docs`).
"""


DATABASE_HELP = "the producer's database: a SQLite file, or a postgresql:// URL"
CONSUMER_DATABASE_HELP = "the consumer's database: a SQLite file, or a postgresql:// URL"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="streamq",
        description="Producer-owned streams: the log lives in the producer's own database.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"streamq {__version__}, {native.build().describe()}",
        help="the version, and which path runs: compiled or pure Python (STREAMQ_PURE=1)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_init_and_publish(commands)
    _add_readers(commands)
    _add_token(commands)
    _add_consumers(commands)
    _add_dead_letters(commands)
    _add_groups(commands)
    _add_reshare(commands)
    _add_console(commands)
    _add_demo(commands)
    return parser


CAPTURE_OPTION: dict[str, Any] = {
    "type": _capture,
    "default": None,
    "metavar": "TABLES",
    "help": "PostgreSQL: publish every committed change to these tables (comma-separated, "
    "schema.table; orders is public.orders), each to a stream of its name "
    "(docs/guides/capture.md)",
}


def _add_serve(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``serve``: a producer's database served to consumers."""
    serve = commands.add_parser("serve", help="serve a producer database to consumers")
    serve.add_argument("db", help=DATABASE_HELP)
    serve.add_argument("--host", type=_host, default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help="0 picks a free port")
    serve.add_argument(
        "--durability",
        choices=["normal", "full"],
        default="normal",
        help="full: every commit synced before it returns, survives power loss; normal "
        "(default): survives process crashes, a power loss may roll back the last commits "
        "(consumers that applied them stop with an error naming the seqs)",
    )
    serve.add_argument(
        "--init",
        "--create",
        dest="create",
        action="store_true",
        help="create the database or its log tables if missing (else: refused)",
    )
    serve.add_argument("--capture", **CAPTURE_OPTION)
    serve.add_argument(
        "--snapshot",
        action="store_true",
        help="with --capture: each table's current rows first, then its changes (once per "
        "table, consistent with where they start)",
    )
    _add_server_security(serve)
    serve.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port)",
    )
    serve.add_argument(
        "--metrics-host",
        type=_host,
        default="127.0.0.1",
        help="address for metrics (default: loopback)",
    )
    serve.add_argument(
        "--retention-ms",
        type=_non_negative,
        default=None,
        metavar="MS",
        help="delete records older than this",
    )
    serve.add_argument(
        "--retention-bytes",
        type=_non_negative,
        default=None,
        metavar="BYTES",
        help="delete the oldest records while a stream holds more than this",
    )


def _add_init_and_publish(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``init`` and ``publish``: the log's tables, then records, into a producer's database."""
    init = commands.add_parser(
        "init",
        help="create the log tables in a database (the application publishes into it "
        "with streamq.publish)",
    )
    init.add_argument("db", help=DATABASE_HELP + " (a SQLite file is created if missing)")
    init.add_argument(
        "--stream",
        type=_stream,
        action="append",
        default=[],
        metavar="NAME",
        help="create this stream too, so consumers can subscribe before its first record "
        "(repeatable)",
    )
    init.add_argument("--capture", **CAPTURE_OPTION)

    publish = commands.add_parser("publish", help="publish records in one transaction")
    publish.add_argument("db", help=DATABASE_HELP + ", with the log tables (streamq init)")
    publish.add_argument("stream", type=_stream)
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


def _add_readers(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``tail``, ``history`` and ``status``: what a producer holds, read from it."""
    tail = commands.add_parser("tail", help="print a stream's records as they are committed")
    tail.add_argument("address", help="producer HOST:PORT")
    tail.add_argument("stream", type=_stream)
    tail.add_argument(
        "--from",
        dest="start",
        type=_positive,
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
    tail.add_argument("--count", type=_positive, default=None, help="stop after this many records")
    tail.add_argument(
        "--key-prefix",
        default=None,
        metavar="PREFIX",
        help="only records whose key starts with PREFIX (UTF-8), chosen by the producer",
    )
    tail.add_argument(
        "--header",
        action="append",
        type=_header_match,
        default=[],
        metavar="NAME=VALUE",
        help="only records with this header value (repeatable), chosen by the producer",
    )
    tail.add_argument("--json", action="store_true", help="one JSON object per record")
    _add_client_security(tail)

    history = commands.add_parser(
        "history",
        help="every record of one key, in seq order (an index seek if the stream has key_index)",
    )
    history.add_argument("source", metavar="DB_OR_ADDRESS", help="database file or HOST:PORT")
    history.add_argument("stream", type=_stream)
    history.add_argument("key", help="the key (UTF-8)")
    history.add_argument(
        "--from",
        dest="start",
        type=_positive,
        default=1,
        metavar="SEQ",
        help="first seq to consider",
    )
    history.add_argument("--json", action="store_true", help="one JSON object per record")
    _add_client_security(history)

    status = commands.add_parser("status", help="streams, heads, consumers and their lag")
    status.add_argument("address", help="producer HOST:PORT")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.add_argument(
        "--group",
        metavar="NAME",
        help="one consumer group's (or consumer's) positions, each share's lag and their sum",
    )
    _add_client_security(status)


def _add_token(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``token``: a consumer's token, made from the producer's secret."""
    token = commands.add_parser("token", help="print the token naming a consumer")
    token.add_argument("consumer", type=_token_name, help="the consumer the token names")
    token.add_argument(
        "--secret-file", metavar="FILE", help=f"the producer's token secret (or set ${SECRET_ENV})"
    )


def _add_consumers(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``consumers add|remove|list``: the consumers a producer keeps records for."""
    consumers = commands.add_parser(
        "consumers",
        help="register consumers whose unapplied records retention keeps",
        description="Registered consumers: retention keeps every record a registered consumer "
        "has not applied, unless --retention-ms/--retention-bytes force it. The producer also "
        "keeps the last position of every consumer that reported one (status, lag, metrics), "
        "registered or not, until it is removed or not heard of for a week.",
    )
    actions = consumers.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, what in (
        ("add", "register a consumer"),
        ("remove", "forget a consumer: its registration and its last known position"),
    ):
        parser_for = actions.add_parser(action, help=what)
        parser_for.add_argument("db", help=DATABASE_HELP)
        parser_for.add_argument(
            "consumer", type=_name, help="the consumer's name (Spark: consumerName)"
        )
        parser_for.add_argument("stream", type=_stream)
        if action == "add":
            parser_for.add_argument(
                "--max-idle-ms",
                type=_positive,
                default=None,
                metavar="MS",
                help="drop the registration once the consumer has been away this long",
            )
            parser_for.add_argument(
                "--max-bytes",
                type=_positive,
                default=None,
                metavar="BYTES",
                help="drop the registration once its unapplied records take more than this",
            )
    listing = actions.add_parser(
        "list", help="consumers the producer knows, registered or not: position and lag"
    )
    listing.add_argument("db", help=DATABASE_HELP)
    listing.add_argument("--json", action="store_true", help="one JSON object per consumer")


def _add_dead_letters(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``dead-letters list|retry``: records a consumer parked, in its database."""
    dead_letters = commands.add_parser(
        "dead-letters",
        help="records a consumer parked (on_failure=DeadLetter()): list them, have them re-applied",
        description="Records a consumer with on_failure=streamq.DeadLetter() parked in its own "
        "database (table streamq_dead_letters). 'retry' marks them: the running consumer "
        "re-applies each once, through its own apply function, within about a second.",
    )
    letters = dead_letters.add_subparsers(dest="action", required=True, metavar="ACTION")
    letters_list = letters.add_parser("list", help="parked records, their error and attempts")
    letters_list.add_argument("db", help=CONSUMER_DATABASE_HELP)
    letters_list.add_argument("--consumer", metavar="NAME", help="only this consumer's")
    letters_list.add_argument("--json", action="store_true", help="one JSON object per record")
    letters_retry = letters.add_parser(
        "retry", help="mark parked records for their consumer to re-apply (all, or those given)"
    )
    letters_retry.add_argument("db", help=CONSUMER_DATABASE_HELP)
    letters_retry.add_argument("--consumer", metavar="NAME", help="only this consumer's")
    letters_retry.add_argument("--stream", metavar="NAME", help="only this stream's")
    letters_retry.add_argument("--seq", type=_positive, metavar="N", help="only this seq")


def _add_groups(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``groups``: consumer groups as their rows in the consumer's database show them."""
    groups = commands.add_parser(
        "groups",
        help="consumer groups: members, the shares each holds, positions, lag, parked records",
        description="Each consumer group in a consumer database: its members (alive, when "
        "each must renew), each share's holder and lease token, the positions its shares "
        "stored per producer, what each still owes (asked of the producers: its keys' "
        "records, or '≤ head - applied' where not counted), and the records each parked.",
    )
    groups.add_argument("db", help=CONSUMER_DATABASE_HELP)
    groups.add_argument("--group", metavar="NAME", help="only this group")
    groups.add_argument("--no-heads", action="store_true", help="do not ask the producers")
    groups.add_argument("--json", action="store_true", help="one JSON object per group")


def _add_reshare(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``reshare``: a consumer's positions rewritten for a new number of shares."""
    reshare = commands.add_parser(
        "reshare",
        help="change how many shares (Consumer share=(i, n)) a consumer's workers split into",
        description="Rewrite a consumer's stored positions for a new number of shares, in one "
        "transaction on its database. Safe only where every share of the old split stands at "
        "the same seq; anything else is refused, changing nothing. Stop the workers first: "
        "any still running with the old split stop at their next batch.",
    )
    reshare.add_argument("db", help=CONSUMER_DATABASE_HELP)
    reshare.add_argument("consumer", type=_name, help="the consumer's name, without its [i/n]")
    reshare.add_argument(
        "--shares", type=int, required=True, metavar="N", help="the new number of shares"
    )


def _add_console(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``console``: the web page over producers and consumer databases."""
    console = commands.add_parser(
        "console",
        help="a web page: streams, consumers and their lag, groups, dead letters, records",
        description="Serve one web page over the producers and consumer databases given: "
        "streams (head, rate, retention), consumers with a lag chart each, groups' members "
        "and shares, dead letters (an admin token retries them), capture progress, and a "
        "stream's newest records. Read-only without --token-secret-file and --admin.",
    )
    console.add_argument(
        "targets",
        nargs="*",
        metavar="ADDRESS_OR_DB",
        help="producers (HOST:PORT) and consumer databases (a SQLite file, a postgresql:// URL)",
    )
    console.add_argument(
        "--endpoints-file",
        metavar="FILE",
        help="producers, one HOST:PORT a line (# comments), read at every poll "
        "(as the Spark source's endpointsFile)",
    )
    console.add_argument(
        "--endpoints-provider",
        metavar="MODULE:FUNCTION",
        help="a function returning producers' HOST:PORT, called at every poll",
    )
    console.add_argument("--host", type=_host, default="127.0.0.1", help="bind address")
    console.add_argument("--port", type=_port, default=8490, help="port (0: any free one)")
    console.add_argument(
        "--interval", type=_seconds, default=1.0, help="seconds between polls (default 1)"
    )
    serving = console.add_argument_group(
        "security of the page", "TLS and admin tokens, as the producer's (default: plain HTTP, "
        "read-only)",
    )  # fmt: skip
    serving.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this chain")
    serving.add_argument("--tls-key", metavar="PEM", help="its private key")
    serving.add_argument(
        "--token-secret-file",
        metavar="FILE",
        help=f"actions need a token made with this secret (or set ${SECRET_ENV}), by "
        "`streamq token`, naming an --admin",
    )
    serving.add_argument(
        "--admin", action="append", default=[], metavar="NAME", help="may act (repeatable)"
    )
    producers = console.add_argument_group(
        "security of the producers", "for producers serving TLS or requiring tokens"
    )
    producers.add_argument("--producer-tls", action="store_true", help="TLS, the system's CAs")
    producers.add_argument("--producer-tls-ca", metavar="PEM", help="TLS, trusting this CA")
    producers.add_argument(
        "--producer-token-file",
        metavar="FILE",
        help=f"an admin token for the producers' status (or set ${TOKEN_ENV})",
    )


def _add_demo(commands: argparse._SubParsersAction[_Parser]) -> None:
    """``demo``, and its consumer's process ``demo-consumer``."""
    demo = commands.add_parser(
        "demo", help="an embedded producer and a crashing consumer, applied exactly once"
    )
    demo.add_argument("--seconds", type=_seconds, default=12.0, help="how long to produce")
    demo.add_argument(
        "--kills", type=_non_negative, default=3, help="times the consumer is killed -9"
    )
    demo.add_argument("--dir", default=None, help="where the databases go (default: a temp dir)")
    demo_consumer = commands.add_parser("demo-consumer")  # the demo's consumer process
    demo_consumer.add_argument("address")
    demo_consumer.add_argument("db")


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("streamq serve: --tls-cert and --tls-key go together")
        tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    elif args.tls_client_ca:
        raise SystemExit("streamq serve: --tls-client-ca needs --tls-cert and --tls-key")
    auth = None
    secret = read_secret(path=args.token_secret_file, env=SECRET_ENV)
    if secret is not None:
        if not args.grant and not args.admin:
            raise SystemExit("streamq serve: tokens need at least one --grant or --admin")
        try:
            auth = TokenAuth(secret, dict(args.grant), args.admin)
        except ValueError as exc:
            raise SystemExit(f"streamq serve: {exc}") from None
    elif args.grant or args.admin:
        raise SystemExit(f"streamq serve: --grant needs --token-secret-file or ${SECRET_ENV}")
    return ServerSettings(tls=tls, auth=auth)


def _client_security(args: argparse.Namespace) -> dict[str, Any]:
    """``tls`` and ``token`` keyword arguments for ``Client`` and ``Consumer``."""
    tls = None
    if args.tls_key and not args.tls_cert:
        raise SystemExit(f"streamq {args.command}: --tls-key needs --tls-cert")
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    token = args.token
    if token is None:
        secret = read_secret(path=args.token_file, env=TOKEN_ENV)
        token = None if secret is None else secret.decode()
    return {"tls": tls, "token": token}


def _exists(db: str) -> bool:
    return is_postgres_url(db) or os.path.exists(db)


def _existing(command: str, db: str, makes_it: str) -> Engine:
    """The engine of ``db``, refused if the command would otherwise create it, or take it
    for a file: a SQLite path with nothing there (``makes_it`` says what does make one),
    a URL of another scheme (``for_target`` names the supported ones)."""
    engine = for_target(db)
    if not _exists(db):
        raise SystemExit(f"streamq {command}: {db} does not exist ({makes_it})")
    return engine


def _producer_database(command: str, db: str, flag: str | None = None) -> None:
    """Refuse ``db`` unless it holds a producer's log: opening it as a producer would
    otherwise create the log tables in whatever database was given. ``flag``: the
    command's own option that creates them."""
    makes = f"`streamq init {db}`" + (f" (or {flag})" if flag else "")
    tables = _existing(command, db, f"{makes} creates a producer database").tables(db)
    if not tables.log:
        whose = " (it is a consumer's database)" if tables.positions else ""
        raise SchemaMissingError(
            f"{tables.where} has no streamq log tables{whose}: give the producer's "
            f"database, or create them there with `streamq init DB`"
            + (f" (or {command} {flag})" if flag else "")
        )


_DATABASE_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")


def _address(command: str, text: str) -> str:
    """``text``, checked to be a producer's HOST:PORT before anything connects; else one
    line saying what it is instead (a database, a URL) or what form is expected."""
    if _is_database(text):
        raise SystemExit(
            f"streamq {command}: {text} is a database; {command} asks a running producer: "
            f"give its HOST:PORT (`streamq serve` prints it)"
        )
    try:
        parse_address(text)
    except ValueError as exc:
        raise SystemExit(f"streamq {command}: {exc}") from None
    return text


def _log_to_stderr() -> None:
    """A serving process's log: what streamq says at INFO and above, a line each on
    stderr (the publishing path a PostgreSQL producer chose and why, slots it made,
    consumers it forgot), where Python's default shows warnings only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("streamq")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


async def _serve(args: argparse.Namespace) -> None:
    _log_to_stderr()
    if not args.create:  # a wrong database would otherwise get log tables, and serve nothing
        _producer_database("serve", args.db, "--init")
    settings = _server_settings(args)
    async with Producer(
        args.db,
        host=args.host,
        port=args.port,
        durability=args.durability,
        settings=settings,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        retention_ms=args.retention_ms,
        retention_bytes=args.retention_bytes,
        capture=args.capture,
        snapshot=args.snapshot,
    ) as p:
        streams = ", ".join(f"{s.name}@{s.head}" for s in p.log.streams.values()) or "none yet"
        print(f"serving producer {p.producer_id} (epoch {p.epoch}) on {p.address}", flush=True)
        print(f"streams: {streams}", flush=True)
        if args.metrics_port is not None:
            print(f"metrics: http://{p.metrics_address}/metrics", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()


async def _init(args: argparse.Namespace) -> None:
    async with Producer(args.db, serve=False, capture=args.capture) as producer:
        for stream in args.stream:
            await producer.create_stream(stream)
    streams = f"; streams: {', '.join(args.stream)}" if args.stream else ""
    print(f"{args.db}: streamq log tables ready (producer {producer.producer_id}){streams}")
    if producer.capture is not None:
        captured = ", ".join(f"{t} -> {s}" for t, s in producer.captured.items())
        print(f"capturing {captured}: slot and publication {producer.capture.slot}")


async def _publish(args: argparse.Namespace) -> None:
    _producer_database("publish", args.db)
    values = [v.encode() for v in args.values] or [line.rstrip("\n").encode() for line in sys.stdin]
    if not values:
        raise SystemExit("streamq publish: nothing to publish: no VALUES given, stdin was empty")
    key = None if args.key is None else args.key.encode()
    headers = dict(args.header)
    async with Producer(args.db, serve=False) as producer, producer.transaction() as tx:
        seqs = [await tx.publish(args.stream, v, key=key, headers=headers) for v in values]
    print(f"published {len(seqs)} record(s) to {args.stream!r}: seq {seqs[0]}..{seqs[-1]}")


def _format(record: Record, as_json: bool) -> str:
    """A record as a line: a captured change's value (msgpack) as its JSON."""
    if as_json:
        return json.dumps(record_json(record), default=json_default)
    key = "" if record.key is None else f" key={text(record.key)}"
    captured = record.headers.get(CHANGE_HEADER) == CHANGE_HEADER_VALUE
    value = change_json(record.value) if captured else text(record.value)
    return f"{record.seq}\t{record.timestamp}{key}\t{value}"


async def _tail(args: argparse.Namespace) -> None:
    if args.start is not None and args.start_time is not None:
        raise SystemExit("streamq tail: give --from or --from-time, not both")
    _address("tail", args.address)
    start = args.start
    if start is None and args.start_time is None:
        start = await asyncio.to_thread(_head, args) + 1
    printed = 0
    security = _client_security(args)
    wanted = None
    if args.key_prefix is not None or args.header:
        prefix = None if args.key_prefix is None else args.key_prefix.encode()
        wanted = Filter(key_prefix=prefix, headers=dict(args.header))
    async with Consumer(
        args.address,
        args.stream,
        start_seq=start or 1,
        start_time=args.start_time,
        name="streamq-tail",
        filter=wanted,
        **security,
    ) as c:
        async for batch in c:
            for record in batch:
                print(_format(record, args.json), flush=True)
                printed += 1
                if args.count is not None and printed >= args.count:
                    return


def _header_match(text: str) -> tuple[str, bytes]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value.encode()


_CONSUMER_MADE = "a consumer's database is made by its Consumer(db=...)"


def _reshare(args: argparse.Namespace) -> None:
    _existing("reshare", args.db, _CONSUMER_MADE)
    for move in reshare(args.db, args.consumer, args.shares):
        at = f"at seq {move.seq}"
        if isinstance(move, OnlineMove):  # a running group: each key after its own share's
            at = f"from seq {move.seq}, each key after its old share's position (the group runs on)"
        print(
            f"stream {move.stream!r} from producer {move.producer_id}: "
            f"{', '.join(move.old)} -> {', '.join(move.new)} {at}"
        )


def _head(args: argparse.Namespace) -> int:
    with Client(args.address, **_client_security(args)) as client:
        return int(client.head(args.stream).head)


def _token(args: argparse.Namespace) -> None:
    secret = read_secret(path=args.secret_file, env=SECRET_ENV)
    if secret is None:
        raise SystemExit(f"streamq token: give --secret-file or set ${SECRET_ENV}")
    if len(secret) < MIN_SECRET_BYTES:  # a token no producer would take
        where = args.secret_file or f"${SECRET_ENV}"
        raise SystemExit(
            f"streamq token: the secret in {where} has {len(secret)} bytes; producers "
            f"refuse secrets under {MIN_SECRET_BYTES} (serve --token-secret-file)"
        )
    print(make_token(secret, args.consumer))


async def _history_from_file(path: str, stream: str, key: bytes, start: int) -> list[Record]:
    """Read a producer's database directly, read-only: no producer needs to run."""
    storage = open_storage(path)
    log = Log(storage, tail_bytes=0)
    try:
        await storage.open_readers(1)
        async with storage.reader() as reader:
            rows = await reader.streams()
        for row in rows:
            log.add(row)
        encoded = await log.full_history(log.stream(stream), key, start)
    finally:
        await storage.close()
    return [decode_record(record) for record in encoded]


def _history(args: argparse.Namespace) -> None:
    key = args.key.encode()
    if _exists(args.source):
        _producer_database("history", args.source)
        records = _loop.run(_history_from_file(args.source, args.stream, key, args.start))
    else:
        try:
            parse_address(args.source)
        except ValueError:
            scheme = args.source.partition("://")[0] + "://" if "://" in args.source else ""
            raise SystemExit(
                f"streamq history: {args.source} is neither a database file nor HOST:PORT"
                + (f" (a producer's address goes without {scheme})" if scheme else "")
            ) from None
        with Client(args.source, **_client_security(args)) as client:
            records = client.history(args.stream, key, args.start)
    for record in records:
        print(_format(record, args.json))


def _status(args: argparse.Namespace) -> None:
    with Client(_address("status", args.address), **_client_security(args)) as client:
        status = client.status()
    if args.group:
        _group_status(args, status)
        return
    if args.json:
        print(json.dumps(status, indent=2))
        return
    console = _console()
    console.print(
        f"producer [bold]{status['producer_id']}[/] epoch {status['epoch']} at {args.address}, "
        f"{status['connections']} connection(s)"
    )
    if build := status.get("build"):
        console.print(f"running {build}")
    publishing = status.get("publishing") or {}
    path = publishing.get("path")
    if path == "wal":
        console.print(
            f"publishing through the WAL (slot {publishing['slot']}): numbered up to LSN "
            f"{publishing['position']}"
        )
    elif path == "table":
        console.print(f"publishing through table streamq_pending: {publishing['reason']}")
    open_transactions = status.get("open_transactions")
    if open_transactions and open_transactions["count"]:
        console.print(
            f"{open_transactions['count']} transaction(s) "
            f"{'written' if path == 'wal' else 'published'} and not ended yet, "
            f"the oldest open for {open_transactions['oldest_age_ms'] / 1000:.1f} s: "
            "their records are served once they commit"
        )
    capture = status.get("capture")
    if capture:
        tables = ", ".join(capture["tables"])
        console.print(
            f"capturing {tables} (slot {capture['slot']}): published up to LSN "
            f"{capture['lsn']}, {capture['changes']} change(s) since start; the slot holds "
            f"back {capture['retained_wal_bytes'] / 2**20:.1f} MiB of WAL"
        )
        if snapshot := capture.get("snapshot"):
            console.print(
                f"taking a snapshot of {', '.join(snapshot['tables'])} at LSN "
                f"{snapshot['lsn']}: {snapshot['rows']} of {snapshot['of']} rows read"
            )
    streams = Table("stream", "head", "first held", title="streams")
    for s in status["streams"]:
        streams.add_row(s["stream"], str(s["head"]), str(s["low"]))
    console.print(streams)
    consumers = Table(
        "consumer",
        "stream",
        "applied",
        "lag",
        "registered",
        "lost",
        "last report",
        "connected",
        title="consumers",
    )
    rows = consumer_rows(status)
    for c in rows:
        consumers.add_row(
            c["consumer"],
            c["stream"],
            "" if c["applied"] is None else str(c["applied"]),
            _lag(c["lag"], c["exact"]),
            "yes" if c["registered"] else ("dropped" if c.get("dropped") else ""),
            str(c["lost"] or ""),
            _ago(c["updated_at"] / 1000),
            (", ".join(c["peers"]) or "yes") if c["connected"] else "no",
        )
    console.print(consumers)
    if not all(c["exact"] for c in rows):
        console.print(UPPER_BOUND)


def _group_status(args: argparse.Namespace, status: dict[str, Any]) -> None:
    """``status --group NAME``: the positions of NAME and its shares (``NAME[i/n]``), as
    the producer knows them, and per stream the sum of their lags: what the group owes."""
    name = args.group
    rows = [
        p
        for p in status.get("positions", [])
        if p["consumer"] == name or (split_share_name(p["consumer"]) or ("",))[0] == name
    ]
    if not rows:
        raise SystemExit(
            f"streamq status: the producer at {args.address} knows no consumer {name!r} "
            "and no share of it"
        )
    streams: dict[str, dict[str, Any]] = {}
    for p in rows:
        total = streams.setdefault(p["stream"], {"lag": 0, "exact": True})
        total["lag"] += p["lag"]
        total["exact"] = total["exact"] and p.get("exact", True)
    if args.json:
        print(json.dumps({"group": name, "streams": streams, "positions": rows}))
        return
    console = _console()
    for stream, total in streams.items():
        lag = _lag(total["lag"], total["exact"])
        console.print(f"group [bold]{name}[/] on stream {stream!r}: lag {lag}")
    table = Table("consumer", "stream", "applied", "lag", "last report", "connected", title=name)
    for p in rows:
        lag = _lag(p["lag"], p.get("exact", True))
        connected = "yes" if p.get("connected", True) else "no"
        table.add_row(
            p["consumer"], p["stream"], str(p["applied"]), lag, _ago(p["updated_at"] / 1000),
            connected,
        )  # fmt: skip
    console.print(table)
    if not all(total["exact"] for total in streams.values()):
        console.print(UPPER_BOUND)


def _lag(lag: int, exact: bool) -> str:
    """A lag as the tables show it: ``≤ N`` where it is an upper bound: head - applied,
    or as of a consumer's last report (docs/guides/operations.md, "What lag counts")."""
    return str(lag) if exact else f"≤ {lag}"


# Under a table with a lag that is an upper bound: why.
UPPER_BOUND = (
    "≤ N: at most N. A consumer not connected is shown as of its last report: it may "
    "have applied more since. A filtered consumer's lag, or a share's not counted, is "
    "head - applied."
)


def _ago(when: float) -> str:
    """How long ago a consumer last reported (Unix seconds; 0: never): ``42 s ago``."""
    if not when:
        return ""
    return f"{_duration(datetime.now(UTC).timestamp() - when)} ago"


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min``, ``2 h``, ``5 d``: a lease's age, a report's."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:.0f} s"


async def _consumers(args: argparse.Namespace) -> None:
    _producer_database("consumers", args.db)
    async with Producer(args.db, serve=False) as producer:
        if args.action == "add":
            await producer.register_consumer(
                args.consumer, args.stream, max_idle_ms=args.max_idle_ms, max_bytes=args.max_bytes
            )
            # Registering first is allowed (retention keeps the stream from its first
            # record), but a misspelt name would be kept for ever: say so.
            new = "" if args.stream in producer.log.streams else " (no such stream yet)"
            print(f"registered {args.consumer!r} on {args.stream!r}{new}")
        elif args.action == "remove":
            if not await producer.forget_consumer(args.consumer, args.stream):
                raise SystemExit(
                    f"streamq consumers: {args.consumer!r} on {args.stream!r} is not registered "
                    "and has no known position"
                )
            print(f"removed {args.consumer!r} from {args.stream!r}: registration and position")
        else:
            known = producer.consumer_lags()  # not serving: each as of its last report
            if args.json:
                for p in known:
                    print(json.dumps(p._asdict()))
                return
            table = Table(
                "consumer",
                "stream",
                "applied",
                "head",
                "lag",
                "registered",
                "last report",
                "max idle ms",
                "max bytes",
                title="consumers",
                caption="as the database holds them: each as of the consumer's last report",
            )
            for p in known:
                limits = ["" if v is None else str(v) for v in (p.max_idle_ms, p.max_bytes)]
                table.add_row(
                    p.consumer,
                    p.stream,
                    str(p.applied),
                    str(p.head),
                    _lag(p.lag, p.exact),
                    "yes" if p.registered else "",
                    _ago(p.updated_at),
                    *limits,
                )
            console = _console()
            console.print(table)
            if not all(p.exact for p in known):
                console.print(UPPER_BOUND)


def _groups(args: argparse.Namespace) -> None:
    from .groups.report import describe_groups

    _existing("groups", args.db, _CONSUMER_MADE)
    reports = describe_groups(args.db, args.group, heads=not args.no_heads)
    if args.group and not reports:
        raise SystemExit(f"streamq groups: no consumer group {args.group!r} in {args.db}")
    if args.json:
        for report in reports:
            print(json.dumps(report.as_json()))
        return
    if not reports:
        print(f"no consumer groups in {args.db}")
        return
    console = _console()
    for report in reports:
        alive = sum(m.alive for m in report.members)
        console.print(
            f"group [bold]{report.name}[/] on stream {report.stream!r}: {report.shares} "
            f"shares, {alive} of {len(report.members)} member(s) alive"
        )
        members = Table(
            "member", "host", "pid", "alive", "renews within", "shares held", title="members"
        )
        for m in report.members:
            members.add_row(
                f"{m.member:016x}",
                m.host or "",
                "" if m.pid is None else str(m.pid),
                "yes" if m.alive else "no",
                _renews(m),
                ", ".join(map(str, m.shares)),
            )
        console.print(members)
        shares = Table(
            "share", "holder", "held for", "token", "producer", "applied", "head", "lag",
            "parked", title="shares",
        )  # fmt: skip
        for r in report.rows:
            shares.add_row(
                str(r.share),
                "" if r.holder is None else f"{r.holder:016x}",
                _held(r),
                str(r.token),
                r.producer_id or "",
                "" if r.applied is None else str(r.applied),
                "" if r.head is None else str(r.head),
                "" if r.behind is None else _lag(r.behind, r.exact),
                str(r.parked or ""),
            )
        console.print(shares)
        for endpoint, why in report.unreachable.items():
            console.print(f"no head from {endpoint}: {why}")


def _renews(member: MemberRow) -> str:
    """When a member must renew its row: within N s, or since when it has expired (a
    member whose process ended before: never)."""
    if member.expires_in_ms <= 0:
        return f"expired {_duration(-member.expires_in_ms / 1000)} ago"
    if not member.alive:
        return "never: its process ended"
    return f"{member.expires_in_ms / 1000:.1f} s"


def _held(row: ShareRow) -> str:
    """How long a share's lease has been held, or since when it has expired."""
    if row.lease == "expired":
        since = "" if row.expired_ms is None else f" {_duration(row.expired_ms / 1000)} ago"
        return f"expired{since}"
    return "" if row.held_ms is None else _duration(row.held_ms / 1000)


def _is_database(text: str) -> bool:
    return is_postgres_url(text) or os.path.exists(text) or text.endswith(_DATABASE_SUFFIXES)


def _web_console(args: argparse.Namespace) -> None:
    """``streamq console``: every target checked first, each mistake one line."""
    try:
        from .console import app, watch
    except ImportError as exc:
        raise SystemExit(
            f"streamq console: {exc.name} is missing: pip install 'streamq[console]'"
        ) from None
    databases = [t for t in args.targets if _is_database(t)]
    listed = [_address("console", t) for t in args.targets if t not in databases]
    for db in databases:
        _existing("console", db, _CONSUMER_MADE)
        consumer_database(db)
    if not args.targets and not args.endpoints_file and not args.endpoints_provider:
        raise SystemExit(
            "streamq console: give producers (HOST:PORT), consumer databases, "
            "--endpoints-file or --endpoints-provider"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("streamq console: --tls-cert and --tls-key go together")
    auth = None
    secret = read_secret(path=args.token_secret_file, env=SECRET_ENV)
    if secret is not None:
        if not args.admin:
            raise SystemExit("streamq console: a token secret needs --admin NAME: who may act")
        try:
            auth = TokenAuth(secret, {}, args.admin)
        except ValueError as exc:  # a secret too short
            raise SystemExit(f"streamq console: {exc}") from None
    elif args.admin:
        raise SystemExit(f"streamq console: --admin needs --token-secret-file (or ${SECRET_ENV})")
    tls = None
    if args.producer_tls or args.producer_tls_ca:
        tls = ClientTLS(args.producer_tls_ca)
    token = read_secret(path=args.producer_token_file, env=TOKEN_ENV)

    def addresses() -> list[str]:
        found = listed_endpoints(None, args.endpoints_file, args.endpoints_provider)
        return list(dict.fromkeys(listed + found))

    try:
        first = addresses()
    except ProviderError as exc:
        raise SystemExit(f"streamq console: --endpoints-provider {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"streamq console: {exc}") from None
    watched = watch.Watch(
        addresses, databases, tls=tls, token=None if token is None else token.decode()
    )
    for address, why in watched.check(first):  # not a producer, or no status for us
        raise SystemExit(f"streamq console: {address}: {why}")
    sock = app.bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    scheme = "https" if args.tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host
    mode = f"actions by {', '.join(args.admin)}" if auth else "read-only"
    print(f"console: {scheme}://{shown}:{port}/ ({mode})", flush=True)
    page = app.Console(watched, interval=args.interval, auth=auth)
    _loop.run(app.serve(page, sock, tls_cert=args.tls_cert, tls_key=args.tls_key))


def _console() -> Console:
    """Where tables go. Not a terminal (a log, a pipe, ``watch``): as wide as they are,
    never cut to 80 columns (``COLUMNS`` still sets a width); a terminal: its width."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return _Console(width=NOT_A_TERMINAL_WIDTH if wide else None)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich's own exits with status 1: ``main`` ends this command as every other."""
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


# Columns a table may take when stdout is not a terminal: rich sizes a table to its
# content within this, so no cell is cut ("127.0.0.…").
NOT_A_TERMINAL_WIDTH = 10_000


def _dead_letters(args: argparse.Namespace) -> None:
    _existing("dead-letters", args.db, _CONSUMER_MADE)
    if args.action == "retry":
        marked = mark_for_retry(args.db, args.consumer, args.stream, args.seq)
        if not marked:
            raise SystemExit("streamq dead-letters: no parked record matched")
        print(
            f"marked {marked} record(s) for retry: each running consumer re-applies its own "
            "once, within about a second ('streamq dead-letters list' shows what is left)"
        )
        return

    parked = list_dead_letters(args.db, args.consumer)
    if args.json:
        for p in parked:
            print(json.dumps(p.as_json(), default=json_default))
        return
    table = Table(
        "consumer", "stream", "seq", "key", "attempts", "parked at", "retry", "error",
        title=f"parked records ({len(parked)})",
    )  # fmt: skip
    for p in parked:
        parked_at = datetime.fromtimestamp(p.parked_at / 1000, UTC).isoformat(timespec="seconds")
        table.add_row(
            p.consumer,
            p.stream,
            str(p.record.seq),
            text(p.record.key) or "",
            str(p.attempts),
            parked_at,
            "requested" if p.retry_requested_at is not None else "",
            p.error.splitlines()[-1] if p.error else "",
        )
    _console().print(table)


def _database_errors() -> tuple[type[Exception], ...]:
    """The drivers' errors, reported as one line like streamq's own."""
    errors: list[type[Exception]] = [sqlite3.Error]
    if "psycopg" in sys.modules:
        errors.append(sys.modules["psycopg"].Error)
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Whoever reads its output may stop reading (``streamq
    status --json | head``): it then exits quietly, as Unix tools do (``_output_unread``)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a reader gone is caught below
    except BrokenPipeError:  # stdout's (``_main`` lets no other through)
        return _output_unread()


def _output_unread() -> int:
    """stdout's reader is gone: nothing more to say, and nowhere to say it. No message and
    no traceback; the status a tool killed by SIGPIPE has (``yes | head``: 141)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # what is left to flush at exit goes nowhere
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _stdout_gone() -> bool:
    """Whether stdout's reader has gone: a pipe without one reports an error to ``poll``
    (a socket, a hang-up). Another broken pipe (a socket) is an error like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (AttributeError, OSError, ValueError):  # no descriptor (replaced), no poll
        return False
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "snapshot", False) and not args.capture:
        parser.error("--snapshot streams captured tables' rows first: it needs --capture")
    try:
        if args.command == "serve":
            _loop.run(_serve(args))
        elif args.command == "init":
            _loop.run(_init(args))
        elif args.command == "publish":
            _loop.run(_publish(args))
        elif args.command == "tail":
            with contextlib.suppress(KeyboardInterrupt):
                _loop.run(_tail(args))
        elif args.command == "history":
            _history(args)
        elif args.command == "status":
            _status(args)
        elif args.command == "token":
            _token(args)
        elif args.command == "consumers":
            _loop.run(_consumers(args))
        elif args.command == "dead-letters":
            _dead_letters(args)
        elif args.command == "groups":
            _groups(args)
        elif args.command == "reshare":
            _reshare(args)
        elif args.command == "console":
            _web_console(args)
        elif args.command == "demo":
            from .demo import run_demo

            return run_demo(args.seconds, args.kills, args.dir)
        elif args.command == "demo-consumer":
            from .demo import consumer_main

            _loop.run(consumer_main(args.address, args.db))
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            raise  # main's to handle: nothing to say
        if not isinstance(exc, (StreamQError, OSError, *_database_errors())):
            raise
        print(f"streamq {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0

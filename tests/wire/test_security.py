"""TLS and token authentication over real loopback sockets, with certificates made by trustme.

Every refusal is checked three ways: the exact error the client gets, that the refused
peer got no data frame, and that an authorized consumer keeps receiving meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import streamq
from streamq import (
    AuthenticationFailedError,
    Client,
    ClientTLS,
    ConnectionLostError,
    Consumer,
    FanInConsumer,
    NotAuthorizedError,
    Producer,
    ServerSettings,
    ServerTLS,
    StreamQError,
    SyncProducer,
    TLSError,
    TokenAuth,
    UnknownStreamError,
    cli,
    make_token,
)
from streamq.errors import ErrorCode
from streamq.protocol import (
    PROTOCOL_VERSION,
    Authenticated,
    ClientHello,
    Error,
    FrameDecoder,
    GetHead,
    GetHistory,
    GetRange,
    GetStatus,
    ListStreams,
    Message,
    Records,
    ReportPosition,
    SeekTime,
    ServerHello,
    StreamList,
    Subscribe,
    decode_message,
    encode,
)
from streamq.wire.security import Principal, read_secret

from ..certs import Certs, make_certs
from ..test_cli import STREAMQ, run

SECRET = b"0123456789abcdef-test-secret"
GRANTS = {"billing": ["orders", "refunds.*"], "ops": []}
AUTH = TokenAuth(SECRET, GRANTS, admins=["ops"])
BILLING = make_token(SECRET, "billing")
OPS = make_token(SECRET, "ops")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def secured(either_producer_db: str, certs: Certs) -> AsyncIterator[Producer]:
    """A producer with mutual TLS and tokens, 20 records in ``orders``, 5 in ``secret``;
    its log in SQLite or in PostgreSQL (security is the server's, whatever the engine)."""
    settings = ServerSettings(tls=certs.server, auth=AUTH)
    async with Producer(either_producer_db, settings=settings) as producer:
        async with producer.transaction() as tx:
            await tx.publish_many("orders", [b"%d" % n for n in range(20)])
            await tx.publish_many("secret", [b"s%d" % n for n in range(5)])
        yield producer


@pytest.fixture
async def bystander(secured: Producer, certs: Certs) -> AsyncIterator[Consumer]:
    """An authorized consumer that must keep receiving while others are refused."""
    consumer = Consumer(secured.address, "orders", tls=certs.client, token=BILLING)
    async with consumer:
        assert (await anext(consumer)).last_seq == 20
        yield consumer


async def check_unharmed(producer: Producer, bystander: Consumer) -> None:
    seq = await producer.publish("orders", b"after the refusal")
    batch = await asyncio.wait_for(anext(bystander), 10)
    assert [r.seq for r in batch] == [seq]


async def raw_exchange(
    address: str, tls: ClientTLS | None, *messages: Message, frames: int = 0
) -> tuple[list[Message], BaseException | None]:
    """Read SERVER_HELLO, send ``messages``, read frames until ERROR, the producer closes, or
    ``frames`` frames came. Returns the frames and the exception that ended the reading."""
    host, port = address.rsplit(":", 1)
    context = None if tls is None else tls.context()
    received: list[Message] = []
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
            try:
                decoder = FrameDecoder()
                sent = False
                while True:
                    chunk = await reader.read(65536)
                    if not chunk:
                        return received, None
                    decoder.feed(chunk)
                    while (body := decoder.next_frame()) is not None:
                        received.append(decode_message(body))
                    if (received and isinstance(received[-1], Error)) or len(received) == frames:
                        return received, None
                    if not sent and received:
                        writer.write(b"".join(encode(m) for m in messages))
                        sent = True
            finally:
                writer.close()
    except (OSError, ssl.SSLError) as exc:
        return received, exc


def assert_refused(received: list[Message], code: ErrorCode, authenticated: bool = False) -> None:
    """Only SERVER_HELLO (and AUTHENTICATED) before the ERROR: no data frame."""
    assert isinstance(received[0], ServerHello)
    rest = received[1:]
    if authenticated:
        assert isinstance(rest[0], Authenticated)
        rest = rest[1:]
    assert len(rest) == 1, f"expected one ERROR frame, got {received!r}"
    assert isinstance(rest[0], Error) and rest[0].code == code, received


# --- tokens and grants, without a socket --------------------------------------------------


def test_token_names_its_consumer_and_grants_decide() -> None:
    principal = AUTH.authenticate(BILLING)
    assert principal == Principal("billing", ("orders", "refunds.*"), admin=False)
    assert principal.may_read("orders") and principal.may_read("refunds.eu")
    assert not principal.may_read("orders2") and not principal.may_read("refunds")
    assert AUTH.authenticate(OPS).admin
    assert "secret" not in repr(AUTH) and SECRET.decode() not in repr(AUTH)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "this producer requires a token; none was sent"),
        ("billing", "invalid token: not issued with this producer's secret"),
        (make_token(b"another secret, 16+ bytes", "billing"), "invalid token: not issued"),
        (BILLING[:-1] + ("0" if BILLING[-1] != "0" else "1"), "invalid token: not issued"),
        ("ops" + BILLING[len("billing") :], "invalid token: not issued"),
        (make_token(SECRET, "intruder"), "consumer 'intruder' has no grants on this producer"),
    ],
    ids=["none", "no digest", "other secret", "altered", "other name", "no grants"],
)
def test_bad_tokens_are_refused(token: str | None, message: str) -> None:
    with pytest.raises(AuthenticationFailedError, match=message):
        AUTH.authenticate(token)


def test_weak_secrets_and_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TokenAuth(b"short", {})
    with pytest.raises(ValueError, match="no ':'"):
        make_token(SECRET, "a:b")


def test_admin_alone_and_an_empty_grant_count_as_grants() -> None:
    """ "Authentication": a consumer has grants if it is in the table, even with no pattern,
    or is an admin; only a name in neither is refused."""
    auth = TokenAuth(SECRET, {"idle": []}, admins=["root"])
    assert auth.authenticate(make_token(SECRET, "root")) == Principal("root", (), admin=True)
    assert auth.authenticate(make_token(SECRET, "idle")) == Principal("idle", (), admin=False)
    with pytest.raises(AuthenticationFailedError, match="'billing' has no grants"):
        auth.authenticate(BILLING)


@pytest.mark.parametrize(
    "content",
    [b"SECRET", b"SECRET\n", b"SECRET\r\n", b"  SECRET \t\n", b"SECRET\nsecond line\n"],
    ids=["bare", "newline", "crlf", "blanks", "two lines"],
)
def test_a_secret_file_is_its_first_line_stripped(content: bytes, tmp_path: Path) -> None:
    """ "Authentication": the HMAC key is the first line without surrounding ASCII blanks,
    so a file written by an editor and one written by ``printf`` make the same tokens."""
    path = tmp_path / "secret"
    path.write_bytes(content.replace(b"SECRET", SECRET))
    secret = read_secret(path=str(path))
    assert secret == SECRET
    assert make_token(secret, "billing") == BILLING


def test_a_secret_from_the_environment_is_stripped_utf8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMQ_TEST_SECRET", f" {SECRET.decode()}\n")
    assert read_secret(env="STREAMQ_TEST_SECRET") == SECRET
    assert read_secret(env="STREAMQ_TEST_SECRET_UNSET") is None


# --- TLS -----------------------------------------------------------------------------------


async def test_mutual_tls_and_token_carry_records(secured: Producer, certs: Certs) -> None:
    async with Consumer(secured.address, "orders", tls=certs.client, token=BILLING) as consumer:
        batch = await anext(consumer)
        assert [r.value for r in batch] == [b"%d" % n for n in range(20)]

    def request() -> tuple[str | None, int, list[str]]:
        with Client(secured.address, tls=certs.client, token=BILLING) as client:
            return client.consumer, client.head("orders").head, [s.stream for s in client.streams()]

    assert await asyncio.to_thread(request) == ("billing", 20, ["orders"])  # "secret" is hidden


async def test_server_name_overrides_the_host_checked(secured: Producer, certs: Certs) -> None:
    port = secured.address.rsplit(":", 1)[1]
    tls = ClientTLS(certs.ca, certs.client.cert, certs.client.key, server_name="localhost")

    def head() -> int:
        with Client(f"127.0.0.1:{port}", tls=tls, token=BILLING) as client:
            return client.head("orders").head

    assert await asyncio.to_thread(head) == 20
    wrong_name = ClientTLS(certs.ca, certs.client.cert, certs.client.key, server_name="example.org")
    with pytest.raises(TLSError, match="Hostname mismatch"):
        await asyncio.to_thread(Client, secured.address, tls=wrong_name, token=BILLING)


# What the client says for each TLS refusal (exact texts in streamq/wire/security.py).
_REFUSED_CERT = re.escape(
    "the producer closed the connection right after the handshake: it refused this client's "
    "certificate (expired, or not signed by a CA it trusts)"
)
TLS_REFUSALS = {
    "server certificate from an unknown CA": (
        lambda c: ClientTLS(c.other_ca, c.client.cert, c.client.key),
        "the producer's certificate failed verification: self-signed certificate in certificate "
        "chain",
    ),
    "no client certificate": (
        lambda c: ClientTLS(c.ca),
        "the producer closed the connection right after the handshake: it requires a client "
        "certificate \\(mutual TLS\\); set cert and key",
    ),
    "client certificate from another CA": (lambda c: c.client_of_other_ca, _REFUSED_CERT),
    "expired client certificate": (lambda c: c.expired_client, _REFUSED_CERT),
}


@pytest.mark.parametrize("case", list(TLS_REFUSALS))
async def test_tls_refusals(
    case: str, secured: Producer, bystander: Consumer, certs: Certs
) -> None:
    make_tls, message = TLS_REFUSALS[case]
    tls = make_tls(certs)
    prefix = f"TLS with producer at {secured.address} failed: "
    with pytest.raises(TLSError, match=f"^{re.escape(prefix)}{message}$"):
        await asyncio.to_thread(Client, secured.address, tls=tls, token=BILLING)
    consumer = Consumer(secured.address, "orders", tls=tls, token=BILLING, reconnect_timeout=5)
    with pytest.raises(TLSError, match=f"^{re.escape(prefix)}{message}$"):
        await consumer.start()  # at once, not retried until reconnect_timeout: it needs a fix
    received, _ = await raw_exchange(secured.address, tls, Subscribe("orders", 1, "x", None))
    assert received == []  # not a byte of data, not even SERVER_HELLO
    await check_unharmed(secured, bystander)


async def test_expired_server_certificate(producer_db: str, certs: Certs) -> None:
    settings = ServerSettings(tls=certs.expired_server)
    async with Producer(producer_db, settings=settings) as producer:
        await producer.publish("orders", b"x")
        with pytest.raises(TLSError, match="failed verification: certificate has expired"):
            await asyncio.to_thread(Client, producer.address, tls=ClientTLS(certs.ca))
        consumer = Consumer(producer.address, "orders", tls=ClientTLS(certs.ca))
        with pytest.raises(TLSError, match="failed verification: certificate has expired"):
            await consumer.start()


async def test_tls_below_1_3_is_refused(secured: Producer, certs: Certs) -> None:
    context = ssl.create_default_context(cafile=certs.ca)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    host, port = secured.address.rsplit(":", 1)
    # The producer drops the handshake: asyncio sends no alert, so the client sees a reset.
    with pytest.raises(OSError):
        await asyncio.open_connection(host, int(port), ssl=context)


async def test_tls_and_plain_do_not_mix(secured: Producer, producer_db: str, certs: Certs) -> None:
    with pytest.raises(ConnectionLostError, match="before its SERVER_HELLO \\(does it require TLS"):
        await asyncio.to_thread(Client, secured.address, token=BILLING)
    async with Producer(producer_db.replace(".db", "-plain.db")) as plain:
        with pytest.raises(TLSError, match="the producer does not speak TLS"):
            await asyncio.to_thread(Client, plain.address, tls=certs.client)
        with pytest.raises(TLSError, match="the producer does not speak TLS"):
            await Consumer(plain.address, "orders", tls=certs.client).start()


# --- authentication and authorization on every request --------------------------------------


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "this producer requires a token; none was sent"),
        (
            make_token(b"not the producer's secret", "billing"),
            "invalid token: not issued with this producer's secret",
        ),
        (make_token(SECRET, "intruder"), "consumer 'intruder' has no grants on this producer"),
    ],
    ids=["no token", "other secret", "no grants"],
)
async def test_authentication_failures(
    token: str | None, message: str, secured: Producer, bystander: Consumer, certs: Certs
) -> None:
    exact = f"^{re.escape(message)}$"
    with pytest.raises(AuthenticationFailedError, match=exact):
        await Consumer(secured.address, "orders", tls=certs.client, token=token).start()

    def head() -> int:
        with Client(secured.address, tls=certs.client, token=token) as client:
            return client.head("orders").head

    with pytest.raises(AuthenticationFailedError, match=exact):
        await asyncio.to_thread(head)
    received, _ = await raw_exchange(
        secured.address,
        certs.client,
        ClientHello(PROTOCOL_VERSION, "raw", token),
        Subscribe("orders", 1, "raw", None),
    )
    assert_refused(received, ErrorCode.AUTHENTICATION_FAILED)
    assert received[-1] == Error(ErrorCode.AUTHENTICATION_FAILED, message, {})
    await check_unharmed(secured, bystander)


REQUESTS_ON_SECRET: list[Message] = [
    Subscribe("secret", 1, "billing", None),
    GetHead("secret"),
    GetRange("secret", 1, 6),
    GetHistory("secret", b"k", 1, 6),
    SeekTime("secret", 0),
    ReportPosition("secret", "billing", 5),
    GetStatus(),
]


@pytest.mark.parametrize("request_", REQUESTS_ON_SECRET, ids=lambda m: m.TYPE.name)
async def test_requests_outside_the_grants(
    request_: Message, secured: Producer, bystander: Consumer, certs: Certs
) -> None:
    received, _ = await raw_exchange(
        secured.address, certs.client, ClientHello(PROTOCOL_VERSION, "raw", BILLING), request_
    )
    assert_refused(received, ErrorCode.NOT_AUTHORIZED, authenticated=True)
    error = received[-1]
    assert isinstance(error, Error)
    if isinstance(request_, GetStatus):
        assert error.message == (
            "consumer 'billing' may not ask for the status report: that needs admin permission"
        )
    else:
        assert error.message == "consumer 'billing' may not read stream 'secret'"
        assert error.details == {"stream": "secret", "consumer": "billing"}
    assert not any(isinstance(m, Records) for m in received)
    await check_unharmed(secured, bystander)


async def test_clients_see_not_authorized(secured: Producer, certs: Certs) -> None:
    with pytest.raises(NotAuthorizedError, match="may not read stream 'secret'"):
        await Consumer(secured.address, "secret", tls=certs.client, token=BILLING).start()
    # Unknown streams outside the grants are refused the same way: no probing for names.
    with pytest.raises(NotAuthorizedError, match="may not read stream 'nope'"):
        await Consumer(secured.address, "nope", tls=certs.client, token=BILLING).start()

    def requests() -> None:
        client = Client(secured.address, tls=certs.client, token=BILLING)
        with client, pytest.raises(NotAuthorizedError, match="may not read stream 'secret'"):
            list(client.read_range("secret", 1, 6))
        client = Client(secured.address, tls=certs.client, token=BILLING)
        with client, pytest.raises(NotAuthorizedError, match="status report"):
            client.status()

    await asyncio.to_thread(requests)


async def test_admin_sees_status_and_every_stream(
    secured: Producer, bystander: Consumer, certs: Certs
) -> None:
    def requests() -> tuple[dict[str, Any], list[str]]:
        with Client(secured.address, tls=certs.client, token=OPS) as client:
            return client.status(), [s.stream for s in client.streams()]

    status, streams = await asyncio.to_thread(requests)
    assert status["producer_id"] == secured.producer_id
    assert [s["stream"] for s in status["streams"]] == ["orders", "secret"]
    # Who subscribed, as its token proved, beside the free name it gave.
    assert [(c["consumer"], c["principal"]) for c in status["consumers"]] == [
        ("anonymous", "billing")
    ]
    assert streams == []  # "ops" may ask for the status, and may read no stream


async def test_token_to_a_producer_without_auth(producer_db: str) -> None:
    """Tokens can be rolled out to clients before producers check them."""
    async with Producer(producer_db) as producer:
        await producer.publish("orders", b"x")
        received, _ = await raw_exchange(
            producer.address,
            None,
            ClientHello(PROTOCOL_VERSION, "raw", BILLING),
            ListStreams(),
            frames=3,
        )
        assert [type(m) for m in received] == [ServerHello, Authenticated, StreamList]
        assert received[1] == Authenticated(None)
        async with Consumer(producer.address, "orders", token=BILLING) as consumer:
            assert (await anext(consumer)).last_seq == 1


async def test_auth_without_tls(producer_db: str) -> None:
    async with Producer(producer_db, settings=ServerSettings(auth=AUTH)) as producer:
        await producer.publish("orders", b"x")
        async with Consumer(producer.address, "orders", token=BILLING) as consumer:
            assert (await anext(consumer)).last_seq == 1
        with pytest.raises(StreamQError, match="requires a token"):
            await Consumer(producer.address, "orders").start()


async def test_consumer_reconnects_over_tls_with_its_token(producer_db: str, certs: Certs) -> None:
    settings = ServerSettings(tls=certs.server, auth=AUTH)
    async with Producer(producer_db, settings=settings) as producer:
        await producer.publish("orders", b"before")
        address = producer.address
        consumer = Consumer(address, "orders", tls=certs.client, token=BILLING)
        await consumer.start()
        assert [r.value for r in await anext(consumer)] == [b"before"]
    port = int(address.rsplit(":", 1)[1])
    try:
        async with Producer(producer_db, port=port, settings=settings) as restarted:
            await restarted.publish("orders", b"after")
            batch = await asyncio.wait_for(anext(consumer), 20)
            assert [(r.seq, r.value) for r in batch] == [(2, b"after")]
            assert consumer.reconnects == 1
    finally:
        await consumer.close()


def test_sync_producer_serves_tls_and_tokens(tmp_path: Path, certs: Certs) -> None:
    settings = ServerSettings(tls=certs.server, auth=AUTH)
    with SyncProducer(str(tmp_path / "sync.db"), settings=settings) as producer:
        producer.publish("orders", b"x")
        with Client(producer.address, tls=certs.client, token=BILLING) as client:
            assert client.consumer == "billing"
            assert [r.value for batch in client.read_range("orders", 1, 2) for r in batch] == [b"x"]
        with pytest.raises(TLSError, match="requires a client certificate"):
            Client(producer.address, tls=ClientTLS(certs.ca), token=BILLING)


# --- the command line ------------------------------------------------------------------------


def test_cli_serves_tls_and_tokens(tmp_path: Path, certs: Certs) -> None:
    """Secrets come from files and the environment; argv carries only their paths."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    db = str(tmp_path / "orders.db")
    assert run("init", db).returncode == 0
    assert run("publish", db, "orders", "one", "two").returncode == 0
    serve_env = {**os.environ, "STREAMQ_TOKEN_SECRET": SECRET.decode()}
    server = certs.server
    tls = ["--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", certs.ca]
    grants = ["--grant", "billing=orders,refunds.*", "--admin", "ops"]
    process = subprocess.Popen(
        [*STREAMQ, "serve", db, "--port", "0", *tls, *grants],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=serve_env,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert first.startswith("serving producer"), first + process.stderr.read()
        address = first.rsplit(" on ", 1)[1].strip()

        made = run("token", "billing", "--secret-file", str(secret_file))
        assert made.stdout.strip() == BILLING
        token_file = tmp_path / "billing.token"
        token_file.write_text(made.stdout)
        client = ["--tls-ca", certs.ca, "--tls-cert", certs.client.cert, "--tls-key"]
        client.append(str(certs.client.key))
        token = ["--token-file", str(token_file)]
        tail = run("tail", address, "orders", "--from", "1", "--count", "2", *client, *token)
        assert (tail.returncode, tail.stdout.count("\n")) == (0, 2), tail.stderr

        refused = run("tail", address, "orders", *client)  # no token
        assert refused.returncode == 1
        assert "this producer requires a token; none was sent" in refused.stderr
        not_admin = run("status", address, *client, "--token", BILLING)
        assert "may not ask for the status report" in not_admin.stderr
        no_cert = run("status", address, "--tls-ca", certs.ca, "--token", OPS)
        assert "it requires a client certificate (mutual TLS)" in no_cert.stderr
        status = subprocess.run(
            [*STREAMQ, "status", address, *client, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "STREAMQ_TOKEN": OPS},
            check=False,
        )
        assert json.loads(status.stdout)["streams"][0]["head"] == 2, status.stderr
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode == 0


async def test_positions_are_reported_under_the_token_name(
    secured: Producer, certs: Certs, tmp_path: Path
) -> None:
    """A token holder cannot move another consumer's position (and with it, retention):
    with tokens, ACKs and REPORT_POSITION count for the consumer the token proved."""
    await secured.register_consumer("ledger", "orders")

    def report_as_ledger() -> None:
        with Client(secured.address, tls=certs.client, token=BILLING) as client:
            client.report_position("orders", "ledger", 20)

    await asyncio.to_thread(report_as_ledger)
    async with Consumer(
        secured.address,
        "orders",
        db=str(tmp_path / "c.db"),
        name="ledger",
        tls=certs.client,
        token=BILLING,
    ) as consumer:
        batch = await anext(consumer)
        await consumer.apply(batch, lambda tx, batch: None)
        await secured.wait_applied("billing", "orders", 20, timeout=10)
    positions = {(p.consumer, p.applied) for p in secured.consumer_lags()}
    assert ("ledger", 0) in positions  # untouched by billing's reports
    assert ("billing", 20) in positions


async def test_fetch_lag_and_fan_in_lag_use_tls_and_token(secured: Producer, certs: Certs) -> None:
    """``fetch_lag`` asks on a connection of its own: with the consumer's TLS and token."""
    async with Consumer(secured.address, "orders", tls=certs.client, token=BILLING) as consumer:
        assert (await anext(consumer)).last_seq == 20
        await secured.publish("orders", b"one more")
        assert await asyncio.wait_for(consumer.fetch_lag(), 10) == 1
    async with FanInConsumer(
        [secured.address], "orders", tls=certs.client, token=BILLING
    ) as fan_in:
        assert await asyncio.wait_for(fan_in.fetch_lag(), 10) == 21


async def test_asyncio_history_takes_tls_and_token(secured: Producer, certs: Certs) -> None:
    async with secured.transaction() as tx:
        await tx.publish("orders", b"v", key=b"k")
    found = await streamq.history(
        secured.address, "orders", b"k", tls=certs.client, token=BILLING, timeout=10
    )
    assert [r.value for r in found] == [b"v"]


async def test_cli_status_joins_connections_to_token_positions(
    secured: Producer,
    certs: Certs,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With tokens, positions count under the token's name, not the free name a consumer
    subscribes with: the status table still shows one row per consumer, connected."""
    async with Consumer(
        secured.address,
        "orders",
        db=str(tmp_path / "c.db"),
        name="billing-app",
        tls=certs.client,
        token=BILLING,
    ) as consumer:
        await consumer.apply(await anext(consumer), lambda tx, batch: None)
        await secured.wait_applied("billing", "orders", 20, timeout=10)
        client = ["--tls-ca", certs.ca, "--tls-cert", str(certs.client.cert)]
        client += ["--tls-key", str(certs.client.key), "--token", OPS]
        argv = ["status", secured.address, *client]
        monkeypatch.setenv("COLUMNS", "200")  # the table on one line per row
        assert await asyncio.to_thread(cli.main, argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "billing" in line]
    assert len(rows) == 1 and "127.0.0.1:" in rows[0], rows


async def test_unknown_stream_errors_name_only_granted_streams(
    secured: Producer, certs: Certs
) -> None:
    """An unknown stream within the grants names the producer's streams: only those the
    consumer may read, or the error would list the streams LIST_STREAMS hides."""

    def ask() -> None:
        with (
            Client(secured.address, tls=certs.client, token=BILLING) as client,
            pytest.raises(UnknownStreamError) as raised,
        ):
            client.head("refunds.eu")
        assert "secret" not in str(raised.value)
        assert "'orders'" in str(raised.value)

    await asyncio.to_thread(ask)
    with pytest.raises(UnknownStreamError) as raised:
        await Consumer(secured.address, "refunds.eu", tls=certs.client, token=BILLING).start()
    assert "secret" not in str(raised.value)


@pytest.mark.parametrize("field", ["ca", "cert", "key"])
def test_a_missing_pem_file_is_named(field: str, certs: Certs, tmp_path: Path) -> None:
    """OpenSSL's error for a missing file names no file: the user could not tell which."""
    missing = str(tmp_path / f"missing-{field}.pem")
    files = {"ca": certs.ca, "cert": certs.client.cert, "key": certs.client.key, field: missing}
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        ClientTLS(**files).context()
    server = {"cert": certs.server.cert, "key": certs.server.key, "client_ca": certs.ca}
    server[{"ca": "client_ca"}.get(field, field)] = missing
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        ServerTLS(**server).context()


async def test_shares_of_a_token_consumer_report_positions_of_their_own(
    producer_db: str, consumer_db: str
) -> None:
    """With tokens, ACKs count under the token's consumer; each share under its own name,
    so a share that is behind holds retention back on its own."""
    async with Producer(producer_db, settings=ServerSettings(auth=AUTH)) as producer:
        async with producer.transaction() as tx:
            for n in range(40):
                await tx.publish("orders", b"%d" % n, key=b"k%d" % n)
        await producer.register_consumer("billing[0/2]", "orders")
        await producer.register_consumer("billing[1/2]", "orders")
        async with Consumer(
            producer.address, "orders", db=consumer_db, name="anything", share=(0, 2), token=BILLING
        ) as first:
            while first.applied < 40:
                async with first.transaction(await anext(first)):
                    pass
            await producer.wait_applied("billing[0/2]", "orders", 40, timeout=10)
        lags = {p.consumer: p.applied for p in producer.consumer_lags()}
        assert lags["billing[0/2]"] == 40 and lags["billing[1/2]"] == 0
        assert "billing" not in lags
        await producer.apply_retention()
        assert producer.log.streams["orders"].low == 1  # share 1 has applied nothing yet
        async with Consumer(
            producer.address, "orders", db=consumer_db, name="anything", share=(1, 2), token=BILLING
        ) as second:
            while second.applied < 40:
                async with second.transaction(await anext(second)):
                    pass
            await producer.wait_applied("billing[1/2]", "orders", 40, timeout=10)
        await producer.apply_retention()
        assert producer.log.streams["orders"].low > 40  # both shares applied everything

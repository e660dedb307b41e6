"""Who may connect to a producer, and what they may read: TLS and token authentication.

TLS (``ServerTLS``, ``ClientTLS``) protects the bytes and, with a client CA,
admits only clients holding a certificate that CA signed (mutual TLS). Both
sides require TLS 1.3. The settings are file paths, not ``ssl.SSLContext``
objects, so that they pickle (Spark ships them to executors).

Tokens (``TokenAuth``) name a consumer: ``NAME:HEX``, where HEX is
HMAC-SHA256(secret, "streamq-token-v1" NUL NAME). The producer holds the
secret and a table consumer -> stream patterns; a token proves the name, the
table says what that name may read. Revoke a consumer by removing it from the
table, or every token at once by changing the secret. Tokens travel in
CLIENT_HELLO: send them over TLS only, or anyone on the path can replay them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..errors import AuthenticationFailedError, NotAuthorizedError, TLSError

MIN_SECRET_BYTES = 16
_TOKEN_CONTEXT = b"streamq-token-v1\x00"


# --- TLS ------------------------------------------------------------------------


def _tls13_context(purpose: ssl.Purpose) -> ssl.SSLContext:
    context = ssl.create_default_context(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def _load(load: Callable[..., None], *paths: str | None) -> None:
    """``load(*paths)``; a file that cannot be read is named (OpenSSL's error names none)."""
    try:
        load(*paths)
    except OSError as exc:
        if isinstance(exc, ssl.SSLError) or exc.filename is not None:
            raise
        unreadable = next((p for p in paths if p and not os.access(p, os.R_OK)), None)
        if unreadable is None:
            raise
        raise type(exc)(exc.errno, exc.strerror, unreadable) from exc


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The producer's certificate chain and key (PEM files); with ``client_ca``, clients must
    present a certificate signed by that CA (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def context(self) -> ssl.SSLContext:
        """The ``ssl`` context these settings make (TLS 1.3 only)."""
        context = _tls13_context(ssl.Purpose.CLIENT_AUTH)
        _load(context.load_cert_chain, self.cert, self.key)
        if self.client_ca is not None:
            _load(context.load_verify_locations, self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How a consumer or client checks the producer (``ca``: PEM file of the CA that signed the
    producer's certificate; None: the system's CAs) and, for mutual TLS, its own certificate.

    The producer's certificate must name the host connected to (an IP address or DNS name),
    or ``server_name`` when it is set.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None and self.cert is None:
            raise ValueError("ClientTLS: key= needs cert=")

    def context(self) -> ssl.SSLContext:
        """The ``ssl`` context these settings make (TLS 1.3 only)."""
        context = _tls13_context(ssl.Purpose.SERVER_AUTH)
        if self.ca is not None:
            _load(context.load_verify_locations, self.ca)
        if self.cert is not None:
            _load(context.load_cert_chain, self.cert, self.key)
        return context


# Why a handshake failed, by OpenSSL reason: what the user should know or do.
_TLS_REASONS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": (
        "the producer requires a client certificate (mutual TLS); set cert and key"
    ),
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the producer rejected this client's certificate: expired",
    "TLSV1_ALERT_UNKNOWN_CA": (
        "the producer does not trust the CA that signed this client's certificate"
    ),
    "SSLV3_ALERT_BAD_CERTIFICATE": "the producer rejected this client's certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the producer rejected this client's certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "the producer rejected this client's certificate",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common (streamq requires TLS 1.3)",
    "UNSUPPORTED_PROTOCOL": "no TLS version in common (streamq requires TLS 1.3)",
    "WRONG_VERSION_NUMBER": "the producer does not speak TLS (is TLS enabled there?)",
    "RECORD_LAYER_FAILURE": "the producer does not speak TLS (is TLS enabled there?)",
    "PACKET_LENGTH_TOO_LONG": "the producer does not speak TLS (is TLS enabled there?)",
}


def tls_error(exc: ssl.SSLError, address: str) -> TLSError:
    """A ``TLSError`` naming why the TLS handshake with ``address`` failed (cause chained)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = f"the producer's certificate failed verification: {exc.verify_message}"
    else:
        why = _TLS_REASONS.get(str(exc.reason), f"{exc.reason or exc}")
    error = TLSError(f"TLS with producer at {address} failed: {why}")
    error.__cause__ = exc
    return error


def tls_refused(address: str, tls: ClientTLS) -> TLSError:
    """The producer closed the connection right after the TLS handshake, before SERVER_HELLO.

    With TLS 1.3 a server checks the client's certificate after the client's side of the
    handshake is done, and asyncio closes without sending the TLS alert that says why: an
    immediate close is how a producer refuses a client certificate.
    """
    if tls.cert is None:
        why = "it requires a client certificate (mutual TLS); set cert and key"
    else:
        why = "it refused this client's certificate (expired, or not signed by a CA it trusts)"
    return TLSError(
        f"TLS with producer at {address} failed: the producer closed the connection right "
        f"after the handshake: {why}"
    )


# --- Tokens and permissions -------------------------------------------------------------


def make_token(secret: bytes, consumer: str) -> str:
    """The token that names ``consumer`` to producers holding ``secret``."""
    if not consumer or ":" in consumer:
        raise ValueError(f"a consumer name must be non-empty and have no ':': {consumer!r}")
    return f"{consumer}:{_digest(secret, consumer)}"


def _digest(secret: bytes, consumer: str) -> str:
    return hmac.new(secret, _TOKEN_CONTEXT + consumer.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated consumer and what it may do."""

    name: str
    streams: tuple[str, ...]  # fnmatch patterns
    admin: bool

    def may_read(self, stream: str) -> bool:
        return any(fnmatch.fnmatchcase(stream, pattern) for pattern in self.streams)


class TokenAuth:
    """Token authentication for one producer.

    ``grants`` maps each consumer name to the stream patterns it may read
    (``fnmatch``: ``"orders"``, ``"orders.*"``, ``"*"``); ``admins`` may also ask
    for the status report, which names every stream and consumer. A request for a
    stream outside the grants is refused with NOT_AUTHORIZED; LIST_STREAMS shows
    only the streams granted.
    """

    def __init__(
        self, secret: bytes, grants: Mapping[str, Iterable[str]], admins: Iterable[str] = ()
    ) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the token secret must have at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        principals = {name: Principal(name, tuple(globs), False) for name, globs in grants.items()}
        for name in admins:
            granted = principals.get(name)
            principals[name] = Principal(name, granted.streams if granted else (), True)
        self._principals = principals

    def __repr__(self) -> str:  # never the secret
        return f"TokenAuth(consumers={sorted(self._principals)!r})"

    def authenticate(self, token: str | None) -> Principal:
        """The consumer ``token`` names; raises ``AuthenticationFailedError``."""
        if token is None:
            raise AuthenticationFailedError("this producer requires a token; none was sent")
        name, sep, digest = token.rpartition(":")
        expected = _digest(self._secret, name)
        # compare_digest: the time taken tells nothing about how much of the digest matched.
        if not sep or not hmac.compare_digest(digest.encode(), expected.encode()):
            raise AuthenticationFailedError("invalid token: not issued with this producer's secret")
        principal = self._principals.get(name)
        if principal is None:
            raise AuthenticationFailedError(f"consumer {name!r} has no grants on this producer")
        return principal


def check_stream(principal: Principal | None, stream: str) -> None:
    """Raise ``NotAuthorizedError`` unless ``principal`` (None: auth is off) may read ``stream``."""
    if principal is not None and not principal.may_read(stream):
        raise NotAuthorizedError(
            f"consumer {principal.name!r} may not read stream {stream!r}",
            {"stream": stream, "consumer": principal.name},
        )


def check_admin(principal: Principal | None, what: str) -> None:
    if principal is not None and not principal.admin:
        raise NotAuthorizedError(
            f"consumer {principal.name!r} may not ask for {what}: that needs admin permission",
            {"consumer": principal.name},
        )


def read_secret(*, path: str | None = None, env: str | None = None) -> bytes | None:
    """A secret from a file (first line, stripped) or else an environment variable.

    Secrets do not belong on a command line, where every user of the machine sees them.
    """
    if path is not None:
        with open(path, "rb") as file:
            return file.readline().strip()
    if env is not None and (value := os.environ.get(env)):
        return value.strip().encode()
    return None

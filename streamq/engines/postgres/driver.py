"""psycopg 3, for every PostgreSQL connection streamq opens itself: imported only when a
PostgreSQL database is used (``pip install 'streamq[postgres]'``), and errors that name
the database without repeating its password."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ...errors import DatabaseOpenError


def psycopg_module() -> Any:
    """psycopg, or an ImportError that says what to install."""
    try:
        import psycopg
    except ImportError as exc:
        raise ImportError("PostgreSQL needs psycopg 3: pip install 'streamq[postgres]'") from exc
    return psycopg


def redacted(url: str) -> str:
    """``url`` without its password, to name the database in errors and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:  # not even a URL: hide whatever stands before an @
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else url


def database(url: str) -> str:
    """How messages name the database at ``url``."""
    return f"PostgreSQL database {redacted(url)}"


def cannot_open(what: str, url: str, exc: Exception) -> DatabaseOpenError:
    """The error for a database that cannot be opened. libpq's message may quote the URL,
    password included: it is hidden there too."""
    reason = str(exc)
    userinfo = url.partition("://")[2].partition("/")[0].rpartition("@")[0]
    password = userinfo.partition(":")[2]
    if password:
        reason = reason.replace(password, "***")
    return DatabaseOpenError(f"cannot open {what}: {reason}")


def _options(application_name: str, autocommit: bool, connect_timeout: float) -> dict[str, Any]:
    # libpq counts whole seconds, and takes less than 2 as 2.
    timeout = max(2, math.ceil(connect_timeout))
    return {
        "autocommit": autocommit,
        "application_name": application_name,
        "connect_timeout": timeout,
    }


async def connect_async(
    url: str,
    what: str,
    *,
    application_name: str = "streamq",
    autocommit: bool = True,
    connect_timeout: float = 10.0,
) -> Any:
    """A psycopg ``AsyncConnection``, or ``DatabaseOpenError`` naming ``what``."""
    psycopg = psycopg_module()
    options = _options(application_name, autocommit, connect_timeout)
    try:
        return await psycopg.AsyncConnection.connect(url, **options)
    except psycopg.Error as exc:
        raise cannot_open(what, url, exc) from exc


def connect(
    url: str,
    what: str,
    *,
    application_name: str = "streamq",
    autocommit: bool = True,
    connect_timeout: float = 10.0,
) -> Any:
    """A psycopg ``Connection``, or ``DatabaseOpenError`` naming ``what``."""
    psycopg = psycopg_module()
    options = _options(application_name, autocommit, connect_timeout)
    try:
        return psycopg.Connection.connect(url, **options)
    except psycopg.Error as exc:
        raise cannot_open(what, url, exc) from exc


# SQLSTATEs of a session the server ended or would not start, where waiting may cure it:
# connection exceptions (class 08), the server shutting down (administrator's or crash)
# or starting up, and no connection slot free.
_LOST = ("57P01", "57P02", "57P03", "53300")


def connection_lost(error: BaseException) -> bool:
    """``error`` is a connection to the server lost or refused (it restarted, crashed, is
    starting up or unreachable), raised by psycopg or by ``connect`` (whose
    ``DatabaseOpenError`` chains psycopg's); not a statement's own failure."""
    if isinstance(error, DatabaseOpenError):
        error = error.__cause__ or error
    if not isinstance(error, psycopg_module().OperationalError):
        return False
    sqlstate = error.sqlstate
    # No SQLSTATE: libpq's own (refused, closed unexpectedly, the connection is closed).
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _LOST


def in_transaction(conn: Any) -> bool:
    """A transaction is open (or failed and not yet rolled back) on ``conn``, sync or
    asyncio, and the connection is still there to end it."""
    if conn.broken or conn.closed:
        return False  # the server ended the transaction with the connection
    return bool(conn.info.transaction_status != psycopg_module().pq.TransactionStatus.IDLE)

"""The console's web layer (Starlette, served by uvicorn): one page, its static files,
and a small JSON API over ``Watch``. Live updates are server-sent events: each poll's
snapshot is sent whole to every page open, so a page never polls and never misses one.

Reading needs nothing; an action (a dead letter's retry) needs an admin token, as the
producer's are made (``streamq token``, a secret and ``--admin`` names), in an
``Authorization: Bearer`` header. Tokens never travel in cookies, so another site's page
cannot make a browser act (no CSRF)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..captured import json_default
from ..errors import AuthenticationFailedError, StreamQError
from ..wire.security import TokenAuth
from .watch import Watch

logger = logging.getLogger("streamq.console")


def _json(data: Any, status: int = 200) -> Response:
    """JSON with bytes as hex (a captured change's bytea), as ``streamq tail --json``."""
    body = json.dumps(data, default=json_default, separators=(",", ":"))
    return Response(body, status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


class Console:
    """The app around one ``Watch``: it polls every ``interval`` seconds while served."""

    def __init__(self, watch: Watch, *, interval: float = 1.0, auth: TokenAuth | None = None):
        self.watch, self.interval, self.auth = watch, interval, auth
        self._polled = asyncio.Condition()
        self._polls = 0
        static = StaticFiles(packages=[("streamq.console", "static")])
        self.app = Starlette(
            routes=[
                Route("/", self.page),
                Route("/api/state", self.state),
                Route("/api/events", self.events),
                Route("/api/tail", self.tail),
                Route("/api/dead-letters/retry", self.retry, methods=["POST"]),
                Mount("/static", static, name="static"),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(self._poll_forever())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.to_thread(self.watch.close)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.watch.poll)
            except Exception:  # a bug here must not freeze the page: say it, poll again
                logger.exception("streamq console: a poll failed")
            async with self._polled:
                self._polls += 1
                self._polled.notify_all()
            await asyncio.sleep(self.interval)

    def _snapshot(self) -> dict[str, Any]:
        return {**self.watch.latest, "actions": self.auth is not None}

    async def page(self, request: Request) -> Response:
        html = resources.files("streamq.console").joinpath("static/index.html").read_text()
        return HTMLResponse(html)

    async def state(self, request: Request) -> Response:
        return _json(self._snapshot())

    async def events(self, request: Request) -> Response:
        """Server-sent events: the last poll's snapshot at once (after the first poll),
        then each poll's."""

        async def snapshots() -> AsyncIterator[str]:
            seen = 0
            while True:
                async with self._polled:
                    while self._polls == seen:
                        await self._polled.wait()
                    seen = self._polls
                body = json.dumps(self._snapshot(), default=json_default, separators=(",", ":"))
                yield f"data: {body}\n\n"

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(snapshots(), media_type="text/event-stream", headers=headers)

    async def tail(self, request: Request) -> Response:
        producer = request.query_params.get("producer", "")
        stream = request.query_params.get("stream", "")
        after_text = request.query_params.get("after")
        if not producer or not stream:
            return _error(400, "give producer=HOST:PORT and stream=NAME")
        try:
            after = None if after_text is None else int(after_text)
        except ValueError:
            return _error(400, f"after must be a seq (an integer), not {after_text!r}")
        try:
            found = await asyncio.to_thread(self.watch.tail, producer, stream, after)
        except LookupError as exc:
            return _error(404, str(exc.args[0]))
        except (OSError, StreamQError) as exc:
            return _error(502, f"{producer}: {exc}")
        return _json(found)

    async def retry(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return _error(403, refused)
        try:
            body = await request.json()
            database, consumer, stream = (str(body[k]) for k in ("database", "consumer", "stream"))
            seq = int(body["seq"])
        except (ValueError, KeyError, TypeError):
            return _error(400, "give JSON {database, consumer, stream, seq}")
        try:
            marked = await asyncio.to_thread(self.watch.retry, database, consumer, stream, seq)
        except LookupError as exc:
            return _error(404, str(exc.args[0]))
        if not marked:
            return _error(404, f"no parked record {consumer} {stream} seq {seq} in {database}")
        return _json({"marked": marked})

    def _refused(self, request: Request) -> str | None:
        """Why this request may not act; None if it carries an admin's token."""
        if self.auth is None:
            return (
                "this console is read-only: start it with --token-secret-file and --admin "
                "NAME to allow actions"
            )
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "an action needs an admin token (streamq token): Authorization: Bearer TOKEN"
        try:
            principal = self.auth.authenticate(token.strip())
        except AuthenticationFailedError as exc:
            return str(exc)
        if not principal.admin:
            return f"{principal.name!r} is not an admin of this console"
        return None


def bind(host: str, port: int) -> socket.socket:
    """The console's listening socket, bound and listening before uvicorn serves it: its
    address can be printed at once (port 0: any free one), a request early waits."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


async def serve(
    console: Console,
    sock: socket.socket,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Serve ``console`` on ``sock`` until SIGINT or SIGTERM (uvicorn's handlers)."""
    config = uvicorn.Config(
        console.app,
        log_level="warning",
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        timeout_graceful_shutdown=1,  # the event streams never end by themselves
    )
    await uvicorn.Server(config).serve(sockets=[sock])

"""Recipe: gunicorn workers that are consumer group members too (docs/guides/groups.md,
"Deploying a group").

    BILLING_DB=billing.db STREAMQ_ADDRESS=127.0.0.1:7400 gunicorn --workers 3 \\
        --bind 127.0.0.1:8000 --pid gunicorn.pid \\
        -c python:tests.recipes.billing_app tests.recipes.billing_app:app

This module is the app and gunicorn's configuration (``-c python:``: its hooks). Each
worker runs a member of group ``billing`` (``tests.recipes.billing.member``) in a thread
of its own, on its own event loop: started by ``post_worker_init``, after the fork (a
thread or a socket made before it would be shared by every worker), and stopped by
``worker_exit``, which gives the worker's shares back to the others at once. A worker
``kill -9``ed runs no hook: the others take its shares from the stored positions, and
the master starts a new worker, which joins. ``GET /health`` shows the worker's shares.
Global names here are read as gunicorn settings when they match one: hence no ``group``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from typing import Any

from flask import Flask

import streamq
from streamq._loop import run

from . import billing

BILLING_DB = os.environ["BILLING_DB"]
STREAMQ_ADDRESS = os.environ["STREAMQ_ADDRESS"]
SHARES = 8
STOP_SECONDS = 20.0  # a member stopping waits for the batch it handed out, then leaves

logger = logging.getLogger("billing")


class Member:
    """The worker's group member: a thread running its own event loop."""

    def __init__(self) -> None:
        self._thread = threading.Thread(
            target=run_member, args=(self,), name="billing-member", daemon=True
        )
        self._stopping = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[None] | None = None
        self.joined: streamq.GroupConsumer | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    async def main(self) -> None:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        if self._stopping.is_set():
            return  # stopped before it began
        try:
            await billing.member(STREAMQ_ADDRESS, BILLING_DB, SHARES, joined=self._joined)
        except asyncio.CancelledError:
            pass  # stopped: the shares were given back
        except Exception as exc:
            # The worker exits (gracefully) and the master starts a new one: a worker
            # must not go on serving without its member.
            logger.exception("billing member failed: worker %d exits", os.getpid())
            self.error = exc
            os.kill(os.getpid(), signal.SIGTERM)

    def _joined(self, joined: streamq.GroupConsumer) -> None:
        self.joined = joined

    def state(self) -> dict[str, Any] | None:
        """The member's id and shares, read on its own loop; None before it joined."""
        loop, joined = self.loop, self.joined
        if loop is None or joined is None or self.error is not None:
            return None

        async def read() -> dict[str, Any]:
            return {"pid": os.getpid(), "member": joined.member, "held": joined.held}

        return asyncio.run_coroutine_threadsafe(read(), loop).result(timeout=5)

    def stop(self) -> None:
        """Close the member (its shares given back) and wait for the thread."""
        self._stopping.set()
        loop, task = self.loop, self.task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join(STOP_SECONDS)


def run_member(member: Member) -> None:
    run(member.main())


MEMBER: Member | None = None  # this worker's, once gunicorn has started it

app = Flask(__name__)


@app.get("/health")
def health() -> tuple[dict[str, Any], int]:
    """200 with the shares this worker holds, 503 while its member is not running."""
    state = None if MEMBER is None else MEMBER.state()
    if state is None:
        error = None if MEMBER is None else MEMBER.error
        return {"pid": os.getpid(), "error": repr(error) if error else "not joined yet"}, 503
    return state, 200


# --- gunicorn's hooks (-c python:tests.recipes.billing_app) ------------------------------


def post_worker_init(worker: Any) -> None:
    """In the worker, after the fork: start its member."""
    global MEMBER
    MEMBER = Member()
    MEMBER.start()


def worker_exit(server: Any, worker: Any) -> None:
    """In the worker, as it exits (TTOU, a restart, a graceful shutdown): leave the group."""
    if MEMBER is not None:
        MEMBER.stop()

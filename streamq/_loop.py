"""Event loop choice: uvloop when installed, the default asyncio loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory if it can be imported, else None (asyncio's default)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """``asyncio.run`` on uvloop when available."""
    with asyncio.Runner(loop_factory=loop_factory() if use_uvloop else None) as runner:
        return runner.run(main)

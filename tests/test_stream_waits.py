"""Waiting for a stream's next commit (``Stream.wait_beyond``): what every caught-up
subscription does once per commit. Woken by a commit, or not after its timeout, and no
wait left behind either way."""

from __future__ import annotations

import asyncio

import pytest

from streamq.log import Stream, TailBuffer


def stream(head: int = 5) -> Stream:
    return Stream(1, "orders", head, 1, TailBuffer(1 << 20, head + 1))


def commit(s: Stream, head: int) -> None:
    s.head = head
    s.notify()


async def test_already_beyond_returns_at_once() -> None:
    s = stream()
    assert await s.wait_beyond(4, timeout=0)
    assert not s._waiters


async def test_a_commit_wakes_every_waiter() -> None:
    s = stream()
    waits = [asyncio.create_task(s.wait_beyond(5, timeout=30)) for _ in range(3)]
    await asyncio.sleep(0)
    assert len(s._waiters) == 3
    commit(s, 6)
    async with asyncio.timeout(10):
        assert await asyncio.gather(*waits) == [True] * 3
    assert not s._waiters


async def test_a_wake_that_does_not_reach_the_seq_waits_on() -> None:
    s = stream()
    wait = asyncio.create_task(s.wait_beyond(7, timeout=30))
    await asyncio.sleep(0)
    commit(s, 6)  # not yet beyond 7
    await asyncio.sleep(0)
    assert not wait.done() and len(s._waiters) == 1
    commit(s, 8)
    async with asyncio.timeout(10):
        assert await wait
    assert not s._waiters


async def test_the_timeout_ends_a_wait_and_leaves_nothing() -> None:
    s = stream()
    for _ in range(3):  # a quiet stream: heartbeats wait again and again
        assert not await s.wait_beyond(5, timeout=0.01)
    assert not s._waiters


async def test_a_cancelled_wait_leaves_nothing() -> None:
    s = stream()
    wait = asyncio.create_task(s.wait_beyond(5, timeout=30))
    await asyncio.sleep(0)
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wait
    assert not s._waiters
    commit(s, 6)  # nobody left to wake

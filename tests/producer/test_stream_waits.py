"""Waiting for a stream's next commit (``Stream.wait_beyond``): what every caught-up
subscription does once per commit. Woken by a commit, or not after its timeout, and no
wait left behind either way."""

from __future__ import annotations

import asyncio

import pytest

from streamq.producer.committed_log import Stream, TailBuffer, Waits


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


# ``Stream.on_beyond``: the same wait as a callback, with no task (a WATCH_HEAD's).


async def test_on_beyond_calls_back_once_the_head_is_beyond() -> None:
    s = stream()
    s.waits = Waits()
    calls: list[int] = []
    called = asyncio.Event()

    def callback() -> None:
        calls.append(s.head)
        called.set()

    s.on_beyond(7, 30, callback)
    assert s.waits.count == 1
    commit(s, 6)  # not yet beyond 7: waits on
    await asyncio.sleep(0)
    assert not calls and len(s._waiters) == 1
    commit(s, 8)
    async with asyncio.timeout(10):
        await called.wait()
    assert calls == [8]
    assert not s._waiters and s.waits.count == 0


async def test_on_beyond_calls_back_when_time_is_up() -> None:
    s = stream()
    s.waits = Waits()
    called = asyncio.Event()
    s.on_beyond(5, 0.01, called.set)
    async with asyncio.timeout(10):
        await called.wait()
    assert s.head == 5
    assert not s._waiters and s.waits.count == 0


async def test_a_cancelled_on_beyond_calls_nothing_and_leaves_nothing() -> None:
    s = stream()
    s.waits = Waits()
    calls: list[None] = []
    beyond = s.on_beyond(5, 0.01, lambda: calls.append(None))
    beyond.cancel()
    beyond.cancel()  # twice: nothing more
    assert not s._waiters and s.waits.count == 0
    later = asyncio.Event()
    s.on_beyond(5, 0.02, later.set)  # timers run in deadline order: the first's is past
    async with asyncio.timeout(10):
        await later.wait()
    commit(s, 6)
    await asyncio.sleep(0)
    assert calls == []

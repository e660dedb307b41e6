"""The workers workload's synchronous path alone (the package's docstring): ``python -m
bench.workers.sync_path VARIANT DB THREADS COUNT SECONDS``."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time

import streamq

from ..common import say
from ..transfer.common import open_db
from .common import (
    AMOUNT,
    INSERT_ORDER,
    STREAM,
    SYNC_VARIANTS,
    WARM_UP,
    Outcome,
    PlaceOrder,
    commit_orders,
    order_event,
    outbox_event,
    place_order,
    publish_event,
    synchronous,
)


def place_order_sync(producer: streamq.SyncProducer, worker: int, number: int, due_ns: int) -> None:
    """One order through ``SyncProducer.transaction`` (its connection for this thread)."""
    with producer.transaction() as tx:
        order_id = tx.execute(INSERT_ORDER, (worker, number, AMOUNT, due_ns)).lastrowid
        assert order_id is not None
        tx.publish(STREAM, order_event(due_ns, order_id, worker, number))


def schedstat() -> tuple[float, float]:
    """The calling thread's (seconds on a CPU, seconds runnable but waiting for one), from
    ``/proc/thread-self/schedstat`` (Linux; zeros elsewhere): a writer's wall time is
    those two and what it waited for otherwise (the disk, a lock)."""
    try:
        with open("/proc/thread-self/schedstat") as file:
            on_cpu, waiting, _ = file.read().split()
    except OSError:
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def sync_path(variant: str, db: str, threads: int, count: int, seconds: float) -> None:
    """``count`` orders from ``threads`` threads of this process, each on its own connection."""
    if variant not in SYNC_VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; choose from {SYNC_VARIANTS}")
    outcomes: list[Outcome] = []
    settings: list[int] = []
    spent: list[tuple[float, float]] = []  # each thread's CPU and run-queue wait, timed
    start_ns = [0]  # set when every thread is warm and waiting

    def mark_start() -> None:
        start_ns[0] = time.monotonic_ns()

    started = threading.Barrier(threads, action=mark_start)
    with contextlib.ExitStack() as stack:
        producer = None
        if variant.startswith("SyncProducer"):
            serving = variant == "SyncProducer serving"  # on a free port of loopback
            producer = stack.enter_context(streamq.SyncProducer(db, serve=serving))

        def run(index: int) -> None:
            with contextlib.ExitStack() as own:
                place: PlaceOrder
                if producer is not None:
                    place = functools.partial(place_order_sync, producer)
                    setting = int(producer.query("PRAGMA synchronous")[0][0])
                else:
                    conn = own.enter_context(contextlib.closing(open_db(db)))
                    emit = publish_event if variant == "publish" else outbox_event
                    place = functools.partial(place_order, conn, emit)
                    setting = synchronous(conn)
                place(index, WARM_UP, time.monotonic_ns())  # connected, SQL prepared
                settings.append(setting)
                started.wait(seconds)
                deadline_ns = start_ns[0] + int(seconds * 1e9)
                cpu, waited = schedstat()
                outcome = commit_orders(
                    place, index, threads, count // threads, 0, start_ns[0], deadline_ns
                )
                cpu_end, waited_end = schedstat()
                spent.append((cpu_end - cpu, waited_end - waited))
                outcomes.append(outcome)

        workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(2 * seconds + 60)
    if len(outcomes) != threads:
        raise SystemExit(f"sync {variant}: {threads - len(outcomes)} threads did not finish")
    committed = sum(o.committed for o in outcomes)
    elapsed = (max(o.end_ns for o in outcomes) - start_ns[0]) / 1e9
    refused = sum(sum(o.refused.values()) for o in outcomes)
    cpu = sum(c for c, _ in spent)
    waited = sum(w for _, w in spent)
    setting = ",".join(map(str, sorted(set(settings))))
    say("DONE", committed / elapsed, committed, refused, setting, cpu, waited)


if __name__ == "__main__":
    variant, db, threads, count, seconds = sys.argv[1:]
    sync_path(variant, db, int(threads), int(count), float(seconds))

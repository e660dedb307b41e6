"""The fan-out workload's stopped consumer: one consumer among N is stopped (``SIGSTOP``)
for a while, then let go while the records keep coming. What it costs the others (their
p99 before, while it is stopped, in the seconds after it is let go, while it catches
up, and later), how soon it is caught up, and what the serving process holds for it
meanwhile (its RSS).

``python -m bench.fanout.stopped [--quick] [--consumers N] [--stop SECONDS]``: streamq's
embedded server and ``streamq serve``, one run each, at 1,000 records/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from ..common import Child, console, pin, proc_kib, save
from ..measure import Latencies
from . import cores
from .run import DRAIN_TIMEOUT, READY_TIMEOUT, Side, split, streamq_serve_side, streamq_side

RATE = 1_000
CONSUMERS, QUICK_CONSUMERS = 50, 10
STOP, QUICK_STOP = 20.0, 3.0  # s the one consumer is stopped
BEFORE, QUICK_BEFORE = 5.0, 3.0  # s of publishing before it is stopped
AFTER, QUICK_AFTER = 15.0, 4.0  # s of publishing after it is let go
SETTLING = 1.0  # s from the first record not counted in "before": connections warm up
RECOVERY = 2.0  # s after the release counted apart ("after release")
CAUGHT_UP_US = 100_000  # the stopped consumer is caught up from the first second this fast
SAMPLE_EVERY = 0.25  # s between samples of the serving process's RSS
SYSTEMS = {"streamq": streamq_side, "streamq serve": streamq_serve_side}


def by_second(field: str) -> dict[int, str]:
    """A DONE line's last field (``Tally.say_done``): each second's histogram, encoded."""
    return {int(s): h for s, _, h in (item.partition(":") for item in field.split(","))}


def window(seconds: Iterable[dict[int, str]], begin: float, end: float) -> dict[str, int]:
    """p50, p99 and max (µs) of the records due from ``begin`` to ``end`` (the whole
    seconds of wall-clock time inside), over every process's consumers."""
    inside = [h for each in seconds for s, h in each.items() if begin <= s and s + 1 <= end]
    p50, p99, _, worst, count = Latencies.merged(inside).figures()
    return {"p50_us": p50, "p99_us": p99, "max_us": worst, "records": count}


@contextlib.contextmanager
def sampling_rss(pid: int) -> Iterator[list[tuple[float, int]]]:
    """(time, RSS in KiB) of process ``pid``, every ``SAMPLE_EVERY`` s while the block runs,
    on a thread."""
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_EVERY):
            with contextlib.suppress(OSError):
                samples.append((time.time(), proc_kib(pid, "VmRSS")))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def run_once(
    side: Side, consumers: int, before: float, stop: float, after: float
) -> dict[str, Any]:
    """The others and the one to stop connected and pinned; the records published; the
    one stopped at ``before`` s, let go ``stop`` s later."""
    total = int(RATE * (before + stop + after))
    serving_cores, consumer_cores = cores()
    producer = side.producer
    with contextlib.ExitStack() as stack:
        others = [
            stack.enter_context(
                Child(side.consumers, "consumers", *side.address, n, total, "--by-second")
            )
            for n in split(consumers - 1)
        ]
        stopped = stack.enter_context(
            Child(side.consumers, "consumers", *side.address, 1, total, "--by-second")
        )
        for child in [*others, stopped]:
            child.expect("READY", timeout=READY_TIMEOUT)
            pin(child.process.pid, consumer_cores)
        for pid in {side.serving_pid, producer.process.pid}:
            pin(pid, serving_cores)
        rss = stack.enter_context(sampling_rss(side.serving_pid))
        producer.send("GO")
        producer.expect("START")
        start = time.time()
        time.sleep(max(0.0, start + before - time.time()))  # the schedule, not a wait
        os.kill(stopped.process.pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            time.sleep(max(0.0, stopped_at + stop - time.time()))
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)
        released_at = time.time()
        producer.expect("PUBLISHED", timeout=(before + stop + after) * 20 + 60)
        deadline = time.monotonic() + DRAIN_TIMEOUT
        done = [child.expect("DONE", timeout=deadline - time.monotonic()) for child in others]
        last = stopped.expect("DONE", timeout=max(1.0, deadline - time.monotonic()))
        producer.send("STOP")
    seconds = [by_second(d[4]) for d in done]
    mine = by_second(last[4])
    caught_up = next(
        (
            s
            for s in sorted(mine)
            if s >= released_at and Latencies.merged([mine[s]]).figures()[3] <= CAUGHT_UP_US
        ),
        None,
    )
    baseline_rss = [kib for at, kib in rss if start <= at < stopped_at]
    held_rss = [kib for at, kib in rss if stopped_at <= at < released_at]
    return {
        "consumers": consumers,
        "rate": RATE,
        "stopped_s": stop,
        "others": {
            "before": window(seconds, start + SETTLING, stopped_at),
            "while_stopped": window(seconds, stopped_at, released_at),
            "after_release": window(seconds, released_at, released_at + RECOVERY),
            "later": window(seconds, released_at + RECOVERY, start + before + stop + after),
        },
        "caught_up_s": None if caught_up is None else caught_up + 1 - released_at,
        "serving_rss_kib": {
            "before": max(baseline_rss, default=0),
            "while_stopped": max(held_rss, default=0),
        },
        "delivered": sum(int(d[0]) for d in [*done, last]),
        "skipped": sum(int(d[1]) for d in [*done, last]),
        "repeated": sum(int(d[2]) for d in [*done, last]),
        "expected": total * consumers,
    }


def table(runs: list[dict[str, Any]]) -> Table:
    out = Table(title="fan-out: one consumer stopped among N, then let go")
    for column in (
        "system",
        "N",
        "stopped s",
        "others' p99 before",
        "while stopped",
        f"first {RECOVERY:g} s after",
        "later",
        "caught up after",
        "serving RSS before → while stopped",
        "delivered",
    ):
        out.add_column(column, justify="left" if column == "system" else "right")
    for r in runs:
        o = r["others"]
        caught = r["caught_up_s"]
        out.add_row(
            r["system"],
            f"{r['consumers']:,}",
            f"{r['stopped_s']:g}",
            *(f"{o[w]['p99_us'] / 1000:,.1f} ms" for w in o),
            "-" if caught is None else f"≤ {caught:.0f} s",
            f"{r['serving_rss_kib']['before'] / 1024:,.0f} → "
            f"{r['serving_rss_kib']['while_stopped'] / 1024:,.0f} MiB",
            f"{r['delivered']:,}/{r['expected']:,}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout.stopped", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--consumers", type=int, default=None)
    parser.add_argument("--stop", type=float, default=None, help="s the one consumer is stopped")
    args = parser.parse_args(argv)
    quick = args.quick
    consumers = args.consumers or (QUICK_CONSUMERS if quick else CONSUMERS)
    stop = args.stop or (QUICK_STOP if quick else STOP)
    before, after = (QUICK_BEFORE, QUICK_AFTER) if quick else (BEFORE, AFTER)
    runs = []
    for system, start in SYSTEMS.items():
        with tempfile.TemporaryDirectory() as folder:
            seconds = before + stop + after
            with start(Path(folder), RATE, seconds) as side:
                runs.append({"system": system, **run_once(side, consumers, before, stop, after)})
    console.print(table(runs))
    save("fanout_stopped", {"runs": runs}, quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

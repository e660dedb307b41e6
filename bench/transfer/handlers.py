"""The transfer workload's money-at-full-durability case alone (``run`` measures it among
the others): ``HANDLERS`` request handlers, one transfer per transaction, streamq against
Kafka + outbox with a broker flushing every message, side by side.

``python -m bench.transfer.handlers [--repeats N] [--transfers N] [--no-kafka]`` prints
its table and saves nothing: ``python -m bench --only transfer`` saves the workload's.
"""

from __future__ import annotations

import argparse
import contextlib

from rich.progress import Progress

from ..common import comparison_table, console
from .deployment import FULL
from .run import HANDLERS, TITLE, flushing_broker, measure_handlers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transfer.handlers", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="runs per system (3)")
    parser.add_argument(
        "--transfers", type=int, default=FULL.handler_transfers, help="transfers per run"
    )
    parser.add_argument("--no-kafka", action="store_true", help="streamq alone (no broker)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        flushing = None if args.no_kafka else stack.enter_context(flushing_broker())
        systems = ["streamq"] + ([] if flushing is None else ["kafka-outbox"])
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(
                f"transfer: {HANDLERS} handlers, full", total=args.repeats * len(systems)
            )
            handled, commits = measure_handlers(
                systems,
                flushing,
                args.transfers,
                args.repeats,
                lambda _: progress.advance(task),
            )
    console.print(comparison_table(TITLE, [*handled, *commits]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

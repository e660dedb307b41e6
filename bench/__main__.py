"""``python -m bench [--quick] [--only pipe,latency] [--repeats N] [--no-kafka] [--no-nats]``.

NATS JetStream is the second baseline of the workloads in ``WITH_NATS``; each starts its
own servers (one per durability mode), the binary being built first, once, if needed."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

from .common import DURABILITY, console, machine
from .fanout import run as fanout
from .groups import run as groups
from .latency import run as latency
from .pg_load import run as pg_load
from .pipe import run as pipe
from .shares import run as shares
from .slow import run as slow
from .spark import run as spark
from .spark_sink import run as spark_sink
from .transfer import run as transfer
from .transfer_pg import run as transfer_pg
from .workers import run as workers

WORKLOADS: dict[str, Callable[..., Any]] = {
    "pipe": pipe.run,
    "latency": latency.run,
    "transfer": transfer.run,
    "slow": slow.run,
    "spark": spark.run,
    "spark_sink": spark_sink.run,
    "workers": workers.run,
    "transfer_pg": transfer_pg.run,
    "pg_load": pg_load.run,
    "shares": shares.run,
    "groups": groups.run,
    "fanout": fanout.run,
}
WITH_NATS = {"pipe", "latency", "fanout"}  # the workloads that take run(..., nats=...)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="every workload at small size")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (3; quick: 1)")
    parser.add_argument("--no-kafka", action="store_true", help="no Kafka broker")
    no_nats = f"no NATS JetStream ({', '.join(sorted(WITH_NATS))})"
    parser.add_argument("--no-nats", action="store_true", help=no_nats)
    args = parser.parse_args(argv)
    selected = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(selected) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    repeats = args.repeats or (1 if args.quick else 3)
    console.print(f"[bold]machine[/] {json.dumps(machine())}")
    for mode, systems in DURABILITY.items():
        for system, text in systems.items():
            console.print(f"[bold]durability {mode}[/] {system}: {text}")
    nats = not args.no_nats and bool(WITH_NATS & set(selected))
    if nats:  # before Kafka starts: a machine without Go fails here, at once
        import importlib.metadata

        from .nats.clients import SETTINGS
        from .nats.server import binary_version, ensure_binary

        console.print(f"[bold]nats-server[/] {binary_version(ensure_binary())}")
        version = importlib.metadata.version("nats-py")
        console.print(f"[bold]nats clients[/] nats-py {version} {json.dumps(SETTINGS)}")
    with contextlib.ExitStack() as stack:
        broker: Any = None
        if not args.no_kafka:
            from .kafka.broker import KafkaBroker

            broker = stack.enter_context(KafkaBroker())
            console.print(f"[bold]kafka broker[/] {broker.bootstrap} {json.dumps(broker.config)}")
            console.print(
                f"[bold]kafka clients[/] producer {json.dumps(pipe_settings()[0])} "
                f"consumer {json.dumps(pipe_settings()[1])}"
            )
        for name in selected:
            console.rule(name)
            if name in WITH_NATS:
                WORKLOADS[name](broker, args.quick, repeats, nats=nats)
            else:
                WORKLOADS[name](broker, args.quick, repeats)
    return 0


def pipe_settings() -> tuple[dict[str, Any], dict[str, Any]]:
    from .kafka.clients import CONSUMER_THROUGHPUT, PRODUCER_THROUGHPUT

    return PRODUCER_THROUGHPUT, CONSUMER_THROUGHPUT


if __name__ == "__main__":
    sys.exit(main())

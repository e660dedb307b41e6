"""The compiled path against pure Python, side by side in one run: ``python -m
bench.tools.builds [--transfers N] [--repeats N] [--builds B ...] [--sync-only]``.

Each case runs under both builds, alternating, ``repeats`` times (medians reported): the
one-writer transfer end to end (``bench/transfer``: payments process, ledger consumer)
with the floor (the same SQL, no framework) in the same rounds, the synchronous path
(one thread's orders through ``SyncProducer``, ``SyncProducer(serve=False)``,
``streamq.publish`` on a ``sqlite3`` connection, and plain ``sqlite3`` with an outbox row:
``bench/workers``; the two that do not serve again beside ``streamq serve`` pushing each
commit to a consumer, as workers run), the codec alone (a frame of 100-byte records
encoded, then decoded, in one process), a bulk publish's encoding (26 records of 100
bytes), capture's decoding, and a Spark executor's (frames of records into Arrow
batches). A build is chosen for every process of a case by ``STREAMQ_PURE``
(``streamq/native.py``). Results go to ``bench/results/builds.json``.

``--sync-only`` runs the synchronous path's cases alone (``bench/results/sync_path.json``):
each against plain ``sqlite3`` as the ratio of the medians and as the median of each
round's ratio (the pair ran back to back, so a busy moment of a shared machine falls on
both), with the writer's CPU and its wait for a CPU per order (``schedstat``), and what
the serving process and its consumer spent beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..common import RESULTS, say
from ..transfer.deployment import flow
from ..transfer.floor import floor_flow
from ..workers.common import SYNC_VARIANTS
from ..workers.run import SyncRun, sync_once
from . import BUILDS

CODEC = """
import time, streamq, streamq.native
from streamq.protocol import decode_record, encode_values, split_records
values = [b"x" * 100] * 1000
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    stored = b"".join(encode_values(1, 1_700_000_000_000, values))
    records = [decode_record(r) for r in split_records(stored, len(values))]
    assert len(records) == len(values)
    n += len(values)
print(n / (time.perf_counter() - start), streamq.native.build().compiled)
"""  # A bulk publish's records encoded, as a transaction of the transfer numbers them.
ENCODE = """
import time, streamq, streamq.native
from streamq.protocol import encode_values
values = [b"x" * 100] * 26
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    for _ in range(1000):
        encode_values(1, 1_700_000_000_000, values)
    n += 26_000
print(n / (time.perf_counter() - start), streamq.native.build().compiled)
"""  # pgoutput INSERT messages of a 4-column row, decoded: capture's per-change parse.
PGOUTPUT = """
import struct, time, streamq, streamq.native
from streamq.engines.postgres import pgoutput
values = [b"12345", b"2026-12-04 20:00:00+00", b"9.90", b"a customer's name"]
row = struct.pack("!h", len(values)) + b"".join(
    b"t" + struct.pack("!i", len(v)) + v for v in values
)
message = b"I" + struct.pack("!I", 16384) + b"N" + row
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    for _ in range(1000):
        pgoutput.decode(message)
    n += 1000
print(n / (time.perf_counter() - start), streamq.native.build().compiled)
"""

# Capture's whole decoding: pgoutput transactions of 10 INSERTs each into change records
# (``ChangeDecoder``), as a capture round feeds them.
CAPTURE = """
import struct, time, streamq, streamq.native
from streamq.engines.postgres.changes import ChangeDecoder
columns = [("id", 23, True), ("at", 1184, False), ("total", 1700, False), ("name", 25, False)]
relation = b"R" + struct.pack("!I", 16384) + b"public\\0orders\\0d" + struct.pack("!h", 4)
for name, oid, key in columns:
    relation += struct.pack("!b", key) + name.encode() + b"\\0" + struct.pack("!Ii", oid, -1)
def insert(n):
    values = [str(n).encode(), b"2026-12-04 20:00:00+00", b"9.90", b"a customer's name"]
    row = struct.pack("!h", 4) + b"".join(b"t" + struct.pack("!i", len(v)) + v for v in values)
    return b"I" + struct.pack("!I", 16384) + b"N" + row
def transaction(xid):
    lsn = xid * 1000
    yield b"B" + struct.pack("!QqI", lsn, 0, xid)
    yield from (insert(xid * 10 + i) for i in range(10))
    yield b"C" + struct.pack("!bQQq", 0, lsn, lsn + 1, 0)
messages = [m for xid in range(1, 101) for m in transaction(xid)]
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    decoder = ChangeDecoder({"public.orders": "orders"}, {"public.orders": ["id"]})
    decoder.feed(relation)
    captured = [c for c in map(decoder.feed, messages) if c is not None]
    assert len(captured) == 100
    n += 1000
print(n / (time.perf_counter() - start), streamq.native.build().compiled)
"""

# A Spark executor's reading: RECORDS frames of 8,192 records of 100-byte values decoded
# into Arrow batches of every column (on the compiled path by the C decoder, ``columnar``).
ARROW = """
import time, streamq, streamq.native
from spark_source.schema import EVERY_COLUMN
from streamq.protocol import RecordColumns, decode_message, encode_values, records_frame
body = records_frame(encode_values(1, 1_700_000_000_000, [b"x" * 100] * 8192))[4:]
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 2:
    frame = decode_message(body, raw_records=True, columnar=True)
    part = frame.columns if isinstance(frame, RecordColumns) else frame.rows
    assert EVERY_COLUMN.batch_of("p", "h:1", "s", [part]).num_rows == 8192
    n += 8192
print(n / (time.perf_counter() - start), streamq.native.build().compiled)
"""


def rate(build: str, code: str = CODEC) -> float:
    """Records (or messages) a second through ``code``, in a process of ``build``."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "STREAMQ_PURE": BUILDS[build]},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    rate, compiled = done.stdout.split()
    assert compiled == str(build == "compiled"), f"{build} ran compiled={compiled}"
    return float(rate)


@contextlib.contextmanager
def processes_of(build: str) -> Iterator[Path]:
    """A folder for a case whose processes, started meanwhile, all run ``build``."""
    os.environ["STREAMQ_PURE"] = BUILDS[build]
    try:
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder)
    finally:
        os.environ.pop("STREAMQ_PURE", None)


def transfer_rate(build: str, transfers: int) -> tuple[float, float]:
    """Transfers a second end to end, one writer, every process of ``build``, and the
    producer process's CPU a transfer (µs, all its threads)."""
    with processes_of(build) as folder:
        measured = flow("streamq", None, folder, transfers, 0)
    return transfers / measured.seconds, measured.cpu["producer"] / transfers * 1e6


# The synchronous path's cases: each variant, and beside ``streamq serve`` those that do not
# serve themselves (``sync_once``).
BESIDE = " beside streamq serve"
SYNC_CASES = (
    *SYNC_VARIANTS,
    *(v + BESIDE for v in SYNC_VARIANTS if v not in ("sqlite3", "SyncProducer serving")),
)


SETTINGS = ("refused", "synchronous")  # a run's, checked, not measured


def sync_run(build: str, case: str, orders: int) -> SyncRun:
    """The synchronous path's ``case`` from one thread, in a process of ``build`` (plain
    ``sqlite3`` imports streamq too: the same process either way)."""
    variant = case.removesuffix(BESIDE)
    with processes_of(build) as folder:
        run = sync_once(variant, folder, 1, orders, beside=variant != case)
    assert run.refused == 0, f"{case} refused {run.refused} orders"
    return run


def sync_rounds(builds: list[str], orders: int, repeats: int) -> dict[str, Any]:
    """Every sync case under each build, alternating, ``repeats`` rounds: the runs, and
    per case and build the medians and the ratios to plain ``sqlite3``."""
    runs: dict[str, list[dict[str, float]]] = {}
    for round_ in range(repeats):
        for build in builds:
            for case in SYNC_CASES:
                run = sync_run(build, case, orders)
                figures = {k: v for k, v in vars(run).items() if k not in SETTINGS}
                runs.setdefault(f"{case} {build}", []).append(figures)
        rates = (f"{name} {rounds[-1]['rate']:,.0f}" for name, rounds in runs.items())
        say(f"round {round_ + 1}: " + ", ".join(rates))
    medians = {
        name: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for name, rounds in runs.items()
    }
    for build in builds:
        base = f"sqlite3 {build}"
        for case in SYNC_CASES:
            name = f"{case} {build}"
            paired = [r["rate"] / b["rate"] for r, b in zip(runs[name], runs[base], strict=True)]
            medians[name]["/ sqlite3"] = medians[name]["rate"] / medians[base]["rate"]
            medians[name]["/ sqlite3, paired"] = statistics.median(paired)
    return {"runs": runs, "medians": medians}


def sync_table(medians: dict[str, dict[str, float]]) -> None:
    """The sync cases' medians, one line each."""
    print(
        f"{'case':44} {'orders/s':>9} {'/ sqlite3':>9} {'paired':>7} "
        f"{'CPU µs':>7} {'wait µs':>7} {'beside µs':>9}"
    )
    for name, m in medians.items():
        print(
            f"{name:44} {m['rate']:9,.0f} {m['/ sqlite3']:9.2f} {m['/ sqlite3, paired']:7.2f} "
            f"{m['cpu_us']:7.1f} {m['waited_us']:7.1f} {m['beside_cpu_us']:9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=50_000)
    parser.add_argument("--orders", type=int, default=40_000, help="per sync path run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--builds", nargs="+", choices=list(BUILDS), default=list(BUILDS))
    parser.add_argument("--sync-only", action="store_true", help="the sync path's cases alone")
    args = parser.parse_args(argv)
    if args.sync_only:
        synced = sync_rounds(args.builds, args.orders, args.repeats)
        sync_table(synced["medians"])
        out = {"orders": args.orders, "builds": args.builds, **synced}
        (RESULTS / "sync_path.json").write_text(json.dumps(out, indent=1) + "\n")
        return 0
    runs: dict[str, list[float]] = {}
    for round_ in range(args.repeats):
        for build in args.builds:
            per_second, producer_us = transfer_rate(build, args.transfers)
            runs.setdefault(f"transfer {build}", []).append(per_second)
            runs.setdefault(f"transfer {build}: producer CPU µs a transfer", []).append(producer_us)
            runs.setdefault(f"codec {build}", []).append(rate(build))
            runs.setdefault(f"encode {build}", []).append(rate(build, ENCODE))
            runs.setdefault(f"pgoutput {build}", []).append(rate(build, PGOUTPUT))
            runs.setdefault(f"capture {build}", []).append(rate(build, CAPTURE))
            runs.setdefault(f"arrow {build}", []).append(rate(build, ARROW))
            for case in SYNC_CASES:
                orders = sync_run(build, case, args.orders).rate
                runs.setdefault(f"sync {case} {build}", []).append(orders)
        with tempfile.TemporaryDirectory() as folder:
            floor_rate, floor_us, _ = floor_flow(Path(folder), args.transfers)
            runs.setdefault("transfer floor", []).append(floor_rate)
            runs.setdefault("transfer floor: producer CPU µs a transfer", []).append(floor_us)
        say(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in runs.items()))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    if args.builds != list(BUILDS):
        raise SystemExit("the whole comparison needs both builds; --builds goes with --sync-only")
    ratios = {
        "transfer compiled / pure": medians["transfer compiled"] / medians["transfer pure"],
        "transfer compiled / floor": medians["transfer compiled"] / medians["transfer floor"],
        "transfer pure / floor": medians["transfer pure"] / medians["transfer floor"],
        "codec compiled / pure": medians["codec compiled"] / medians["codec pure"],
        "encode compiled / pure": medians["encode compiled"] / medians["encode pure"],
        "pgoutput compiled / pure": medians["pgoutput compiled"] / medians["pgoutput pure"],
        "capture compiled / pure": medians["capture compiled"] / medians["capture pure"],
        "arrow compiled / pure": medians["arrow compiled"] / medians["arrow pure"],
    }
    for case in SYNC_CASES:  # each against plain sqlite3, the same build's
        for build in BUILDS:
            ratios[f"sync {case} {build} / sqlite3"] = (
                medians[f"sync {case} {build}"] / medians[f"sync sqlite3 {build}"]
            )
    for name, value in {**medians, **ratios}.items():
        print(f"{name}: {value:,.2f}")
    result: dict[str, Any] = {
        "transfers": args.transfers,
        "orders": args.orders,
        "runs": runs,
        "ratios": ratios,
    }
    (RESULTS / "builds.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

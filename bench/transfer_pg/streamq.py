"""streamq's processes of the PostgreSQL transfer workload (the package's docstring):
``writer URL INDEX WRITERS TOTAL RATE SEED`` and ``consumer ADDRESS URL TARGET``."""

from __future__ import annotations

import sys

import streamq
from streamq import _loop

from ..transfer.common import DEPOSIT
from ..transfer.streamq import consumer
from .common import credit_rows, writer


def credit(tx: streamq.BlockingSQL, batch: streamq.Batch) -> list[tuple[int, int, int, float]]:
    """``Consumer.apply``'s function: credit a batch of deposits; returns them."""
    deposits = [DEPOSIT.unpack(record.value) for record in batch]
    credit_rows(tx, deposits)
    return deposits


def main(argv: list[str]) -> None:
    role, *args = argv
    if role == "writer":
        url, index, writers, total, rate, seed = args
        writer("streamq", url, int(index), int(writers), int(total), float(rate), int(seed))
    elif role == "consumer":
        _loop.run(consumer(args[0], args[1], int(args[2]), credit))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Which seqs the serving producer gave to published records, where seqs are given after
the commit (PostgreSQL: ``engines/postgres/numbering.py``): ``Producer.wait_served``.

Recent rounds are remembered (``KEEP`` transactions' records in a stream), so a receipt
asked about just after its records were served is answered at once; one asked about
before is answered when they are.
"""

from __future__ import annotations

import asyncio
from collections import deque

from ..records import Receipt
from .storage import Group, Numbered, group_seqs

KEEP = 65_536  # (transaction, stream) groups remembered


class ServedReceipts:
    def __init__(self, keep: int = KEEP) -> None:
        # A round takes whole transactions: one group per (transaction, stream).
        self._recent: dict[tuple[int, str], Group] = {}
        self._order: deque[tuple[int, str]] = deque()
        self._keep = keep
        self._waiting: dict[tuple[int, str], list[tuple[Receipt, asyncio.Future[range]]]] = {}

    def served(self, numbered: Numbered) -> None:
        """A round, served: remember its groups and answer who waits for them."""
        recent, order, waiting = self._recent, self._order, self._waiting
        for stream in numbered.streams:
            for group in stream.groups:
                key = (group.xid, stream.name)
                recent[key] = group
                order.append(key)
                if waiting and key in waiting:
                    self._answer(key, group)
        while len(order) > self._keep:
            del recent[order.popleft()]

    def _answer(self, key: tuple[int, str], group: Group) -> None:
        still = []
        for receipt, future in self._waiting.pop(key):
            seqs = group_seqs(group, receipt.id, receipt.count)
            if seqs is None:  # not a receipt of this transaction's: it waits on
                still.append((receipt, future))
            elif not future.done():
                future.set_result(seqs)
        if still:
            self._waiting[key] = still

    def find(self, receipt: Receipt) -> range | None:
        group = self._recent.get((receipt.xid, receipt.stream))
        return None if group is None else group_seqs(group, receipt.id, receipt.count)

    async def wait(self, receipt: Receipt) -> range:
        """The receipt's seqs, once served."""
        seqs = self.find(receipt)
        if seqs is not None:
            return seqs
        future: asyncio.Future[range] = asyncio.get_running_loop().create_future()
        key = (receipt.xid, receipt.stream)
        self._waiting.setdefault(key, []).append((receipt, future))
        try:
            return await future
        finally:
            entries = self._waiting.get(key)
            if entries is not None:
                entries[:] = [entry for entry in entries if entry[1] is not future]
                if not entries:
                    del self._waiting[key]

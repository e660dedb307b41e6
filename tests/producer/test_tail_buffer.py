"""The tail buffer against a model: it holds the newest records that fit, in order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streamq.producer.committed_log import RECORD_OVERHEAD, TailBuffer

appends = st.lists(  # (gap before it: 0 follows the head, record sizes)
    st.tuples(st.sampled_from([0, 0, 0, 3]), st.lists(st.integers(0, 40), max_size=8)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(appends, st.integers(0, 600))
def test_holds_the_newest_records_that_fit(batches: list[tuple[int, list[int]]], cap: int) -> None:
    tail = TailBuffer(cap, 1)
    model: list[tuple[int, bytes]] = []  # every record since the last gap
    next_seq = 1
    for gap, sizes in batches:
        if gap:
            next_seq += gap
            model = []
        records = [b"%d" % (next_seq + i) + b"." * size for i, size in enumerate(sizes)]
        tail.append(next_seq, records)
        model += [(next_seq + i, record) for i, record in enumerate(records)]
        next_seq += len(records)
        while sum(len(record) + RECORD_OVERHEAD for _, record in model) > cap:
            del model[0]  # the oldest goes first
        first = model[0][0] if model else next_seq
        assert tail.first_seq == first
        assert tail.get(first - 1, next_seq, 10**6, 10**9) is None
        assert tail.get(next_seq, next_seq + 5, 10**6, 10**9) is None
        for i, (seq, _) in enumerate(model):
            held = tail.get(seq, next_seq, 10**6, 10**9)
            assert held is not None and list(held) == [record for _, record in model[i:]]
            assert list(tail.get(seq, seq + 2, 10**6, 10**9) or []) == [
                record for _, record in model[i : i + 2]
            ]

# The C encoder of records_c.c (built by setup.py on the compiled path).
from collections.abc import Sequence

def encode_values(
    first_seq: int, timestamp: int, values: Sequence[bytes], /
) -> list[bytes] | None: ...

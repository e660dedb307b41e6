# The C decoder of columnar_c.c (built by setup.py on the compiled path).
from typing import Any

def decode(body: bytes, /) -> tuple[Any, ...] | None: ...

# The C decoder of _columnar.c (built by setup.py on the compiled path).
from typing import Any

def decode(body: bytes, /) -> tuple[Any, ...] | None: ...

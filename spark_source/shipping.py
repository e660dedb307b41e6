"""What an executor unpickles first, whether streamq is installed there or not.

The readers and partitions Spark sends to executors pickle as a call to ``rebuild`` (the
``Shipped`` mixin), and this module is registered with PySpark's cloudpickle by value: its
code travels inside the pickle. On an executor without streamq, ``rebuild`` then fails in
one line that says how to ship it, where a pickle by reference would fail with
``ModuleNotFoundError`` deep in a worker's traceback. Nothing here imports streamq.
"""

from __future__ import annotations

import importlib
import pickle
import socket
from typing import Any

SHIP_IT = (
    "ship it to the executors: a virtual environment packed with venv-pack, given with "
    "--archives env.tar.gz#environment and spark.pyspark.python=./environment/bin/python, "
    "or streamq's wheel as a .zip with --py-files (docs/guides/spark.md, 'Running on a "
    "cluster')"
)


def rebuild(module: str, name: str, state: bytes) -> Any:
    """The object of class ``module.name`` with ``state``; on an executor that cannot
    import it, one line saying how to ship streamq there."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        host = socket.gethostname()
        raise RuntimeError(
            f"the Spark executor on {host} cannot import streamq's Spark source ({exc}): {SHIP_IT}"
        ) from None
    shipped = cls.__new__(cls)
    shipped.__dict__.update(pickle.loads(state))
    return shipped


class Shipped:
    """Pickled as ``rebuild(module, class, state)``, the state pickled on its own (by
    PySpark's cloudpickle: it may hold functions) and restored once the class is found;
    ``_shipped_state`` gives it (by default, every attribute)."""

    def _shipped_state(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __reduce__(self) -> tuple[Any, tuple[str, str, bytes]]:
        from pyspark import cloudpickle

        state: bytes = cloudpickle.dumps(self._shipped_state())  # type: ignore[no-untyped-call]
        return rebuild, (type(self).__module__, type(self).__qualname__, state)

"""What an executor unpickles first, whether streamq is installed there or not.

The readers and partitions Spark sends to executors pickle as a call to ``rebuild`` (the
``Shipped`` mixin), and this module is registered with PySpark's cloudpickle by value: its
code travels inside the pickle. On an executor without streamq, ``rebuild`` then fails in
one line that says how to ship it, where a pickle by reference would fail with
``ModuleNotFoundError`` deep in a worker's traceback. Nothing here imports streamq.

The driver's streaming source runs in a Python process of its own, which Spark starts
without ``--py-files`` on its path (PySpark 4.x looks for them in a ``streaming_job``
folder of the driver's files, where they are not). The pickle names the zip its class
was imported from, if any: the driver's planning process, on the same machine, imported
it from the zip ``--py-files`` gave, and ``rebuild`` imports from that zip too.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
from typing import Any

SHIP_IT = (
    "ship it to the executors: a virtual environment packed with venv-pack, given with "
    "--archives env.tar.gz#environment and spark.pyspark.python=./environment/bin/python, "
    "or streamq's wheel as a .zip with --py-files (docs/guides/spark.md, 'Running on a "
    "cluster')"
)
# The module Spark runs (``python -m``) for a Python streaming source on the driver.
STREAMING_SOURCE_RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"
ON_THE_DRIVER = (
    "install streamq in that Python, or give its wheel as a .zip with --py-files "
    "(docs/guides/spark.md, 'Running on a cluster')"
)


def rebuild(module: str, name: str, state: bytes, archive: str | None = None) -> Any:
    """The object of class ``module.name`` with ``state``, the class imported from the
    zip ``archive`` where it is not importable otherwise; on a process that cannot import
    it, one line saying which process it is and how to ship streamq there."""
    try:
        cls = getattr(_import(module, archive), name)
    except ImportError as exc:
        raise RuntimeError(_cannot_import(exc)) from None
    shipped = cls.__new__(cls)
    shipped.__dict__.update(pickle.loads(state))
    return shipped


def _import(module: str, archive: str | None) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        if archive is None or archive in sys.path or not os.path.isfile(archive):
            raise
    sys.path.append(archive)
    return importlib.import_module(module)


def _cannot_import(exc: ImportError) -> str:
    host = socket.gethostname()
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(main, "name", None) == STREAMING_SOURCE_RUNNER:
        return (
            f"the Spark driver's streaming source process on {host} (its Python is "
            f"spark.pyspark.python, from the driver's working directory: {sys.executable}) "
            f"cannot import streamq's Spark source ({exc}): {ON_THE_DRIVER}"
        )
    return f"the Spark executor on {host} cannot import streamq's Spark source ({exc}): {SHIP_IT}"


class Shipped:
    """Pickled as ``rebuild(module, class, state, archive)``, the state pickled on its own
    (by PySpark's cloudpickle: it may hold functions) and restored once the class is
    found; ``_shipped_state`` gives it (by default, every attribute). ``archive``: the
    zip the class was imported from (``--py-files``), or None."""

    def _shipped_state(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __reduce__(self) -> tuple[Any, tuple[str, str, bytes, str | None]]:
        from pyspark import cloudpickle

        state: bytes = cloudpickle.dumps(self._shipped_state())  # type: ignore[no-untyped-call]
        cls = type(self)
        loader = getattr(sys.modules[cls.__module__], "__loader__", None)
        archive = getattr(loader, "archive", None)  # zipimport's
        return rebuild, (cls.__module__, cls.__qualname__, state, archive)

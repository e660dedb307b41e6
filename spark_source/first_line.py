"""The source's one-line errors, first in Spark's message.

Spark reports an exception that a Python data source raises as its Python worker formats
it (``pyspark.util.handle_worker_exception``): the traceback, 7 to 22 lines of it, then the
exception's line, last: "[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source
instance: Traceback (most recent call last): ... StreamQSourceError: unknown option ...".
Only that text reaches the driver. Two things put the line first:

- Python formats an exception's context before the exception, and a context that was
  never raised has no traceback: one line. So a ``StreamQSourceError`` leaving a method
  Spark calls gets a copy of itself as its context (``said_first``).
- Spark shortens a traceback to the frames from the first one outside PySpark on
  (``spark.sql.execution.pyspark.udf.simplifiedTraceback.enabled``, on by default), and
  when it does, it clears the exception's ``__cause__``, which hides the context too. The
  error leaves with its traceback dropped, so the frames it carries are PySpark's only (the
  call that reached the source): nothing is shortened, the context stays, and the frames
  below say nothing to whoever reads a user's error anyway.

The message then opens with the line, and the traceback of where Spark called follows it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    SimpleDataSourceStreamReader,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from .planning import StreamQSourceError

C = TypeVar("C", bound=type)
T = TypeVar("T")

# What Spark calls: the Data Source API's public methods.
_API = (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    SimpleDataSourceStreamReader,
    SupportsTriggerAvailableNow,
    DataSourceWriter,
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    DataSourceStreamArrowWriter,
)
SPARK_CALLS = frozenset(
    name
    for api in _API
    for name, member in vars(api).items()
    if inspect.isfunction(member) and not name.startswith("_")
)


def said_first(error: StreamQSourceError) -> None:
    """Give ``error`` a copy of itself, never raised, as its context, and drop its
    traceback (raised again, it carries the frames above): formatted, the line comes
    first, "During handling of the above exception ..." then joins the traceback. Its
    cause goes: Python would format that instead."""
    context = error.__context__
    if not (isinstance(context, StreamQSourceError) and context.__traceback__ is None):
        error.__context__ = type(error)(*error.args)  # (else a method Spark calls did)
        error.__cause__ = None
        error.__suppress_context__ = False
    error.__traceback__ = None


def _lines_first(items: Iterator[T]) -> Iterator[T]:
    """``items``, their ``StreamQSourceError`` said first."""
    try:
        yield from items
    except StreamQSourceError as exc:
        said_first(exc)
        raise


def _method_said_first(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, its ``StreamQSourceError`` said first; a generator it returns (a
    partition's batches, read as Spark asks for them) as well."""

    @functools.wraps(method)
    def spark_call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, **kwargs)
        except StreamQSourceError as exc:
            said_first(exc)
            raise
        return _lines_first(result) if inspect.isgenerator(result) else result

    return spark_call


def errors_said_first(cls: C) -> C:
    """``cls`` with each method Spark calls on it (``SPARK_CALLS``) defined there wrapped
    by ``_method_said_first``."""
    for name in SPARK_CALLS & vars(cls).keys():
        if inspect.isfunction(method := vars(cls)[name]):
            setattr(cls, name, _method_said_first(method))
    return cls

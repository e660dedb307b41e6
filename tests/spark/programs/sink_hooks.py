"""The Spark sink with a pause after its commit, for the tests that kill a driver there.

``PAUSE_AFTER_COMMIT`` set to ``BATCH:FILE`` in the environment (which Spark's Python
workers inherit from the driver): once micro-batch BATCH's transaction has committed,
the commit writes FILE and waits, before Spark writes the batch into its checkpoint's
commit log; the test then kills the driver. Importable by the workers (the repository
on PYTHONPATH), so the pickled source finds it there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from spark_source import StreamQDataSource
from spark_source.sink import StreamQStreamWriter, stream_writer

PAUSE_AFTER_COMMIT = "STREAMQ_SINK_PAUSE_AFTER_COMMIT"
PAUSE = 600.0  # seconds: longer than any test waits for the kill


class PausingStreamWriter(StreamQStreamWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        super().commit(messages, batchId)
        batch, _, flag = os.environ.get(PAUSE_AFTER_COMMIT, "").partition(":")
        if batch and int(batch) == batchId:
            Path(flag).write_text(f"committed batch {batchId}\n")
            time.sleep(PAUSE)


class PausingSource(StreamQDataSource):
    """``format("streamq")``, its stream writer pausing after a commit."""

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return PausingStreamWriter(stream_writer(self.options, schema).settings)

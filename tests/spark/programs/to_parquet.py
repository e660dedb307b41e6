"""The streaming query the cluster's and Spark Connect's programs run (imported from beside
them: ``cluster_job.py``, ``connect_client.py``): the stream ``orders`` of every producer
into a parquet sink with its checkpoint, everything available now."""

from __future__ import annotations

from typing import Any


def start(spark: Any, options: dict[str, str], out: str, checkpoint: str) -> Any:
    """The query, started: ``options`` are the source's."""
    return (
        spark.readStream.format("streamq")
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .option("path", out)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )

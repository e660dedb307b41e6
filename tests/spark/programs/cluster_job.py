"""The application the standalone cluster's tests submit (tests/spark/test_spark_cluster.py),
as a user's would be: ``spark-submit ... cluster_job.py MODE ENDPOINTS OUT [CHECKPOINT]``.

- ``batch``: the stream ``orders`` of every producer read once, into parquet at OUT.
- ``stream``: a streaming query into a parquet sink at OUT with its checkpoint, every
  record available now, ``maxRecordsPerTrigger`` 20,000 a micro-batch: started again
  from the checkpoint it goes on where the last committed batch ended.
- ``sink``: the same query into streamq's sink instead, OUT its producer database (a
  ``postgresql://`` URL), each record's key and value into stream ``copied``.

Prints ``STARTED`` once the query runs, ``BATCH n`` as each micro-batch commits, ``DONE``.
"""

from __future__ import annotations

import sys

import to_parquet  # beside this file
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQueryListener

from spark_source import StreamQDataSource


class Progress(StreamingQueryListener):
    def onQueryStarted(self, event: object) -> None:
        pass

    def onQueryProgress(self, event: object) -> None:
        print(f"BATCH {event.progress.batchId}", flush=True)  # type: ignore[attr-defined]

    def onQueryIdle(self, event: object) -> None:
        pass

    def onQueryTerminated(self, event: object) -> None:
        pass


def main(mode: str, endpoints: str, out: str, checkpoint: str = "") -> None:
    spark = SparkSession.builder.appName(f"streamq cluster {mode}").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(StreamQDataSource)
    options = {"endpoints": endpoints, "stream": "orders", "startingOffsets": "earliest"}
    if mode == "batch":
        spark.read.format("streamq").options(**options).load().write.parquet(out)
        print("DONE", flush=True)
        return
    spark.streams.addListener(Progress())
    batches = {"maxRecordsPerTrigger": "20000", "minPartitions": "4"}
    if mode == "sink":
        query = (
            spark.readStream.format("streamq")
            .options(**options, **batches)
            .load()
            .select("key", "value")
            .writeStream.format("streamq")
            .option("db", out)
            .option("stream", "copied")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
    else:
        query = to_parquet.start(spark, {**options, **batches}, out, checkpoint)
    print("STARTED", flush=True)
    query.awaitTermination()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""A Spark Connect client, as a thin client runs one (tests/spark/test_spark_connect.py):
``connect_client.py sc://HOST:PORT ENDPOINTS OUT CHECKPOINT``.

It registers the source on the server's session, reads the stream ``orders`` once
(printing ``BATCH rows``), then runs a streaming query into parquet at OUT until every
record available now is in (printing ``STREAM rows``). An error is printed as
``ERROR <kind>: <message>`` and the program exits with status 1.
"""

from __future__ import annotations

import sys

import to_parquet  # beside this file
from pyspark.sql import SparkSession

from spark_source import StreamQDataSource


def main(remote: str, endpoints: str, out: str, checkpoint: str) -> int:
    spark = SparkSession.builder.remote(remote).getOrCreate()
    options = {"endpoints": endpoints, "stream": "orders", "startingOffsets": "earliest"}
    try:
        spark.dataSource.register(StreamQDataSource)
        rows = spark.read.format("streamq").options(**options).load().count()
        print(f"BATCH {rows}", flush=True)
        to_parquet.start(spark, options, out, checkpoint).awaitTermination()
        print(f"STREAM {spark.read.parquet(out).count()}", flush=True)
    except Exception as exc:  # what a Connect client is told, as its user sees it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"ERROR {type(exc).__name__}: {first}", flush=True)
        return 1
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))

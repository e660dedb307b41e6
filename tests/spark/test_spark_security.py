"""The Spark source over TLS (mutual) with a token, on a real local SparkSession."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

import streamq

from ..certs import Certs, make_certs

SECRET = b"spark-test-secret-0123456789"


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@pytest.fixture
def secured(tmp_path: Path, certs: Certs) -> Iterator[streamq.SyncProducer]:
    auth = streamq.TokenAuth(SECRET, {"analytics": ["orders"]})
    settings = streamq.ServerSettings(tls=certs.server, auth=auth)
    with streamq.SyncProducer(str(tmp_path / "p.db"), settings=settings) as producer:
        with producer.transaction() as tx:
            tx.publish_many("orders", [b"o%d" % n for n in range(1, 1001)])
            tx.publish_many("secret", [b"s"] * 10)
        yield producer


def test_read_over_tls_with_a_token(
    spark: SparkSession, secured: streamq.SyncProducer, certs: Certs, tmp_path: Path
) -> None:
    token_file = tmp_path / "analytics.token"
    token_file.write_text(streamq.make_token(SECRET, "analytics") + "\n")
    tls = {"ssl.ca": certs.ca, "ssl.cert": certs.client.cert, "ssl.key": str(certs.client.key)}

    def read(stream: str, **options: str) -> list[tuple[int, bytes]]:
        reader = spark.read.format("streamq").options(**tls, **options)
        df = reader.option("endpoints", secured.address).option("stream", stream).load()
        return sorted((row.seq, bytes(row.value)) for row in df.collect())

    rows = read("orders", tokenFile=str(token_file), minPartitions="3")
    assert rows == [(n, b"o%d" % n) for n in range(1, 1001)]

    with pytest.raises(PySparkException, match="this producer requires a token"):
        read("orders")
    with pytest.raises(PySparkException, match="consumer 'analytics' may not read stream 'secret'"):
        read("secret", tokenFile=str(token_file))
    with pytest.raises(PySparkException, match="it requires a client certificate"):
        spark.read.format("streamq").options(
            endpoints=secured.address, stream="orders", tokenFile=str(token_file)
        ).option("ssl.ca", certs.ca).load().collect()

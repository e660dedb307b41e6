"""The source through Spark Connect, as a thin client uses it (Databricks' shared and
serverless compute work this way): a Connect server (its own JVM, ``SparkConnectServer``
through ``spark-submit``), and a client process that only has PySpark's Connect client
and streamq, registering the source on the server's session over gRPC.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.spark.cluster import SPARK_HOME, spark_env
from tests.pgserver import free_port
from tests.spark.cluster import Fleet, read_committed

CLIENT = Path(__file__).resolve().parent / "programs" / "connect_client.py"
SERVER = "org.apache.spark.sql.connect.service.SparkConnectServer"

pytestmark = pytest.mark.xdist_group("spark-cluster")


@pytest.fixture
def connect_server(tmp_path: Path) -> Iterator[str]:
    """A Spark Connect server on loopback, ``local[2]``, its Python the test's (streamq
    installed on the server's side): its ``sc://`` address."""
    port = free_port()
    env = {**spark_env(tmp_path), "PYSPARK_PYTHON": sys.executable}
    log = (tmp_path / "connect-server.log").open("wb")
    with log:
        server = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-submit"), "--class", SERVER,
             "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.ui.enabled=false", "spark-internal"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None, (tmp_path / "connect-server.log").read_text()
            assert time.monotonic() < deadline, "the Connect server did not listen in 90 s"
            time.sleep(0.2)
        yield f"sc://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=30)


@pytest.mark.timeout(300)
def test_a_batch_read_and_a_streaming_query_through_spark_connect(
    tmp_path: Path, connect_server: str
) -> None:
    fleet = Fleet(tmp_path, [200, 300])
    try:
        out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
        done = subprocess.run(
            [sys.executable, str(CLIENT), connect_server, ",".join(fleet.endpoints),
             str(out), str(checkpoint)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        fleet.close()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "BATCH 500" in done.stdout and "STREAM 500" in done.stdout, done.stdout
    read = read_committed(out)
    assert max(read.values()) == 1 and set(read) == fleet.every_record()

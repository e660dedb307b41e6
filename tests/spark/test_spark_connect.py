"""The source through Spark Connect, as a thin client uses it (Databricks' shared and
serverless compute work this way): a Connect server (its own JVM, ``SparkConnectServer``
through ``spark-submit``), and a client process that only has PySpark's Connect client
and streamq, registering the source on the server's session over gRPC.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.spark.cluster import DAEMON_LOG4J2, SPARK_HOME, bound_port, spark_env
from spark_source.session import log4j2_file
from tests.spark.cluster import Fleet, read_committed

CLIENT = Path(__file__).resolve().parent / "programs" / "connect_client.py"
SERVER = "org.apache.spark.sql.connect.service.SparkConnectServer"
SERVICE = "org.apache.spark.sql.connect.service.SparkConnectService"  # as its log names it

pytestmark = [pytest.mark.xdist_group("spark-cluster"), pytest.mark.cluster]


@pytest.fixture
def connect_server(tmp_path: Path) -> Iterator[str]:
    """A Spark Connect server on loopback, ``local[2]``, its Python the test's (streamq
    installed on the server's side): its ``sc://`` address, on the port it bound (port 0:
    any free one, read back from its log)."""
    env = {**spark_env(tmp_path), "PYSPARK_PYTHON": sys.executable}
    log4j = f"-Dlog4j2.configurationFile=file:{log4j2_file(DAEMON_LOG4J2)}"
    log = tmp_path / "connect-server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-submit"), "--class", SERVER,
             "--master", "local[2]", "--conf", "spark.driver.host=127.0.0.1",
             "--driver-java-options", log4j,
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.connect.grpc.binding.port=0",
             "--conf", "spark.ui.enabled=false", "spark-internal"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        port = bound_port(log, SERVICE, server, timeout=90)
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

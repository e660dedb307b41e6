"""The source and the sink on a Spark standalone cluster, as users deploy it: a master and
two workers, each its own JVM on loopback (``tests/spark/cluster.py``), applications
submitted with ``spark-submit`` in client mode, the executors on the machine's Python,
which has no streamq: it reaches them in a virtual environment packed with venv-pack and
passed with ``--archives``, or as its wheel with ``--py-files`` (docs/guides/spark.md,
"Running on a cluster").
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.spark.cluster import spark_env, starting_master_state
from spark_source.session import LOOPBACK
from tests.recipes import harness
from tests.spark.cluster import (
    ROOT,
    Cluster,
    Fleet,
    packed_environment,
    pure_wheel,
    read_committed,
    submit,
    unpacked,
)
from tests.spark.test_spark_sink import consumed, make_db

JOB = Path(__file__).resolve().parent / "programs" / "cluster_job.py"
CLIENT = Path(__file__).resolve().parent / "programs" / "connect_client.py"
GUIDE = ROOT / "docs" / "guides" / "spark.md"
PACKED = ROOT / "build" / "spark-env"  # kept across runs, named by the sources' digest

pytestmark = [pytest.mark.xdist_group("spark-cluster"), pytest.mark.cluster]


@pytest.fixture(scope="module")
def packed() -> Path:
    return packed_environment(PACKED)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path / "cluster", workers=2)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    served = Fleet(tmp_path, [300, 500, 700, 900])
    try:
        yield served
    finally:
        served.close()


def read_parquet(out: Path) -> Counter[tuple[str, int]]:
    table = pq.read_table(out, columns=["producer", "seq"])
    return Counter(zip(table["producer"].to_pylist(), table["seq"].to_pylist(), strict=True))


def wait_for_line(log: Path, line: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in log.read_text(errors="replace").splitlines():
        assert process.poll() is None, f"the driver exited:\n{log.read_text(errors='replace')}"
        assert time.monotonic() < deadline, f"no {line!r} in {timeout} s:\n{log.read_text()}"
        time.sleep(0.1)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """``kill -9`` of a driver and everything it started (its Python, its JVM's workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def read_every_record_once(
    tmp_path: Path, cluster: Cluster, fleet: Fleet, archive: Path, py_files: list[Path]
) -> None:
    """The batch job through ``spark-submit``: it succeeds, and its parquet holds every
    record of the fleet once."""
    out, log = tmp_path / "out", tmp_path / "batch.log"
    endpoints = ",".join(fleet.endpoints)
    driver = submit(
        cluster, JOB, "batch", endpoints, str(out), archive=archive, log=log, py_files=py_files
    )
    assert driver.wait(timeout=240) == 0, log.read_text(errors="replace")
    read = read_parquet(out)
    assert max(read.values()) == 1  # nothing twice
    assert set(read) == fleet.every_record()


@pytest.mark.timeout(300)
def test_a_batch_read_through_spark_submit_with_a_packed_environment(
    tmp_path: Path, cluster: Cluster, packed: Path, fleet: Fleet
) -> None:
    read_every_record_once(tmp_path, cluster, fleet, packed, py_files=[])


@pytest.mark.timeout(300)
def test_a_batch_read_with_streamq_shipped_as_a_wheel_by_py_files(
    tmp_path: Path, cluster: Cluster, fleet: Fleet
) -> None:
    """The guide's other way: the executors' Python has streamq's dependencies, not streamq
    (the archive the next test fails with), and streamq's pure wheel comes with
    ``--py-files``, named ``.zip``: PySpark puts only ``.zip``, ``.egg`` and ``.jar``
    files of ``--py-files`` on the executors' path, not ``.whl``."""
    deps_only = packed_environment(PACKED, with_streamq=False)
    shipped = tmp_path / "streamq.zip"
    shutil.copyfile(pure_wheel(PACKED), shipped)
    read_every_record_once(tmp_path, cluster, fleet, deps_only, py_files=[shipped])


@pytest.mark.timeout(300)
def test_a_streaming_query_with_streamq_by_py_files_and_a_driver_without_streamq(
    tmp_path: Path, cluster: Cluster, fleet: Fleet
) -> None:
    """The wheel's way for a streaming query, on a driver whose Python lacks streamq as
    the executors' does (the application imports it from the zip): Spark starts the
    driver's streaming source process without ``--py-files`` on its path, and the source
    imports streamq there from the zip the driver's planning imported it from. Every
    record is in the sink once."""
    deps_only = packed_environment(PACKED, with_streamq=False)
    shipped = tmp_path / "streamq.zip"
    shutil.copyfile(pure_wheel(PACKED), shipped)
    out, checkpoint, log = tmp_path / "out", tmp_path / "checkpoint", tmp_path / "stream.log"
    args = ("stream", ",".join(fleet.endpoints), str(out), str(checkpoint))
    driver = submit(
        cluster, JOB, *args, archive=deps_only, log=log, py_files=[shipped],
        driver=unpacked(deps_only),
    )  # fmt: skip
    assert driver.wait(timeout=240) == 0, log.read_text(errors="replace")[-5000:]
    read = read_committed(out)
    assert max(read.values()) == 1 and set(read) == fleet.every_record()


@pytest.mark.timeout(180)
def test_a_master_whose_ports_are_taken_is_read_where_it_bound(
    tmp_path: Path, http_server: str
) -> None:
    """The ports the master asks for are taken first by another web server, whose
    ``/json/`` is an HTML page (as another Spark UI took the port once chosen for the
    master's UI, between its choice and the master's bind): Spark binds next ones, the
    cluster reads from the master's log which, and its state comes from its own UI."""
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "index.html").write_text("<html><title>another Spark UI</title>")
    taken = int(http_server.rsplit(":", 1)[1])
    cluster = Cluster(tmp_path / "cluster", workers=1, port=taken, ui_port=taken)
    try:
        assert cluster.state()["url"] == cluster.master  # the master's own UI
        ports = {int(url.rsplit(":", 1)[1]) for url in (cluster.master, cluster.ui)}
        assert taken not in ports and len(ports) == 2
        assert cluster.alive_workers() == 1
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_executors_without_streamq_fail_the_query_at_once_saying_how_to_ship_it(
    tmp_path: Path, cluster: Cluster, fleet: Fleet
) -> None:
    """The executors' Python has PySpark's needs and streamq's, not streamq: the first task
    fails in one line naming the executor's host and how to ship streamq, not with a
    worker's ModuleNotFoundError, and the query ends within its task retries."""
    without = packed_environment(PACKED, with_streamq=False)
    out, log = tmp_path / "out", tmp_path / "batch.log"
    started = time.monotonic()
    endpoints = ",".join(fleet.endpoints)
    driver = submit(cluster, JOB, "batch", endpoints, str(out), archive=without, log=log)
    assert driver.wait(timeout=240) != 0
    said = log.read_text(errors="replace")
    line = "cannot import streamq's Spark source (No module named 'spark_source'): ship it"
    assert line in said and "--archives env.tar.gz#environment" in said, said[-3000:]
    assert "ModuleNotFoundError" not in said, said[-3000:]
    assert time.monotonic() - started < 120


@pytest.mark.timeout(400)
def test_a_streaming_query_goes_on_through_a_worker_and_its_driver_killed(
    tmp_path: Path, cluster: Cluster, packed: Path
) -> None:
    """A streaming query into parquet, 5 micro-batches over both workers: worker 1 (its
    executor and that executor's Python workers) ``kill -9``ed while the query reads,
    Spark runs its tasks again on worker 0; then the driver ``kill -9``ed and submitted
    again from the checkpoint. Every record is in the sink once."""
    fleet = Fleet(tmp_path, [25_000] * 4)
    try:
        out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
        args = ("stream", ",".join(fleet.endpoints), str(out), str(checkpoint))
        first = tmp_path / "first.log"
        driver = submit(cluster, JOB, *args, archive=packed, log=first)
        try:
            wait_for_line(first, "BATCH 0", driver, 180)
            cluster.kill_worker(1)  # while batch 1's tasks read, on both workers
            wait_for_line(first, "BATCH 2", driver, 180)
        finally:
            kill_group(driver)
        assert "DONE" not in first.read_text(errors="replace")
        cluster.start_worker(1)
        again = tmp_path / "again.log"
        driver = submit(cluster, JOB, *args, archive=packed, log=again)
        assert driver.wait(timeout=240) == 0, again.read_text(errors="replace")
    finally:
        fleet.close()
    read = read_committed(out)
    assert max(read.values()) == 1, [k for k, n in read.items() if n > 1][:5]
    assert set(read) == fleet.every_record()
    # Spark lost worker 1's executor while the query read, and went on without it.
    assert "Lost executor" in first.read_text(errors="replace")
    # The executors ran on the cluster's workers, from the archive's Python.
    apps = cluster.state()["completedapps"]
    assert apps, cluster.state()


def sink_query(
    tmp_path: Path, cluster: Cluster, packed: Path, fleet: Fleet, pg_url: str, name: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """The cluster job's streaming query from ``fleet`` into streamq's sink, the producer
    database ``pg_url`` (its log tables made first), submitted; and its log."""
    make_db(pg_url)
    log = tmp_path / f"{name}.log"
    args = ("sink", ",".join(fleet.endpoints), pg_url, str(tmp_path / "checkpoint"))
    return submit(cluster, JOB, *args, archive=packed, log=log), log


def assert_copied_once_in_order(pg_url: str, tmp_path: Path, fleet: Fleet) -> None:
    """A consumer's copy of stream ``copied``: every record of the fleet once, and each
    producer's in its order (a micro-batch publishes its partitions in order, each a range
    of one producer's seqs, and the batches follow each other)."""
    total = sum(fleet.records.values())
    copy = consumed(pg_url, str(tmp_path / "copy.db"), stream="copied", least=total)
    values = [value for _, value, _ in copy]
    counts = Counter(values)
    assert max(counts.values()) == 1, [v for v, n in counts.items() if n > 1][:5]
    expected = {b"%d-%d" % (i, n) for i, count in enumerate(fleet.records.values())
                for n in range(count)}  # fmt: skip
    assert set(values) == expected
    by_producer: dict[bytes, list[int]] = {}
    for value in values:
        producer, _, n = value.partition(b"-")
        by_producer.setdefault(producer, []).append(int(n))
    assert all(ns == sorted(ns) for ns in by_producer.values())


@pytest.mark.timeout(400)
def test_the_sink_writes_from_a_cluster_into_postgresql_its_driver_alone_connecting(
    tmp_path: Path, cluster: Cluster, packed: Path, fleet: Fleet, pg_url: str
) -> None:
    """streamq -> Spark on the cluster -> streamq's sink on PostgreSQL -> a consumer. The
    executors' Python (the packed environment) has no PostgreSQL driver: they convert
    their rows and hand them back, and the driver's commit alone connects and writes."""
    driver, log = sink_query(tmp_path, cluster, packed, fleet, pg_url, "sink")
    assert driver.wait(timeout=300) == 0, log.read_text(errors="replace")[-5000:]
    assert_copied_once_in_order(pg_url, tmp_path, fleet)
    assert cluster.state()["completedapps"], cluster.state()  # it ran on the cluster


@pytest.mark.timeout(400)
def test_a_worker_killed_while_the_sink_writes_leaves_an_exact_copy(
    tmp_path: Path, cluster: Cluster, packed: Path, pg_url: str
) -> None:
    """Worker 1 (its executor and the executor's Python workers) ``kill -9``ed once the
    first micro-batch committed, while the next batches' tasks convert rows on both
    workers: Spark runs the lost tasks again on worker 0, and only the attempts whose
    messages it commits are published. The copy holds every record once, in order."""
    fleet = Fleet(tmp_path, [25_000] * 4)  # 5 micro-batches of 20,000
    try:
        driver, log = sink_query(tmp_path, cluster, packed, fleet, pg_url, "sink")
        try:
            wait_for_line(log, "BATCH 0", driver, 240)
            cluster.kill_worker(1)
            assert driver.wait(timeout=300) == 0, log.read_text(errors="replace")[-5000:]
        finally:
            kill_group(driver)
        assert "Lost executor" in log.read_text(errors="replace")
        assert_copied_once_in_order(pg_url, tmp_path, fleet)
    finally:
        fleet.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("spark-guide")  # a cluster of its own: beside the shared one's tests
def test_the_guides_cluster_lines_run_as_written(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """docs/guides/spark.md's "Running on a cluster", its lines run in a shell as a user
    runs them (pip's ``spark-class`` and ``spark-submit`` on the PATH, no ``SPARK_HOME``),
    but for the hosts and ports (loopback, the test's), the checkout for ``./streamq`` and
    the cluster's job for ``app.py``: a master and a worker, the packed environment (of
    the size the guide says) and a batch read through it, and a Spark Connect server on
    the cluster, which a client reads every record through."""
    daemons, packed, _, connect = harness.guide_blocks("Running on a cluster", GUIDE)
    master, ui, grpc = reserve_port(), reserve_port(), reserve_port()
    fleet = Fleet(tmp_path, [300, 500])
    endpoints, out = ",".join(fleet.endpoints), tmp_path / "out"

    def as_here(lines: list[str]) -> str:
        here = {
            "--host master": f"--host {LOOPBACK}",
            "master:7077": f"{LOOPBACK}:{master}",
            "--port 7077": f"--port {master}",
            "--webui-port 8080": f"--webui-port {ui}",
            "--webui-port 8081": "--webui-port 0",
            "./streamq": str(ROOT),
            "15002": str(grpc),
            "app.py": f"{JOB} batch {endpoints} {out}",
            "/opt/streamq-env": str(tmp_path / "opt" / "streamq-env"),
        }
        script = "\n".join(lines)
        for written, run in here.items():
            script = script.replace(written, run)
        return script

    env = spark_env(tmp_path)  # loopback only, quiet daemons; no SPARK_HOME, no PYSPARK_*
    del env["SPARK_HOME"], env["PYSPARK_PYTHON"]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    processes = harness.Processes(tmp_path, env, cwd=tmp_path)
    try:
        for i, line in enumerate(daemons):
            processes.start(f"daemon{i}", "bash", "-c", f"exec {as_here([line])}")

        def one_worker() -> bool:
            state = starting_master_state(f"http://{LOOPBACK}:{ui}")
            return state is not None and state.get("aliveworkers") == 1

        harness.wait_until(one_worker, 120, "the master and a worker")
        processes.run("packed", "bash", "-ec", as_here(packed), timeout=600)
        read = read_parquet(out)
        assert max(read.values()) == 1 and set(read) == fleet.every_record()
        documented = re.search(r"\((\d+) MiB\s+with pyarrow", GUIDE.read_text())
        assert documented is not None
        size = (tmp_path / "env.tar.gz").stat().st_size / 2**20
        assert abs(size - int(documented[1])) < 0.2 * int(documented[1]), f"{size:.0f} MiB"

        server = processes.start("connect", "bash", "-ec", as_here(connect))
        bound = server.wait_for_line(r"started service '\S+SparkConnectService' on port (\d+)", 180)
        assert int(bound[1]) == grpc
        client = subprocess.run(
            [sys.executable, str(CLIENT), f"sc://{LOOPBACK}:{grpc}", endpoints,
             str(tmp_path / "connect-out"), str(tmp_path / "connect-checkpoint")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert client.returncode == 0, client.stdout + client.stderr[-3000:]
        assert "BATCH 800" in client.stdout and "STREAM 800" in client.stdout, client.stdout
        assert set(read_committed(tmp_path / "connect-out")) == fleet.every_record()
    finally:
        processes.close()
        fleet.close()

"""What a Spark process unpickles first (``spark_source/shipping.py``), without Spark: a
class found in the zip it was imported from, and the line naming the process that cannot
import streamq."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from spark_source.shipping import STREAMING_SOURCE_RUNNER, rebuild

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = """
from spark_source.shipping import Shipped


class Order(Shipped):
    def __init__(self, seq: int) -> None:
        self.seq = seq
"""


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_class_imported_from_a_zip_is_rebuilt_where_the_zip_is_not_on_the_path(
    tmp_path: Path,
) -> None:
    """As the driver's streaming source process, which Spark starts without the
    ``--py-files`` zips on its path: the pickle names the zip its class came from."""
    shipped = tmp_path / "streamq.zip"
    with zipfile.ZipFile(shipped, "w") as zipped:
        zipped.writestr("orders_module.py", SHIPPED)
    pickled = tmp_path / "order.pickle"
    made = python(
        "import sys; from pyspark import cloudpickle; sys.path.append(sys.argv[1]); "
        "import orders_module; open(sys.argv[2], 'wb').write(cloudpickle.dumps("
        "orders_module.Order(42)))",
        str(shipped),
        str(pickled),
    )
    assert made.returncode == 0, made.stderr
    read = python(
        "import pickle, sys; order = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "print(type(order).__module__, order.seq)",
        str(pickled),
    )
    assert read.returncode == 0, read.stderr
    assert read.stdout.split() == ["orders_module", "42"]


def test_the_process_that_cannot_import_streamq_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An executor, or the driver's streaming source process (``python -m`` of Spark's
    runner): each line says where, and what to do there."""
    with pytest.raises(RuntimeError) as executor:
        rebuild("no_such_module", "Order", b"")
    assert str(executor.value).startswith("the Spark executor on ")
    assert "(No module named 'no_such_module'): ship it to the executors" in str(executor.value)

    runner = types.ModuleType("__main__")
    runner.__spec__ = importlib.machinery.ModuleSpec(STREAMING_SOURCE_RUNNER, None)
    monkeypatch.setitem(sys.modules, "__main__", runner)
    with pytest.raises(RuntimeError) as driver:
        rebuild("no_such_module", "Order", b"")
    said = str(driver.value)
    assert said.startswith("the Spark driver's streaming source process on "), said
    assert f"spark.pyspark.python, from the driver's working directory: {sys.executable}" in said
    assert said.endswith(
        "install streamq in that Python, or give its wheel as a .zip with --py-files "
        "(docs/guides/spark.md, 'Running on a cluster')"
    )
    assert "executor" not in said

"""What a running streaming source holds, read from ``/proc``: the streamq source's driver
side runs in a Python process of its own (Spark's ``python_streaming_source_runner``),
the Kafka source's in Spark's JVM. Figures: that process's resident memory and its TCP
connections to the producers (the broker)."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"
JVM = "org.apache.spark.deploy.SparkSubmit"


def _child(parent: int, text: str) -> int:
    """The child process of ``parent`` whose command line holds ``text`` (one only)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            command = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # exited meanwhile
        if int(stat.rpartition(")")[2].split()[1]) == parent and text.encode() in command:
            found.append(int(entry.name))
    (pid,) = found
    return pid


def _spark_jvm() -> int:
    """This process's Spark JVM (local mode: the driver and the executors)."""
    return _child(os.getpid(), JVM)


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for process {pid}")


def connections(pid: int, ports: Collection[int]) -> int:
    """The process's established TCP connections to a peer on one of ``ports``."""
    inodes = set()
    for fd in os.scandir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(fd.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and inode in inodes and int(remote.rsplit(":", 1)[1], 16) in ports:
                found += 1
    return found


def streamq_source(endpoints: Collection[str]) -> dict[str, float]:
    """The streamq source's Python process: its memory, its connections to the producers."""
    runner = _child(_spark_jvm(), RUNNER)  # one streaming query at a time
    ports = {int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints}
    return {"source MiB": resident_mib(runner), "source sockets": connections(runner, ports)}


def kafka_source(bootstrap: str) -> dict[str, float]:
    """The Kafka source lives in Spark's JVM: the JVM's memory (Spark's as a whole) and its
    connections to the broker."""
    jvm = _spark_jvm()
    port = int(bootstrap.rsplit(":", 1)[1])
    return {"source MiB": resident_mib(jvm), "source sockets": connections(jvm, {port})}

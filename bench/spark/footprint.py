"""What a running streaming source holds, read from ``/proc``: the streamq source's driver
side runs in a Python process of its own (Spark's ``python_streaming_source_runner``),
the Kafka source's in Spark's JVM. Figures: that process's resident memory and its TCP
connections to the producers (the broker)."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

from ..common import proc_kib

RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"
JVM = "org.apache.spark.deploy.SparkSubmit"


class Process(NamedTuple):
    """A process of this machine, as its ``/proc/PID/stat`` shows it."""

    pid: int
    state: str  # R, S, Z (a zombie)...
    parent: int
    session: int


def processes() -> Iterator[Process]:
    """Every process now (those that exit meanwhile left out)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        state, parent, _group, session = stat.rpartition(")")[2].split()[:4]
        yield Process(int(entry.name), state, int(parent), int(session))


def _child(parent: int, text: str) -> int:
    """The child process of ``parent`` whose command line holds ``text`` (one only)."""
    found = []
    for process in processes():
        if process.parent != parent:
            continue
        try:
            command = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # exited meanwhile
        if text.encode() in command:
            found.append(process.pid)
    (pid,) = found
    return pid


def _spark_jvm() -> int:
    """This process's Spark JVM (local mode: the driver and the executors)."""
    return _child(os.getpid(), JVM)


class Connection(NamedTuple):
    """An established TCP connection of this machine, as ``/proc/net/tcp`` shows it."""

    local_port: int
    remote_port: int
    unread: int  # bytes received and not read yet (the receive queue)
    inode: str  # its socket's, as a process's ``/proc/PID/fd`` links name it


def established() -> Iterator[Connection]:
    """Every established TCP connection (IPv4 and IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            _, local, remote, state, queues, _, _, _, _, inode = line.split()[:10]
            if state == "01":  # ESTABLISHED
                yield Connection(
                    int(local.rsplit(":", 1)[1], 16),
                    int(remote.rsplit(":", 1)[1], 16),
                    int(queues.split(":")[1], 16),
                    inode,
                )


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
    return sum(1 for c in established() if c.inode in inodes and c.remote_port in ports)


def streamq_source(endpoints: Collection[str]) -> dict[str, float]:
    """The streamq source's Python process: its memory, its connections to the producers."""
    runner = _child(_spark_jvm(), RUNNER)  # one streaming query at a time
    ports = {int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints}
    resident = proc_kib(runner, "VmRSS") / 1024
    return {"source MiB": resident, "source sockets": connections(runner, ports)}


def kafka_source(bootstrap: str) -> dict[str, float]:
    """The Kafka source lives in Spark's JVM: the JVM's memory (Spark's as a whole) and its
    connections to the broker."""
    jvm = _spark_jvm()
    port = int(bootstrap.rsplit(":", 1)[1])
    resident = proc_kib(jvm, "VmRSS") / 1024
    return {"source MiB": resident, "source sockets": connections(jvm, {port})}

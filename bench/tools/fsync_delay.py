"""A slower disk for a PostgreSQL server: an ``LD_PRELOAD`` library, built here with ``cc``,
that sleeps ``FSYNC_DELAY_US`` microseconds after each real ``fsync``/``fdatasync``.

A cloud disk takes about a millisecond to make a write durable (a local NVMe disk, or
this VM's, a fraction of that); group commit, lock queues and convoys show only when a
flush costs what it costs there. ``python -m bench.tools.fsync_delay`` prints the
library's path; ``server_env(delay_us)`` is what to start the server with.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static long delay_us(void) {
    static long delay = -1;
    if (delay < 0) {
        const char *value = getenv("FSYNC_DELAY_US");
        delay = value ? atol(value) : 0;
    }
    return delay;
}

static void pause_after_sync(void) {
    long us = delay_us();
    if (us > 0) {
        struct timespec t = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&t, 0);
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int result = real(fd);
    pause_after_sync();
    return result;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int result = real(fd);
    pause_after_sync();
    return result;
}
"""


def build() -> Path:
    """The library, built once per source (in the system's temporary directory, readable
    by the server's user)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("a C compiler (cc) is needed to slow the disk down: apt-get install gcc")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"streamq-fsync-delay-{digest}"
    library = folder / "fsync_delay.so"
    if library.exists():
        return library
    folder.mkdir(mode=0o755, exist_ok=True)
    source = folder / "fsync_delay.c"
    source.write_text(SOURCE)
    partial = folder / f"fsync_delay.{os.getpid()}.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source), "-ldl"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    partial.chmod(0o755)
    partial.replace(library)
    return library


def server_env(delay_us: int) -> dict[str, str]:
    """Environment for the server's programs: nothing for 0."""
    if delay_us <= 0:
        return {}
    return {"LD_PRELOAD": str(build()), "FSYNC_DELAY_US": str(delay_us)}


if __name__ == "__main__":
    print(build(), file=sys.stdout)

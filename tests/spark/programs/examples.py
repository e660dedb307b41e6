"""Runs Python programs one after another in this one process, for tests/docs/test_docs.py: the
documentation's Spark examples, so that Spark's JVM starts once, not once per example
(about 10 s each on a small machine).

    python -W error examples.py

Reads one JSON request per line on stdin, ``{"script": PATH, "stdout": FILE, "stderr":
FILE, "env": {NAME: VALUE}}``, and answers each with one JSON line on stdout, ``{"status":
N}``, N being the exit status ``python PATH`` would have had (an uncaught exception: 1, with
its traceback). The program runs as ``__main__`` in a namespace of its own, in its own
folder (``sys.path[0]`` too), with ``sys.argv == [PATH]`` and exactly ``env`` as its
environment; what it prints goes to the two files. Afterwards, as its exit would: a
SparkSession it left running is stopped, threads it started (not daemons) are waited for,
and the runner's environment, folder and warning filters are restored. A thread still
running 10 s later fails the program (status 1): it would have kept ``python PATH`` from
exiting.

Everything else written to this process's stdout and stderr (Spark's JVM inherits them)
goes to its stderr, kept apart from the answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

THREAD_EXIT_TIMEOUT = 10.0  # s for the threads a program started to end after it


def stop_spark() -> None:
    """Stop the Spark a program left running (its JVM stays, for the next program)."""
    sql = sys.modules.get("pyspark.sql")
    if sql is not None and sql.SparkSession._instantiatedSession is not None:
        sql.SparkSession._instantiatedSession.stop()
    core = sys.modules.get("pyspark")
    if core is not None and core.SparkContext._active_spark_context is not None:
        core.SparkContext._active_spark_context.stop()


def run_program(script: Path) -> int:
    """Run ``script`` as ``python script`` would; its exit status."""
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def serve(request: dict[str, Any]) -> int:
    script = Path(request["script"]).resolve()
    folder = script.parent
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0]
    saved_filters = warnings.filters[:]
    threads_before = set(threading.enumerate())
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(folder)
    sys.argv[:] = [str(script)]
    sys.path[0] = str(folder)
    try:
        with (
            open(request["stdout"], "w", encoding="utf-8") as out,
            open(request["stderr"], "w", encoding="utf-8") as err,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            status = run_program(script)
            try:
                stop_spark()
            except Exception:
                traceback.print_exc()
                status = status or 1
            started = [t for t in threading.enumerate() if t not in threads_before]
            for thread in started:
                if not thread.daemon:
                    thread.join(THREAD_EXIT_TIMEOUT)
            if left := [t.name for t in started if not t.daemon and t.is_alive()]:
                print(f"threads still running after the program: {left}", file=sys.stderr)
                status = status or 1
    finally:
        warnings.filters[:] = saved_filters
        sys.argv[:], sys.path[0] = saved_argv, saved_path0
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return status


def main() -> int:
    with os.fdopen(os.dup(1), "w", encoding="utf-8") as answers:  # a dup is not inherited
        os.dup2(2, 1)  # the JVM and every other child write their stdout to stderr
        for line in sys.stdin:
            status = serve(json.loads(line))
            answers.write(json.dumps({"status": status}) + "\n")
            answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

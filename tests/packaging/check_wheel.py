"""``make wheel``: the Linux x86_64 wheel built here, with the compiled path, installed in
a clean virtual environment, runs compiled, and publishes and consumes.

Not collected by ``make test`` (its name is no ``test_*.py``): it builds the wheel in an
isolated build environment (setuptools and mypy fetched from the package index) and
installs the wheel's dependencies in a new venv, a few minutes of work.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROUND_TRIP = textwrap.dedent(
    """
    import asyncio, sys, streamq, streamq.native
    from streamq.protocol import RecordColumns, codec, decode_message, encode_values, records_frame

    async def main(db: str, consumer_db: str) -> None:
        async with streamq.Producer(db) as producer:
            await producer.publish("orders", b"one")
            consumer = streamq.Consumer(producer.address, "orders", db=consumer_db, name="c")
            async with consumer as c:
                async with asyncio.timeout(30):
                    batch = await anext(c)
                async with c.transaction(batch):
                    pass
                body = records_frame(encode_values(1, 0, [b"one"]))[4:]
                frame = decode_message(body, raw_records=True, columnar=True)
                columnar = isinstance(frame, RecordColumns)  # the C decoder loaded
                native = columnar and codec.ENCODES_IN_C  # and the C encoder
                print([r.value for r in batch], native, streamq.native.build().describe())

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_the_wheel_runs_compiled_in_a_clean_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        timeout=900,
    )
    (wheel,) = wheels.glob("streamq-*.whl")
    assert "linux_x86_64" in wheel.name, wheel.name  # a binary wheel, not py3-none-any
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)
    done = subprocess.run(
        [python, "-c", ROUND_TRIP, str(tmp_path / "p.db"), str(tmp_path / "c.db")],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: the installed package, nothing else
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    values, native, build = done.stdout.strip().split(" ", 2)
    assert values == "[b'one']"
    assert native == "True"
    assert build.startswith("compiled (mypyc"), build

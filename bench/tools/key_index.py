"""What the key index costs on the publish path: ``python -m bench.tools.key_index``.

Publishes the same keyed records through a real ``Producer`` into three streams:
keys indexed (the default), ``key_index=False``, and the same records without a
key (never indexed). Prints records per second for transactions of 1 and of 100
records; also the time one ``history`` and one ``seek_time`` take at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time

from streamq import Producer

from .. import common

CASES = {"keyed, indexed": True, "keyed, key_index=False": False, "no key": None}


async def _publish(producer: Producer, stream: str, total: int, per_tx: int, keyed: bool) -> float:
    rnd = random.Random(1)
    value = b"x" * 100
    started = time.perf_counter()
    for _ in range(total // per_tx):
        async with producer.transaction() as tx:
            for _ in range(per_tx):
                key = b"customer-%d" % rnd.randrange(10_000) if keyed else None
                await tx.publish(stream, value, key=key)
    return total / (time.perf_counter() - started)


async def measure(total: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        async with Producer(os.path.join(folder, "bench.db"), serve=False) as producer:
            for name, indexed in CASES.items():
                await producer.create_stream(name, key_index=indexed is not False)
            for per_tx in (1, 100):
                count = total // 10 if per_tx == 1 else total
                for name, indexed in CASES.items():
                    rate = await _publish(producer, name, count, per_tx, indexed is not None)
                    common.console.print(
                        f"{per_tx:>4} record(s)/tx  {name:<24} {rate:>10,.0f} records/s"
                    )
            for name, indexed in CASES.items():
                if indexed is None:
                    continue
                started = time.perf_counter()
                found = await producer.history(name, b"customer-42")
                took = (time.perf_counter() - started) * 1000
                common.console.print(
                    f"history of one key ({name}): {len(found)} records, {took:.1f} ms"
                )
            started = time.perf_counter()
            await producer.seek_time("keyed, indexed", int(time.time() * 1000) - 1000)
            took = (time.perf_counter() - started) * 1000
            common.console.print(f"seek_time: {took:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.key_index", description=__doc__)
    parser.add_argument("--records", type=int, default=200_000, help="per stream, 100 per tx")
    asyncio.run(measure(parser.parse_args().records))


if __name__ == "__main__":
    main()

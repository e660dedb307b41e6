"""A producer process that only serves, for tests that attack it and measure it from outside.

    server_proc.py DB [--records N] [--max-frame-size B] [--max-connections N]
                      [--handshake-timeout S] [--idle-timeout S] [--frame-timeout S]

Publishes N records to stream ``orders`` if it is empty, prints ``READY <address>``,
and serves until killed. Its memory (VmRSS, VmHWM) is read from /proc by the test.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys

import streamq
from streamq._loop import run

STREAM = "orders"


async def main(args: argparse.Namespace) -> None:
    # Room for every connection the test opens (the hard limit is the container's).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, room), hard))
    settings = streamq.ServerSettings(
        max_frame_size=args.max_frame_size,
        max_batch_bytes=min(1024 * 1024, args.max_frame_size // 2),
        max_connections=args.max_connections,
        handshake_timeout=args.handshake_timeout,
        idle_timeout=args.idle_timeout,
        frame_timeout=args.frame_timeout,
        heartbeat_interval=0.2,
    )
    async with streamq.Producer(args.db, settings=settings, watch_interval=0.05) as producer:
        if STREAM not in producer.log.streams or producer.head(STREAM) == 0:
            async with producer.transaction() as tx:
                await tx.publish_many(STREAM, [b"%d" % n for n in range(args.records)])
        print(f"READY {producer.address}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("--records", type=int, default=20)
    parser.add_argument("--max-frame-size", type=int, default=64 * 1024)
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument("--handshake-timeout", type=float, default=2.0)
    parser.add_argument("--idle-timeout", type=float, default=2.0)
    parser.add_argument("--frame-timeout", type=float, default=2.0)
    sys.exit(run(main(parser.parse_args())))

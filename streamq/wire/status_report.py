"""A producer's status report (``Client.status``, docs/protocol.md "STATUS") read as the
CLI and the console show it: one row per consumer and stream."""

from __future__ import annotations

from typing import Any


def consumer_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each position the producer knows, with the peers connected under its name (with
    tokens, positions count under the name the token proved: ``principal``), then the
    consumers connected that applied nothing yet (lag: the whole stream)."""
    heads = {s["stream"]: s["head"] for s in status["streams"]}
    peers: dict[tuple[str, str], list[str]] = {}
    for c in status["consumers"]:
        name = c.get("principal") or c["consumer"]
        peers.setdefault((name, c["stream"]), []).append(c["peer"])
    rows = [
        {
            **p,
            "exact": p.get("exact", True),
            "connected": peers.pop((p["consumer"], p["stream"]), []),
        }
        for p in status.get("positions", [])
    ]
    for (consumer, stream), connected in peers.items():
        rows.append(
            {
                "consumer": consumer,
                "stream": stream,
                "applied": None,
                "lag": heads.get(stream, 0),
                "exact": True,
                "registered": False,
                "lost": 0,
                "updated_at": 0,
                "connected": connected,
            }
        )
    return rows

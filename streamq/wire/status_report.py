"""A producer's status report (``Client.status``, docs/protocol.md "STATUS") read as the
CLI and the console show it: one row per consumer and stream."""

from __future__ import annotations

from typing import Any


def consumer_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each position the producer knows, with the peers connected under its name (with
    tokens, positions count under the name the token proved: ``principal``), then the
    consumers connected that applied nothing yet (lag: the whole stream).

    ``connected``: subscribed now. A position of a consumer that is not is as of its last
    report (``updated_at``): it may have committed more since, so its lag is an upper
    bound (``exact`` False), as a producer before ``connected`` did not say."""
    heads = {s["stream"]: s["head"] for s in status["streams"]}
    peers: dict[tuple[str, str], list[str]] = {}
    for c in status["consumers"]:
        name = c.get("principal") or c["consumer"]
        peers.setdefault((name, c["stream"]), []).append(c["peer"])
    rows = []
    for p in status.get("positions", []):
        connected_from = peers.pop((p["consumer"], p["stream"]), [])
        connected = p.get("connected", bool(connected_from))
        exact = p.get("exact", True) and (connected or not p["lag"])
        rows.append({**p, "exact": exact, "connected": connected, "peers": connected_from})
    for (consumer, stream), connected_from in peers.items():
        rows.append(
            {
                "consumer": consumer,
                "stream": stream,
                "applied": None,
                "lag": heads.get(stream, 0),
                "exact": True,
                "connected": True,
                "registered": False,
                "lost": 0,
                "updated_at": 0,
                "peers": connected_from,
            }
        )
    return rows

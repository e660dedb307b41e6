"""Consumer groups: worker processes sharing a stream's shares, with leases.

Owns the ``GroupConsumer`` (a consumer per share it holds, taken and given up as members
come and go) and ``membership`` (who holds which share: the plan every member computes
from the same view of the leases). The leases' SQL is each engine's
(``engines/leases.py``, ``engines/*/leases.py``).

May import: the consumer's side (a group member runs consumers), the shared modules at
the top, ``wire`` and ``engines``. Never the producer's side.
"""

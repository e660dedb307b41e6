"""The consumer's side: records pushed by producers, applied exactly once into the
consumer's own database.

Owns the ``Consumer`` and its parts: the subscription to one producer (kept up across
faults), the turn that applies one batch per transaction, settings, failure policies
for poison records, fan-in from several producers, saving a position through the
application's own connection, the position-store interface the engines implement
(``position_store``, with ``batch``), opening the consumer's database (``database``),
and moving stored positions to another split of shares (``resharing``).

May import: the shared modules at the top, ``protocol``, ``wire`` and ``engines``. Never
the producer's side or groups. This ``__init__`` imports nothing, so that an engine can
take the interface it implements without loading the consumer.
"""

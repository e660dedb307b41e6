"""The producer's side: a service's database as a stream's source, and the server on it.

Owns the ``Producer`` and everything it runs: the writing core (``writing``), the
producer's transactions and their group commit, publishing through the application's
own connection, the committed log as readers see it (``committed_log``), what consumers
have applied as the producer knows it (``consumer_positions``), retention, compaction,
noticing other writers' commits, receipts, the server that pushes records, and the
storage interface its engines implement (``storage``, with ``append_rule``).

May import: the shared modules at the top (``errors``, ``records``, ``filters``,
``changes``, ``sql``, ``metrics``), ``protocol``, ``wire`` and ``engines``. Never the
consumer's side or groups. This ``__init__`` imports nothing, so that an engine can take
the interface it implements without loading the producer.
"""

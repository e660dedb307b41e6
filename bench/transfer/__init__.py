"""Workload 3, transfer: a payments service debits an account and emits a deposit; a ledger
service credits it exactly once in its own database (``run``, starting the processes by
``deployment``; processes: ``streamq``, ``kafka``; what they share: ``common``).

Roles (``python -m bench.transfer.streamq ROLE ARGS``, ``python -m bench.transfer.kafka ROLE
ARGS``):

- streamq ``producer DB PORT TOTAL RATE SEED``: the debit, the transfer's journal row and
  ``tx.publish("deposits", ...)`` commit in ONE transaction of the service's database.
- streamq ``consumer ADDRESS DB TARGET``: ``streamq.Consumer(..., name="ledger")``; credits in
  ``consumer.transaction(batch)`` (the position is stored in the same transaction).
- kafka ``outbox-producer DB TOTAL RATE SEED``: a transactional outbox: the debit, the
  journal row and ``INSERT INTO outbox`` commit in one SQLite transaction.
- kafka ``relay DB BOOTSTRAP TOPIC``: the outbox relay. Reads outbox rows after the last
  relayed id (``relay_state``, in the producer's database), produces them with an idempotent
  producer (``acks=all``), waits for their delivery, then records the last relayed id:
  at least once (killed after delivery and before recording, it re-sends).
- kafka ``naive-producer DB BOOTSTRAP TOPIC TOTAL RATE SEED``: the dual write: commits the
  debit and the journal row, THEN produces the deposits and waits for their delivery.
- kafka ``consumer BOOTSTRAP TOPIC DB TARGET DEDUPE``: stores its offsets in its SQLite
  database in the same transaction as the credits and starts from them; with DEDUPE=1 it
  also skips transfer ids it has already credited (table ``seen``), as a careful consumer
  of an at-least-once relay must.

Every consumer keeps ``credits(transfer_id, amount)`` WITHOUT a unique index, so a deposit
applied twice shows as two rows; Kafka's consumer also keeps every delivery it received in
``received`` (duplicates delivered by the relay show there, whether deduped or not).

Producers publish TOTAL transfers in all (a restarted producer continues from its
committed journal), at RATE transfers/s (each due at start + i / RATE, carried in the
deposit; 0: as fast as possible, 1 to 50 transfers per transaction). Consumers stop after
crediting TARGET deposits (0: never).

Lines on stdin: ``GO`` (producers start), ``ARM N`` (SIGKILL yourself at the N-th
"worst moment" from now: right after a COMMIT for producers and consumers, after delivery
and before recording the position for the relay), ``STOP`` (also the end of stdin: the
process exits within 5 s, so none outlives the benchmark). On stdout: ``READY
[address]``, ``START <time>``, ``DONE <time> [p50 p99 p99.9 max count]`` (consumers:
latency from each transfer's due time to the commit of its credit, microseconds).
"""

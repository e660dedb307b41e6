"""Workload 6, workers (``run``; processes: ``streamq``, ``kafka``, ``sync_path``; what they
share: ``common``).

A service runs as several worker processes (gunicorn, a Celery pool) on ONE SQLite
database. Each order is a business row in ``orders`` and its event, committed together in
one ``BEGIN IMMEDIATE`` transaction on the worker's own sqlite3 connection. Roles
(``python -m bench.workers.streamq ROLE ARGS``, ``bench.workers.kafka``,
``bench.workers.sync_path``):

- both: ``worker DB INDEX WORKERS RATE COUNT SECONDS``: worker INDEX of WORKERS commits
  COUNT orders. streamq's event is ``streamq.publish(conn, ...)``; kafka's: ``INSERT INTO
  outbox``, shipped to Kafka by the transfer workload's relay (``python -m
  bench.transfer.kafka relay``). RATE > 0 is the whole service's rate in
  orders/s: order n of worker i is due at GO + (n * WORKERS + i) / RATE and carries that
  time (a late worker does not skip: what was due during a stall is measured from its
  due time); RATE 0: as fast as it can, each order stamped when its transaction begins.
  Any exception is a refused transaction; the worker goes on with the next order. Before
  READY each worker commits one order numbered -1, as a long-running worker would have its
  connection open and its statements prepared; consumers receive it but do not time it.
- streamq ``consumer ADDRESS OUT SECONDS DRAIN``: a ``streamq.Consumer`` tailing the stream from
  seq 1.
- kafka ``consumer BOOTSTRAP TOPIC OUT SECONDS DRAIN``: a confluent-kafka consumer with the
  latency workload's settings, from offset 0.
- sync_path ``VARIANT DB THREADS COUNT SECONDS``: the synchronous path alone, THREADS threads of
  one process committing COUNT orders in all, as fast as they can, no consumer:
  ``SyncProducer serving`` (serving from the same process, as a web service runs it),
  ``SyncProducer`` (``serve=False``; both ``tx.execute`` + ``tx.publish``), ``publish``
  (``streamq.publish`` on a plain sqlite3 connection per thread) or ``sqlite3`` (the
  business row and an outbox row of the event's size: what the database alone costs).

Times are ``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every process on the
machine. SECONDS bounds every loop. Lines: workers say ``READY <PRAGMA synchronous>``,
wait for ``GO <start ns>``, say ``DONE <committed> <refused> <end ns> <errors> <histogram>
<CPU s since GO>`` (HdrHistogram, encoded: microseconds from each order's due time to its
COMMIT returning, which separates waiting for the write lock from delivery). Consumers say
``READY``, receive until ``EXPECT <N>`` records have come (or stdin closes; at most DRAIN
seconds after EXPECT, SECONDS in all), write what they received to OUT
(``received(position, order_id)``, in arrival order) and say ``DONE <p50> <p99> <p99.9>
<max> <count> <last receipt ns> <CPU s since READY>`` (microseconds from each order's due
time to its receipt). ``sync_path`` says ``DONE <orders/s> <committed> <refused> <synchronous>
<CPU s> <run-queue s>``: its threads' time on a CPU while timed, and runnable but waiting
for one.
"""

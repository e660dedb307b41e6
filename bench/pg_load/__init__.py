"""PostgreSQL at production load: many application processes publishing into one
PostgreSQL database on a disk with a cloud disk's flush time, streamq against Kafka + an
outbox and against the outbox alone (``run.py``; processes in ``procs.py``)."""

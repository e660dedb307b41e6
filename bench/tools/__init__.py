"""Diagnostics run by hand, not by ``python -m bench``: where latency goes
(``latency_probe``), what the key index costs (``key_index``); and a slower disk for a
PostgreSQL server (``fsync_delay``, used by ``bench.pg_load``)."""

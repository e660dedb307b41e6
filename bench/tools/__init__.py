"""Diagnostics run by hand, not by ``python -m bench``: where latency goes
(``latency_probe``), what the key index costs (``key_index``), what PostgreSQL's per-stream
lock costs (``pg_lock``)."""

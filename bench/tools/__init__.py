"""Diagnostics run by hand, not by ``python -m bench``: where latency goes
(``latency_probe``), what the key index costs (``key_index``), where a transaction's time
goes (``transfer_profile``, ``tx_cost``), how long each write path holds SQLite's write
lock (``lock_hold``), the compiled path against pure Python (``builds``); and a slower
disk for a PostgreSQL server (``fsync_delay``, used by ``bench.pg_load``)."""

# Each build by the ``STREAMQ_PURE`` its processes run with (``streamq/native.py``).
BUILDS = {"compiled": "", "pure": "1"}

"""Workload 1, pipe: records from a producer process to a consumer process that applies them
exactly once into its own SQLite database (``run``; processes: ``streamq``, ``kafka``)."""

"""Workload 8, shares: worker processes splitting one stream by key (``run``; processes:
``streamq``; Kafka plays no part)."""

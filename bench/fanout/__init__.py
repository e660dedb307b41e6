"""Workload: fan-out, one producer serving N consumers that tail one stream (``run``;
processes: ``streamq``).

The producer, its embedded server on one core (CPU 0), publishes records of 100 B on a
fixed schedule, one per transaction (``latency``'s ``Pacer``: each carries its due time);
N consumers, in several processes on the other core, each receive every record. Per N
and rate: the producer's CPU per commit, the rate it reached, ``publish()``'s p50 and p99,
and p50/p99 from due time to receipt over every consumer's every record.
"""

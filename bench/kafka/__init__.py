"""A real single-node Apache Kafka broker (KRaft) for the benchmarks: see ``broker.py``."""

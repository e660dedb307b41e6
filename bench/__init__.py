"""Benchmarks: streamq against a real Apache Kafka broker, side by side in one run.

``python -m bench`` (``make bench``) runs every workload at full size;
``python -m bench --quick`` (``make bench-quick``) runs each at small size.
"""

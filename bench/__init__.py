"""Benchmarks: streamq against a real Apache Kafka broker, side by side in one run.

``python -m bench`` (``make bench``) runs every workload at full size;
``python -m bench --quick`` (``make bench-quick``) runs each at small size;
``python -m bench.charts`` redraws every chart from the stored results.

Each workload is a package, ``bench/<workload>/``: ``run`` drives it, ``streamq`` and
``kafka`` are each system's processes, ``common`` what they share (if anything).
``common`` and ``measure`` (the one pacer and latency recorder) serve every workload,
``kafka/`` is the broker and the Kafka clients' settings, ``tools/`` the diagnostics.
"""

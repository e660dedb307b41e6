"""Workload 5, spark: the ``streamq`` Spark source reading producers directly against Spark's
Kafka source (``run``; per source: ``streamq``, ``kafka``; what they share: ``common``)."""

"""Workload: Spark writing streams, streamq's sink against Spark's Kafka sink (``run``;
where the queries write: ``targets``; the consumers: ``consumers``; the fault: ``faults``)."""

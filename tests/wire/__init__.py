"""Tests of streamq/wire/: the blocking client, TLS and tokens, network faults through a proxy."""

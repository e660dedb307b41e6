"""Tests of streamq/protocol/: the sans-IO protocol, its spec, hostile input, a
deterministic simulation.
"""

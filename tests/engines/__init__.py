"""Tests of streamq/engines/: SQLite's checkpoints and WAL watch, and the PostgreSQL engine
against a real server.
"""

"""Tests of streamq/producer/: transactions, group commit, publishing, the log, retention,
compaction, the server.
"""

"""Tests of streamq/consumer/: applying exactly once, metrics, fan-in, poison records,
positions saved through the application's connection.
"""

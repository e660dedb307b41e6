"""Tests of bench/: each benchmark run small, its charts, and the real brokers it compares
against.
"""

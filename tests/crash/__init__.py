"""Crash tests: real processes killed with SIGKILL at chosen points (the programs they run
live here too).
"""

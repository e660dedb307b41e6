"""Tests of streamq/groups/: consumer groups, and their recipes with real worker processes."""

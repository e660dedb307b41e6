"""Packaging checks, run by ``make wheel`` (not by ``make test``): streamq built as its
users and CI build it."""

"""Packaging checks, run by ``make wheel`` (not by ``make test``): the wheel built here."""

"""The PostgreSQL engine, through psycopg 3 (``pip install streamq[postgres]``)."""

from .append import append, append_async, create_schema, describe

__all__ = ["append", "append_async", "create_schema", "describe"]

"""Moved to ``streamq/engines/sqlite/storage.py`` (the SQLite engine) and
``streamq/storage.py`` (the interface both engines implement)."""

from .engines.sqlite.storage import *  # noqa: F403
from .engines.sqlite.storage import connect, open_reader  # noqa: F401
from .storage import Durability as Durability

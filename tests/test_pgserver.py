"""The throwaway PostgreSQL server the PostgreSQL tests run against (``tests/pgserver.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest

from .pgserver import PostgresMissingError, PostgresServer, find_bindir


def test_the_server_runs_with_fsync_on_and_listens_on_loopback_only(
    postgres: PostgresServer, pg_url: str
) -> None:
    with psycopg.connect(pg_url) as conn:
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings "
                "WHERE name IN ('fsync', 'listen_addresses', 'port', 'server_version_num')"
            ).fetchall()
        )
        assert conn.execute("SELECT current_user, current_database()").fetchone() == (
            "streamq",
            pg_url.rsplit("/", 1)[1],
        )
    assert settings["fsync"] == "on"
    assert settings["listen_addresses"] == "127.0.0.1"
    assert int(settings["port"]) == postgres.port
    assert int(settings["server_version_num"]) >= 150000
    assert postgres.data.is_dir()
    if os.geteuid() == 0:  # PostgreSQL refuses root: the server runs as the postgres user
        assert postgres.data.stat().st_uid != 0


def test_each_test_has_its_own_database(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone()
        assert tables == (0,)  # nothing left by another test
        conn.execute("CREATE TABLE leftover (n integer)")


def test_and_the_next_one_another(pg_url: str) -> None:
    test_each_test_has_its_own_database(pg_url)


def test_missing_binaries_say_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STREAMQ_PG_BIN", str(tmp_path))
    with pytest.raises(PostgresMissingError, match="STREAMQ_PG_BIN"):
        find_bindir()
    monkeypatch.delenv("STREAMQ_PG_BIN")
    assert (find_bindir() / "initdb").exists()

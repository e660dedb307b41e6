"""The deployment recipes (tests/recipes/) run for real: gunicorn workers publishing through
their own connections (plain sqlite3 under Flask, Django's ORM), ``kill -9``ed mid-request,
a ``streamq serve`` sidecar, and a consumer that must apply every committed order once."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from .recipes import harness

ORDERS = 600


def run_recipe(
    tmp_path: Path,
    *,
    app: str,
    setup: Sequence[str],
    workers: int,
    kills: int,
    env: dict[str, str] | None = None,
    audit: str = "tests.recipes.audit",
    audit_setup: Sequence[str] = (),
) -> harness.Figures:
    """Deploy (log tables, the app's tables, sidecar, consumer, gunicorn), send ``ORDERS``
    orders while killing workers, and check the stream end to end."""
    orders_db, audit_db = tmp_path / "shop.db", tmp_path / "audit.db"
    harness.create_log_tables(orders_db)
    with harness.deployed(tmp_path, harness.recipe_env(orders_db, **(env or {}))) as processes:
        processes.run("setup", sys.executable, *setup)
        if audit_setup:
            processes.run(
                "audit-setup", sys.executable, *audit_setup, env={"ORDERS_DB": str(audit_db)}
            )
        address = harness.start_sidecar(processes, orders_db)
        harness.start_audit(processes, address, audit_db, audit)
        gunicorn = harness.Gunicorn(processes, app, workers, orders_db)
        load = harness.send_orders(gunicorn, ORDERS, threads=2 * workers, kills=kills, timeout=40)
        figures = harness.check_exactly_once(gunicorn, orders_db, audit_db, address, load)
        processes.assert_alive()  # the sidecar and the consumer never stopped
    return figures


@pytest.mark.timeout(120)
def test_flask_under_gunicorn_publishes_each_order_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    result = run_recipe(
        tmp_path,
        app="tests.recipes.flask_app:app",
        setup=["-m", "flask", "--app", "tests.recipes.flask_app", "init-db"],
        workers=4,
        kills=5,
    )
    figures(str(result))


@pytest.mark.timeout(120)
def test_django_orm_under_gunicorn_publishes_each_order_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    result = run_recipe(
        tmp_path,
        app="tests.recipes.django_shop.wsgi",
        setup=["-m", "django", "migrate", "--run-syncdb", "--verbosity", "0"],
        workers=3,
        kills=3,
        env={"DJANGO_SETTINGS_MODULE": "tests.recipes.django_shop.settings"},
        audit="tests.recipes.django_shop.audit",  # the consumer writes through the ORM too
        audit_setup=["-m", "django", "migrate", "--run-syncdb", "--verbosity", "0"],
    )
    figures(str(result))

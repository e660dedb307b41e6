"""The deployment recipes (tests/recipes/) run for real, deployed by following the steps of
docs/guides/services.md ("Deploying") in order: gunicorn workers publishing through their
own connections (plain sqlite3 under Flask, Django's ORM, SQLAlchemy's), ``kill -9``ed
mid-request, a ``streamq serve`` sidecar, and a consumer that must apply every committed
order once."""

from __future__ import annotations

import contextlib
import shlex
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from .recipes import harness

ORDERS = 600


def run_recipe(
    tmp_path: Path,
    recipe: str,
    *,
    kills: int,
    audit: str = "tests.recipes.audit",
    audit_setup: Sequence[str] = (),
    audit_env: dict[str, str] | None = None,
) -> harness.Figures:
    """Deploy ``recipe`` as the guide says (log tables, the app's tables, sidecar, gunicorn),
    start the consumer, send ``ORDERS`` orders while killing workers, and check the stream
    end to end."""
    orders_db, audit_db = tmp_path / "shop.db", tmp_path / "audit.db"
    with harness.deployed(tmp_path, harness.recipe_env()) as processes:
        address, gunicorn = harness.deploy_as_documented(processes, recipe, orders_db)
        if audit_setup:
            env = {**(audit_env or {}), "ORDERS_DB": str(audit_db)}
            processes.run("audit-setup", sys.executable, *audit_setup, env=env)
        harness.start_audit(processes, address, audit_db, audit)
        load = harness.send_orders(
            gunicorn, ORDERS, threads=2 * gunicorn.workers, kills=kills, timeout=40
        )
        figures = harness.check_exactly_once(gunicorn, orders_db, audit_db, address, load)
        processes.assert_alive()  # the sidecar and the consumer never stopped
    return figures


def test_guide_has_every_recipes_steps() -> None:
    """Each recipe's steps, in the guide's order: the log tables, the app's own tables
    (without them the first request fails with "no such table: orders"), the sidecar, the
    workers."""
    for recipe, tables in [
        ("Flask", "init-db"),
        ("Django", "migrate"),
        ("SQLAlchemy", "init-db"),
    ]:
        steps = [shlex.join(step) for step in harness.documented_steps(recipe)]
        kinds = ["streamq init", tables, "streamq serve", "gunicorn"]
        found = [next((kind for kind in kinds if kind in step), step) for step in steps]
        assert found == kinds, f"{recipe}'s steps in the guide: {steps}"


@pytest.mark.timeout(120)
def test_flask_under_gunicorn_publishes_each_order_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    figures(str(run_recipe(tmp_path, "Flask", kills=5)))


@pytest.mark.timeout(120)
def test_django_orm_under_gunicorn_publishes_each_order_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    result = run_recipe(
        tmp_path,
        "Django",
        kills=3,
        audit="tests.recipes.django_shop.audit",  # the consumer writes through the ORM too
        audit_setup=["-m", "django", "migrate", "--run-syncdb", "--verbosity", "0"],
        audit_env={"DJANGO_SETTINGS_MODULE": "tests.recipes.django_shop.settings"},
    )
    figures(str(result))


@pytest.mark.timeout(120)
def test_sqlalchemy_under_gunicorn_loses_no_increment(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    """Every order adds one to one customer's count through the ORM (``cust.orders += 1``),
    in the workers' concurrent transactions: with the guide's ``BEGIN IMMEDIATE`` hooks the
    count is the number of orders committed. (Without them, a run counted 397 of 600.)"""
    result = run_recipe(tmp_path, "SQLAlchemy", kills=3)
    with contextlib.closing(sqlite3.connect(tmp_path / "shop.db", timeout=20)) as conn:
        [(count,)] = conn.execute("SELECT orders FROM customers").fetchall()
    assert (count, result.committed) == (ORDERS, ORDERS), "increments lost (or made twice)"
    figures(f"{result}; the customer's count: {count}")

"""The deployment recipes (tests/recipes/) run for real, deployed by following the steps of
docs/guides/services.md ("Deploying") in order: gunicorn workers publishing through their
own connections (plain sqlite3 under Flask, Django's ORM, SQLAlchemy's), ``kill -9``ed
mid-request, a ``streamq serve`` sidecar, and a consumer that must apply every committed
order once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import shlex
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from .pgserver import PostgresServer
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


FASTAPI_ORDERS = 400
CONSUMER_KILLS = 4


@pytest.mark.timeout(180)
def test_fastapi_on_postgresql_bills_each_order_once(
    postgres: PostgresServer,
    tmp_path: Path,
    figures: Callable[[str], None],
    reserve_port: Callable[[], int],
) -> None:
    """The guide's FastAPI steps run as written (free ports, throwaway databases): uvicorn
    with 2 workers publishing through asyncpg, the sidecar, the consumer ``kill -9``ed
    ``CONSUMER_KILLS`` times while orders arrive from concurrent clients, each started
    again by its documented line. Every order committed is billed once, none twice; a
    retry of a committed order is 409 and publishes nothing."""
    n = next(_FASTAPI_RUNS)
    shop, billing = (postgres.create_database(f"{name}_{n}") for name in ("shop", "billing"))
    sidecar, web = reserve_port(), reserve_port()
    env = {**harness.recipe_env(), "DATABASE_URL": shop, "BILLING_URL": billing}
    # The guide's shell, in this virtual environment as if activated: python, streamq, uvicorn.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    steps = [
        line.replace("--port 7400", f"--port {sidecar}")
        .replace("127.0.0.1:7400", f"127.0.0.1:{sidecar}")
        .replace("--port 8000", f"--port {web}")
        for line in harness.guide_lines("FastAPI")
    ]
    assert [step.split()[0] for step in steps] == [
        "streamq",
        "python",
        "streamq",
        "uvicorn",
        "python",
    ]
    with harness.deployed(tmp_path, env) as processes:
        for i, line in enumerate(steps[:2]):
            processes.run(f"step{i + 1}", "bash", "-c", line)
        served = processes.start("sidecar", "bash", "-c", f"exec {steps[2]}")
        served.wait_for_line(r"serving producer", 30)
        uvicorn = processes.start("uvicorn", "bash", "-c", f"exec {steps[3]}")
        uvicorn.wait_for_line(
            r"Application startup complete[\s\S]*Application startup complete", 30
        )
        consumer = processes.start("billing", "bash", "-c", f"exec {steps[4]}")

        outcomes: dict[int, int] = {}
        lock = threading.Condition()

        def post(order_id: int) -> None:
            answer = httpx.post(
                f"http://127.0.0.1:{web}/orders",
                json={"id": order_id, "cents": order_id},
                timeout=30,
            )
            assert answer.status_code == 201, answer.text
            assert answer.json()["receipt"]["xid"] > 0
            with lock:
                outcomes[order_id] = answer.status_code
                lock.notify_all()

        def clients() -> None:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(post, range(1, FASTAPI_ORDERS + 1)))

        sending = threading.Thread(target=clients)
        sending.start()
        kills = 0
        for k in range(1, CONSUMER_KILLS + 1):  # spread over the run, by billed progress
            harness.wait_until(
                lambda k=k: billed_count(billing) >= k * FASTAPI_ORDERS // (CONSUMER_KILLS + 2),
                60,
                f"{k * FASTAPI_ORDERS // (CONSUMER_KILLS + 2)} orders billed",
            )
            processes.kill(consumer)
            kills += 1
            consumer = processes.start(f"billing{k}", "bash", "-c", f"exec {steps[4]}")
        sending.join(120)
        assert not sending.is_alive() and len(outcomes) == FASTAPI_ORDERS
        retry = httpx.post(f"http://127.0.0.1:{web}/orders", json={"id": 1, "cents": 1}, timeout=30)
        assert retry.status_code == 409
        harness.wait_until(
            lambda: billed_count(billing) >= FASTAPI_ORDERS, 60, "every order billed"
        )
        processes.assert_alive()
    with psycopg.connect(billing) as conn:
        billed = [order for (order,) in conn.execute("SELECT order_id FROM billed").fetchall()]
    with psycopg.connect(shop) as conn:
        (committed,) = conn.execute("SELECT count(*) FROM orders").fetchone() or (0,)
    assert committed == FASTAPI_ORDERS
    assert sorted(billed) == list(range(1, FASTAPI_ORDERS + 1)), "an order lost or billed twice"
    figures(
        f"FastAPI: {FASTAPI_ORDERS} orders through uvicorn --workers 2 on asyncpg, the consumer "
        f"killed {kills} times: {committed} committed, {len(billed)} billed, each once"
    )


_FASTAPI_RUNS = itertools.count(1)


def billed_count(url: str) -> int:
    """Orders the consumer has billed (0 before its table is there)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM billed").fetchone() if _has_billed(conn) else None
    return int(row[0]) if row else 0


def _has_billed(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('billed') IS NOT NULL").fetchone()
    return bool(row and row[0])

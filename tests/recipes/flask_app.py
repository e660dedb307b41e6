"""Recipe: Flask under gunicorn, each request publishing in its own sqlite3 transaction.

    streamq init shop.db --stream orders                           # the log tables
    ORDERS_DB=shop.db flask --app tests.recipes.flask_app init-db   # the orders table
    streamq serve shop.db --port 7400                # the sidecar: the one serving process
    ORDERS_DB=shop.db gunicorn --workers 4 --bind 127.0.0.1:8000 tests.recipes.flask_app:app

Every worker process writes to the database through its own connection; the order row
and its record commit together, so a worker killed anywhere in between leaves neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3

from flask import Flask, g, request

import streamq

DATABASE = os.environ["ORDERS_DB"]
SCHEMA = "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)"

app = Flask(__name__)


def db() -> sqlite3.Connection:
    """This request's connection (Flask's own SQLite pattern; one per request is cheap).

    ``isolation_level=None``: the handler says ``BEGIN IMMEDIATE`` itself, so the write lock
    is taken before anything is read, and ``timeout`` waits for the other workers' commits
    instead of failing with "database is locked".
    """
    if "db" not in g:
        g.db = sqlite3.connect(DATABASE, timeout=20, isolation_level=None)
    conn: sqlite3.Connection = g.db
    return conn


@app.teardown_appcontext
def close_db(exc: BaseException | None) -> None:
    conn = g.pop("db", None)
    if conn is not None:
        conn.close()  # an open transaction (the handler raised) is rolled back


@app.post("/orders")
def create_order() -> tuple[dict[str, object], int]:
    order = request.get_json()
    order_id, item = int(order["id"]), str(order["item"])
    conn = db()
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("INSERT INTO orders (id, item) VALUES (?, ?)", (order_id, item))
        value = json.dumps({"id": order_id, "item": item}).encode()
        seq = streamq.publish(conn, "orders", value, key=str(order_id).encode())
        conn.execute("COMMIT")
    except sqlite3.IntegrityError:
        conn.execute("ROLLBACK")
        return {"id": order_id, "error": "exists"}, 409  # a retry of a committed order
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return {"id": order_id, "seq": seq}, 201


@app.cli.command("init-db")
def init_db() -> None:
    """Create the orders table (streamq's log tables are made by ``streamq init`` or a
    ``Producer`` started once)."""
    with contextlib.closing(sqlite3.connect(DATABASE)) as conn, conn:
        conn.execute(SCHEMA)


@app.get("/health")
def health() -> str:
    return "ok"

"""Recipe: SQLAlchemy's ORM under gunicorn (Flask for the HTTP), each request's session
publishing in its own transaction, which begins with ``BEGIN IMMEDIATE``.

    streamq init shop.db --stream orders                                # the log tables
    ORDERS_DB=shop.db flask --app tests.recipes.sqlalchemy_app init-db  # orders, customers
    streamq serve shop.db --port 7400                # the sidecar: the one serving process
    ORDERS_DB=shop.db gunicorn --workers 3 --bind 127.0.0.1:8000 tests.recipes.sqlalchemy_app:app

Each order also adds one to its customer's count (read, then written back: ``cust.orders
+= 1``). sqlite3 under SQLAlchemy says BEGIN only before the first INSERT/UPDATE/DELETE,
so that read would run outside the transaction and two workers would both write back the
same count, one increment lost. The two event hooks below make every transaction begin
with ``BEGIN IMMEDIATE``: the write lock before the read.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

from flask import Flask, request
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import streamq

CUSTOMER = 1  # every order is this customer's: one row that every request updates

engine = create_engine(f"sqlite:///{os.environ['ORDERS_DB']}", connect_args={"timeout": 20})


@event.listens_for(engine, "connect")
def no_implicit_begin(dbapi_connection: sqlite3.Connection, connection_record: Any) -> None:
    """sqlite3 sends no BEGIN of its own (it would, late: before the first write)..."""
    dbapi_connection.isolation_level = None


@event.listens_for(engine, "begin")
def begin_immediate(conn: Connection) -> None:
    """... SQLAlchemy sends this one as it begins: the write lock before anything is read,
    and ``timeout`` waits for the other workers' commits."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)  # chosen by the client: a retry is a 409
    item: Mapped[str]


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(primary_key=True)
    orders: Mapped[int]


app = Flask(__name__)


@app.post("/orders")
def create_order() -> tuple[dict[str, object], int]:
    order = request.get_json()
    order_id, item = int(order["id"]), str(order["item"])
    try:
        with Session(engine) as session, session.begin():  # BEGIN IMMEDIATE
            cust = session.get_one(Customer, CUSTOMER)  # read under the write lock
            cust.orders += 1
            session.add(Order(id=order_id, item=item))
            session.flush()  # a retry's IntegrityError here, before the publish
            value = json.dumps({"id": order_id, "item": item}).encode()
            seq = streamq.publish(session, "orders", value, key=str(order_id).encode())
    except IntegrityError:
        return {"id": order_id, "error": "exists"}, 409  # a retry of a committed order
    return {"id": order_id, "seq": seq}, 201


@app.cli.command("init-db")
def init_db() -> None:
    """Create the orders and customers tables and the customer (streamq's log tables are
    made by ``streamq init`` or a ``Producer`` started once)."""
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        if session.get(Customer, CUSTOMER) is None:
            session.add(Customer(id=CUSTOMER, orders=0))


@app.get("/health")
def health() -> str:
    return "ok"

"""Every operations view tells the truth: after a consumer and a group member are killed,
the producer and the consumers restarted, the group reshared 4 → 8 and a minute idle,
each figure of ``streamq status``, ``streamq groups``, the producer's metrics and the
console equals what the consumers' databases hold, and each lag the records the
producer's log still owes that consumer (a share: its keys' records only).

Every process is real (the producer, a consumer, two group members, the console), each
killed with SIGKILL where the scenario says so."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

import streamq
from bench.common import reserved_port
from streamq.filters import split_share_name
from streamq.wire.client import Client
from tests.recipes import harness
from tests.recipes.harness import Process, Processes, wait_until

STREAMQ = (sys.executable, "-m", "streamq")
KEYS = [b"account-%d" % n for n in range(40)]
IDLE_SECONDS = 60  # the idle minute: no record, no restart


class Deployment:
    """The producer, the consumer ``billing``, the group ``ledger`` and the console."""

    def __init__(self, processes: Processes, directory: Path, port: int) -> None:
        self.processes = processes
        self.shop = directory / "shop.db"
        self.billing_db, self.ledger_db = directory / "billing.db", directory / "ledger.db"
        self.fixed = directory / "fixed"
        self.fixed.touch()  # billing applies everything
        with sqlite3.connect(self.ledger_db) as conn:
            conn.execute("CREATE TABLE credits (seq INTEGER PRIMARY KEY, key BLOB, pid INTEGER)")
        self.address = f"127.0.0.1:{port}"
        processes.run("init", *STREAMQ, "init", str(self.shop), "--stream", "orders")
        self.producer = self.serve()
        self.billing = self.start_billing()
        self.members = [self.start_member(i) for i in range(2)]
        console = processes.start(
            "console", *STREAMQ, "console", self.address, str(self.billing_db),
            str(self.ledger_db), "--port", "0", "--interval", "0.3",
        )  # fmt: skip
        self.console = console.wait_for_line(r"console: (http://\S+/)", 30)[1]

    def serve(self) -> Process:
        port = self.address.rsplit(":", 1)[1]
        served = self.processes.start(
            "producer", *STREAMQ, "serve", str(self.shop), "--port", port, "--metrics-port", "0"
        )
        self.metrics = served.wait_for_line(r"metrics: (http://\S+/metrics)", 30)[1]
        return served

    def start_billing(self) -> Process:
        billing = self.processes.start(
            "billing", sys.executable, "-m", "tests.console.billing", self.address,
            str(self.billing_db), str(self.fixed),
        )  # fmt: skip
        billing.wait_for_line("consuming", 30)
        return billing

    def start_member(self, i: int) -> Process:
        member = self.processes.start(
            f"ledger{i}", sys.executable, "-m", "tests.group_worker", self.address,
            str(self.ledger_db), "--shares", "4", "--name", "ledger",
        )  # fmt: skip
        member.wait_for_line("JOINED", 30)
        return member

    def publish(self, count: int) -> None:
        """``count`` records, keyed across ``KEYS``, from another connection (the
        application's), in transactions of 10."""
        with closing(sqlite3.connect(self.shop, isolation_level=None)) as conn:
            for start in range(0, count, 10):
                conn.execute("BEGIN IMMEDIATE")
                for n in range(start, min(start + 10, count)):
                    streamq.publish(conn, "orders", b"%d" % n, key=KEYS[n % len(KEYS)])
                conn.execute("COMMIT")

    def applied(self, db: Path) -> int:
        with closing(sqlite3.connect(db)) as conn:
            return int(conn.execute("SELECT count(*) FROM credits").fetchone()[0])

    def caught_up(self, head: int, *, billing: bool = True) -> None:
        wait_until(lambda: self.applied(self.ledger_db) == head, 60, f"ledger at {head}")
        if billing:
            wait_until(lambda: self.applied(self.billing_db) == head, 60, f"billing at {head}")

    # --- the truth, and each view of it ---------------------------------------------

    def stored(self) -> dict[str, int]:
        """Each consumer's position on ``orders``, as its own database holds it."""
        found = {}
        for db in (self.billing_db, self.ledger_db):
            with closing(sqlite3.connect(db)) as conn:
                rows = conn.execute(
                    "SELECT consumer, seq FROM streamq_positions WHERE stream = 'orders'"
                ).fetchall()
            found.update((str(name), int(seq)) for name, seq in rows)
        return found

    def owed(self, positions: dict[str, int]) -> dict[str, int]:
        """What each consumer still owes: the log's records after its position (a share:
        those of its keys)."""
        with Client(self.address) as client:
            head = client.head("orders").head
            keys = [(r.seq, r.key) for batch in client.read_range("orders", 1, head + 1)
                    for r in batch]  # fmt: skip
        owed = {}
        for name, applied in positions.items():
            split = split_share_name(name)
            owed[name] = sum(
                1
                for seq, key in keys
                if seq > applied
                and (split is None or streamq.share_of(key, split[1][1]) == split[1][0])
            )
        return owed

    def mismatches(self) -> list[str]:
        """Every figure of every view that differs from the truth (empty: all agree)."""
        stored = self.stored()
        owed = self.owed(stored)
        wrong: list[str] = []

        def check(view: str, figures: dict[str, tuple[int | None, int | None, bool]]) -> None:
            """Exact figures equal the truth; the others (a consumer not connected: as of
            its last report) bound it: applied at most, lag at least."""
            if set(figures) != set(stored):
                wrong.append(f"{view}: consumers {sorted(figures)} != {sorted(stored)}")
            for name, (applied, lag, exact) in figures.items():
                if name not in stored:
                    continue
                truth = stored[name], owed[name]
                if exact or applied is None or lag is None:
                    true = (applied, lag) == truth
                else:
                    true = applied <= truth[0] and lag >= truth[1]
                if not true:
                    wrong.append(
                        f"{view}: {name} applied {applied} lag {lag} (exact: {exact}), "
                        f"truth {truth[0]} / {truth[1]}"
                    )

        with Client(self.address) as client:
            status = client.status()
        check(
            "status",
            {p["consumer"]: (p["applied"], p["lag"], p["exact"]) for p in status["positions"]},
        )
        listed = subprocess.run(
            [*STREAMQ, "groups", str(self.ledger_db), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        (group,) = [json.loads(line) for line in listed.stdout.splitlines()]
        ledger = {n: a for n, a in stored.items() if n.startswith("ledger[")}
        check_group = {
            f"ledger[{p['share']}/{group['shares']}]": (
                p["applied"],
                p["behind"] if p["exact"] else None,
            )
            for p in group["positions"]
        }
        shares = {n: stored[n] for n in ledger}
        if set(check_group) != set(shares):
            wrong.append(f"groups: shares {sorted(check_group)} != {sorted(shares)}")
        for name, figures in check_group.items():
            if name in shares and figures != (stored[name], owed[name]):
                wrong.append(f"groups: {name} {figures}, truth {stored[name]} / {owed[name]}")
        metrics = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        scraped = {
            (m[0], m[1]): int(float(m[2]))
            for m in re.findall(
                r"^streamq_consumer_(applied|lag|lag_exact)"
                r'\{consumer="([^"]+)",stream="orders"\} (\S+)$',
                metrics,
                re.MULTILINE,
            )
        }
        check(
            "metrics",
            {n: (scraped.get(("applied", n)), scraped.get(("lag", n)),
                 scraped.get(("lag_exact", n)) == 1)
             for kind, n in scraped},
        )  # fmt: skip
        group_lag = re.search(
            r'^streamq_group_lag\{group="ledger",stream="orders"\} (\S+)$', metrics, re.MULTILINE
        )
        truth = sum(owed[n] for n in ledger)
        if group_lag is None or int(float(group_lag[1])) != truth:
            wrong.append(f"metrics: streamq_group_lag {group_lag and group_lag[1]}, truth {truth}")
        state = httpx.get(f"{self.console}api/state", timeout=10).json()
        (producer,) = state["producers"]
        check(
            "console",
            {c["consumer"]: (c["applied"], c["lag"], c["exact"]) for c in producer["consumers"]},
        )
        (console_group,) = state["groups"]
        for p in console_group["positions"]:
            name = f"ledger[{p['share']}/{console_group['shares']}]"
            if (p["applied"], p["behind"]) != (stored.get(name), owed.get(name)):
                wrong.append(f"console group: {name} {p['applied']}/{p['behind']}")
        return wrong

    def agree(self, what: str) -> None:
        """Every view equals the truth within 10 s (positions saved through an
        application's connection reach the producer within 0.5 s), and still does."""
        wait_until(lambda: not self.mismatches(), 10, f"every view true {what}")
        assert self.mismatches() == [], what


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    with reserved_port() as port, harness.deployed(tmp_path, harness.recipe_env()) as processes:
        yield Deployment(processes, tmp_path, port)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_status_groups_metrics_and_console_equal_the_consumers_databases(
    deployment: Deployment,
) -> None:
    d = deployment
    d.publish(200)
    d.caught_up(200)
    d.agree("after 200 records applied")

    # A consumer and a group member killed: billing's lag grows, the group goes on.
    d.processes.kill(d.billing)
    d.processes.kill(d.members[0])
    d.publish(100)
    d.caught_up(300, billing=False)
    assert d.applied(d.billing_db) == 200
    d.agree("with billing and a member killed")
    assert d.owed(d.stored())["billing"] == 100

    # Each side restarted: the producer (kill -9, on the same port), then the consumers.
    d.processes.kill(d.producer)
    d.producer = d.serve()
    d.billing = d.start_billing()
    d.members[0] = d.start_member(0)
    d.caught_up(300)
    d.agree("after the restarts")

    # The group reshared 4 -> 8 while its members run.
    reshared = subprocess.run(
        [*STREAMQ, "reshare", str(d.ledger_db), "ledger", "--shares", "8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert reshared.returncode == 0, reshared.stderr
    d.publish(100)
    d.caught_up(400)
    wait_until(lambda: len([n for n in d.stored() if n.startswith("ledger[")]) == 8, 30, "8")
    d.agree("after the reshare to 8")

    # Billing killed again, then a minute with nothing published or restarted.
    d.processes.kill(d.billing)
    d.publish(50)
    d.caught_up(450, billing=False)
    d.agree("billing killed again")
    time.sleep(IDLE_SECONDS)  # the scenario's idle minute itself, not a wait for a state
    d.agree("after an idle minute")
    assert d.owed(d.stored())["billing"] == 50


def test_a_consumer_killed_between_its_commit_and_its_report_is_shown_as_of_that_report(
    tmp_path: Path, reserve_port: Callable[[], int]
) -> None:
    """Billing reports its first commit only (one ACK an hour), commits five records more
    and is killed: the producer cannot know those commits. ``streamq status``, ``streamq
    consumers list``, the producer's metrics and the console show its figures as of its
    last report, saying so: not connected, the lag an upper bound, the report's time."""
    shop, billing_db, fixed = tmp_path / "shop.db", tmp_path / "billing.db", tmp_path / "fixed"
    address = f"127.0.0.1:{reserve_port()}"
    with harness.deployed(tmp_path, harness.recipe_env()) as processes:
        processes.run("init", *STREAMQ, "init", str(shop), "--stream", "orders")
        served = processes.start(
            "producer", *STREAMQ, "serve", str(shop), "--port", address.rsplit(":", 1)[1],
            "--metrics-port", "0",
        )  # fmt: skip
        metrics = served.wait_for_line(r"metrics: (http://\S+/metrics)", 30)[1]
        billing = processes.start(
            "billing", sys.executable, "-m", "tests.console.billing", address, str(billing_db),
            str(fixed), "--ack-interval", "3600",
        )  # fmt: skip
        billing.wait_for_line("consuming", 30)
        console = processes.start(
            "console", *STREAMQ, "console", address, "--port", "0", "--interval", "0.3"
        )
        url = console.wait_for_line(r"console: (http://\S+/)", 30)[1]

        def status() -> dict[str, Any]:
            with Client(address) as client:
                return client.status()

        def stored() -> int:
            with closing(sqlite3.connect(billing_db)) as conn:
                row = conn.execute("SELECT seq FROM streamq_positions").fetchone()
            return 0 if row is None else int(row[0])

        processes.run("publish", *STREAMQ, "publish", str(shop), "orders", "1")
        wait_until(lambda: [p["applied"] for p in status()["positions"]] == [1], 30, "a report")
        processes.run("publish", *STREAMQ, "publish", str(shop), "orders", *"23456")
        wait_until(lambda: stored() == 6, 30, "billing's commits")
        processes.kill(billing)
        wait_until(lambda: not status()["consumers"], 30, "billing's connection closed")

        (position,) = json.loads(cli("status", address, "--json"))["positions"]
        wait_until(lambda: cli("consumers", "list", str(shop), "--json"), 30, "a saved report")
        (listed,) = map(json.loads, cli("consumers", "list", str(shop), "--json").splitlines())
        scraped = urllib.request.urlopen(metrics, timeout=10).read().decode()
        wait_until(lambda: httpx.get(f"{url}api/state").json()["producers"], 30, "a poll")
        state = httpx.get(f"{url}api/state", timeout=10).json()
        (row,) = state["producers"][0]["consumers"]

    assert stored() == 6  # the truth: billing applied everything, owes nothing
    for view in (position, listed, row):
        assert (view["applied"], view["lag"]) == (1, 5), view  # its last report's figures
        assert view["exact"] is False and view["connected"] is False, view
    assert position["updated_at"] > 0 and row["updated_at"] == position["updated_at"]
    assert listed["updated_at"] == pytest.approx(position["updated_at"] / 1000, abs=0.01)
    labels = '{consumer="billing",stream="orders"}'
    for line in ("lag 5.0", "lag_exact 0.0", "connected 0.0", "applied 1.0"):
        name, value = line.split()
        assert f"streamq_consumer_{name}{labels} {value}" in scraped


def cli(*args: str) -> str:
    """``streamq ARGS``'s output; it must succeed."""
    done = subprocess.run([*STREAMQ, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout

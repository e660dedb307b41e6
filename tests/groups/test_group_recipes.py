"""The consumer group's deployment recipes (tests/recipes/billing.py, billing_app.py) run for
real, deployed by following docs/guides/groups.md ("Deploying a group") in order: worker
processes under supervisord, and gunicorn workers that are members too. A producer
publishes steadily through a ``streamq serve`` sidecar while workers are ``kill -9``ed
(inside a transaction on the group's database, when one is found) and restarted by their
master, and the fleet is scaled down and up; then every record must have been applied
exactly once, and each key's records in seq order."""

from __future__ import annotations

import random
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ..recipes import harness
from ..recipes.group_harness import (
    Deployment,
    Fleet,
    Publisher,
    check_exactly_once,
    documented,
    health,
    holdings,
    steps,
    wait_applied,
)

# 20 transactions of 10 records a second, from before the first kill until the last event
# is over (RECORDS at most: 40 s), BETWEEN more records between one event and the next.
RECORDS, BETWEEN = 8000, 200


def test_guide_has_every_group_recipes_steps() -> None:
    """Each recipe's steps, in the guide's order: the log tables, the sidecar, the fleet,
    then the ways to scale it."""
    for recipe, kinds in [
        (
            "supervisord",
            ["streamq init", "streamq serve", "supervisord", "stop", "start", "update"],
        ),
        ("gunicorn", ["streamq init", "streamq serve", "gunicorn", "-TTIN", "-TTOU"]),
    ]:
        found = [shlex.join(step) for step in steps(recipe)]
        assert len(found) == len(kinds), f"{recipe}'s steps in the guide: {found}"
        assert all(kind in step for kind, step in zip(kinds, found, strict=True)), found


def _deploy(deploy: Deployment, recipe: str) -> list[list[str]]:
    """The guide's first steps for ``recipe``: the log tables, and the sidecar (its
    address known from then on). The rest, to run as the test goes."""
    commands = steps(recipe)
    deploy.run(commands[0])  # streamq init
    deploy.start(commands[1])  # streamq serve
    return commands[2:]


@pytest.mark.timeout(120)
def test_supervisord_workers_apply_each_record_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    rng = random.Random(11)
    with harness.deployed(tmp_path, harness.recipe_env()) as processes:
        deploy = Deployment(processes, tmp_path)
        start_fleet, *scaling = _deploy(deploy, "supervisord")
        workers = deploy.write_conf()
        fleet = Fleet(deploy.start(start_fleet), deploy.path("billing.db"), workers)
        publisher = Publisher(deploy.path("shop.db"), RECORDS)
        try:
            fleet.settle(workers, "supervisord started")
            publisher.start()
            publisher.more(BETWEEN)
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            deploy.run(documented(scaling, "stop"))
            fleet.settle(workers - 1, "a worker stopped")
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            deploy.run(documented(scaling, "start"))
            fleet.settle(workers, "the worker started again")
            publisher.more(BETWEEN)
            scaled = deploy.write_conf(numprocs=workers + 1)
            deploy.run(documented(scaling, "update"))  # every worker restarts: 5 of them
            fleet.settle(scaled, f"numprocs {scaled}")
            publisher.more(BETWEEN)
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            publisher.stop()
            wait_applied(fleet, deploy.address, publisher.expected)
            processes.assert_alive()  # the sidecar and supervisord never stopped
            fleet.stop()  # each worker leaves the group as supervisord stops it
        finally:
            publisher.close()
            fleet.close()
        result = check_exactly_once(fleet, publisher.expected)
    assert result.appliers > workers, f"records applied only by the first {workers} workers"
    figures(str(result))


def _health_agrees(fleet: Fleet, port: int) -> None:
    """GET /health a few times: each answer is a worker's, and shows the shares the group's
    rows give its member (a take is written a moment before the member holds it: asked
    again until they agree, for up to 5 s)."""
    agreed = 0
    deadline = time.monotonic() + 5
    while agreed < 5:
        status, answer = health(port)
        assert status == 200, answer
        assert answer["pid"] in fleet.worker_pids(), answer
        held = holdings(fleet.db)
        if answer["held"] == held.get(answer["member"]):
            agreed += 1
        else:
            assert time.monotonic() < deadline, f"/health says {answer}, the lease rows {held}"


@pytest.mark.timeout(120)
def test_gunicorn_workers_as_members_apply_each_record_once(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    rng = random.Random(12)
    with harness.deployed(tmp_path, harness.recipe_env()) as processes:
        deploy = Deployment(processes, tmp_path)
        start_fleet, *scaling = _deploy(deploy, "gunicorn")
        workers = int(start_fleet[start_fleet.index("--workers") + 1])
        master = deploy.start(start_fleet)
        port = int(master.wait_for_line(r"Listening at: http://127\.0\.0\.1:(\d+)", 20).group(1))
        fleet = Fleet(master, deploy.path("billing.db"), workers)
        more, fewer = documented(scaling, "-TTIN"), documented(scaling, "-TTOU")
        publisher = Publisher(deploy.path("shop.db"), RECORDS)
        try:
            fleet.settle(workers, "gunicorn started")
            _health_agrees(fleet, port)
            publisher.start()
            publisher.more(BETWEEN)
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            deploy.run(more)
            fleet.settle(workers + 1, "TTIN")
            _health_agrees(fleet, port)
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            deploy.run(fewer)
            fleet.settle(workers, "TTOU")
            fleet.kill_worker(rng, in_transaction=False)
            publisher.more(BETWEEN)
            deploy.run(fewer)
            fleet.settle(workers - 1, "TTOU again")
            publisher.more(BETWEEN)
            fleet.kill_worker(rng, in_transaction=True)
            publisher.more(BETWEEN)
            publisher.stop()
            wait_applied(fleet, deploy.address, publisher.expected)
            _health_agrees(fleet, port)
            processes.assert_alive()  # the sidecar and the master never stopped
            fleet.stop()  # each worker's worker_exit closes its member
        finally:
            publisher.close()
            fleet.close()
        result = check_exactly_once(fleet, publisher.expected)
    assert result.appliers > workers, f"records applied only by the first {workers} workers"
    figures(str(result))

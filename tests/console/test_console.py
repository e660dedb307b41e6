"""``streamq console`` for real: a producer and a consumer in their own processes, the
console in its own, the page in Debian's Chromium (Playwright) and the API through httpx.

Screenshots: with ``STREAMQ_CONSOLE_SCREENSHOTS=DIR`` (``make docs-console``), the
browser test saves the page as it goes into DIR (docs/guides/operations.md shows them).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

import streamq
from streamq.wire.security import make_token
from tests.browser import chromium
from tests.certs import make_certs
from tests.recipes import harness
from tests.recipes.harness import Processes, wait_until

SECRET = b"console-test-secret-0123456789"
STREAMQ = (sys.executable, "-m", "streamq")
SCREENSHOTS = os.environ.get("STREAMQ_CONSOLE_SCREENSHOTS")


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    with harness.deployed(tmp_path, harness.recipe_env()) as started:
        yield started


def paths(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The producer's database, billing's, and the file whose presence is billing's fix."""
    return tmp_path / "shop.db", tmp_path / "billing.db", tmp_path / "fixed"


def serve(processes: Processes, db: Path, *options: str) -> str:
    """A producer serving ``db`` (created) on a free port: its address."""
    served = processes.start(
        "producer", *STREAMQ, "serve", "--init", str(db), "--port", "0", *options
    )
    return served.wait_for_line(r"serving producer \S+ \(epoch \d+\) on (\S+)", 30)[1]


def console(
    processes: Processes, *targets: str, name: str = "console", secret: Path | None = None
) -> str:
    """``streamq console`` on a free port: its URL."""
    options = ["--port", "0", "--interval", "0.3"]
    if secret is not None:
        options += ["--token-secret-file", str(secret), "--admin", "ops"]
    started = processes.start(name, *STREAMQ, "console", *targets, *options)
    return started.wait_for_line(r"console: (http://\S+/)", 30)[1]


def publish(db: Path, *values: str) -> None:
    subprocess.run(
        [*STREAMQ, "publish", str(db), "orders", *values], check=True, capture_output=True
    )


def credits(db: Path) -> dict[int, str]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT seq, value FROM credits"))


def start_billing(processes: Processes, address: str, db: Path, fixed: Path) -> harness.Process:
    billing = processes.start(
        "billing", sys.executable, "-m", "tests.console.billing", address, str(db), str(fixed)
    )
    billing.wait_for_line("consuming", 30)
    return billing


def shoot(page: object, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / name), full_page=True)  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
def test_the_page_shows_streams_the_tail_a_killed_consumers_lag_and_retries_a_dead_letter(
    tmp_path: Path, processes: Processes
) -> None:
    producer_db, billing_db, fixed = paths(tmp_path)
    address = serve(processes, producer_db, "--retention-ms", str(3 * 86_400_000))
    publish(producer_db, "100", "250")
    billing = start_billing(processes, address, billing_db, fixed)
    wait_until(lambda: len(credits(billing_db)) == 2, 30, "the first records applied")
    ledger_db = tmp_path / "ledger.db"
    with sqlite3.connect(ledger_db) as conn:
        conn.execute("CREATE TABLE credits (seq INTEGER PRIMARY KEY, key BLOB, pid INTEGER)")
    members = []
    for i in range(2):  # a group of two members over 4 shares
        member = processes.start(
            f"ledger{i}", sys.executable, "-m", "tests.group_worker", address, str(ledger_db),
            "--shares", "4", "--name", "ledger", "--lease-timeout", "3",
        )  # fmt: skip
        member.wait_for_line("JOINED", 30)
        members.append(member)
    (tmp_path / "secret").write_bytes(SECRET)
    url = console(processes, address, str(billing_db), str(ledger_db), secret=tmp_path / "secret")

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url)

        # The producer's streams, with head and retention.
        stream = page.locator('#producers tr[data-stream="orders"]')
        stream.wait_for()
        assert stream.locator("td.head").inner_text() == "2"
        assert "3 d" in stream.inner_text()

        # The group: its members, each share's holder, position and lag.
        group = page.locator('#groups .group[data-group="ledger"]')
        group.wait_for()
        page.wait_for_function(
            """() => [...document.querySelectorAll('#groups tr[data-share] td.lag')]
                 .map((cell) => cell.innerText).join() === '0,0,0,0'""",
            timeout=30_000,
        )
        assert "2 of 2 member(s) alive" in group.inner_text()
        pids = group.locator("tr[data-member] td.pid").all_inner_texts()
        assert sorted(map(int, pids)) == sorted(member.pid for member in members)

        # A record published shows up in the tail.
        page.select_option("#tail-stream", label=f"orders at {address}")
        page.locator('#tail tr[data-seq="2"]').wait_for()
        publish(producer_db, "4242")
        page.locator('#tail tr[data-seq="3"]').wait_for()
        assert "4242" in page.locator('#tail tr[data-seq="3"]').inner_text()

        # A consumer killed: its lag grows on the page, and it is what its database lacks,
        # at most: its figures are as of its last report, and the page says so.
        row = page.locator(f'#consumers tr[data-consumer="billing"][data-producer="{address}"]')
        page.wait_for_function(
            """() => document.querySelector('#consumers tr[data-consumer="billing"] td.lag')
                 ?.innerText === '0'""",
            timeout=30_000,
        )
        shoot(page, "console.png")
        processes.kill(billing)
        publish(producer_db, *[str(n) for n in range(1, 21)])
        page.wait_for_function(
            """() => document.querySelector('#consumers tr[data-consumer="billing"] td.lag')
                 ?.innerText === '≤ 20'""",
            timeout=30_000,
        )
        assert row.locator("td.applied").inner_text() == str(max(credits(billing_db)))
        assert re.search(r"not connected: as of last report, \d+ s ago", row.inner_text())
        chart = page.locator('#charts .chart[data-consumer="billing"]')
        assert int(chart.get_attribute("data-points") or 0) >= 2
        shoot(page, "console-lag.png")

        # A poison record parked; its retry refused without a token, done with one.
        billing = start_billing(processes, address, billing_db, fixed)
        publish(producer_db, "oops")
        parked = page.locator('#parked tr[data-seq="24"]')
        parked.wait_for(timeout=30_000)
        assert "not a number" in parked.inner_text()
        parked.locator("button.retry").click()
        page.wait_for_function(
            "() => document.querySelector('#admin-state').innerText.includes('admin token')"
        )
        assert 24 not in credits(billing_db)
        fixed.touch()  # the fix, deployed
        page.fill("#admin-token", make_token(SECRET, "ops"))
        page.click("#admin button")
        page.locator('#parked tr[data-seq="24"] button.retry').click()
        wait_until(lambda: credits(billing_db).get(24) == "oops", 30, "the retried record applied")
        page.locator('#parked tr[data-seq="24"]').wait_for(state="detached", timeout=30_000)
        assert page.locator("#admin-state").inner_text() == "marked 1 for retry"

        # The group's members killed: their leases expire (since when), no longer held.
        for member in members:
            processes.kill(member)
        page.wait_for_function(
            """() => [...document.querySelectorAll('#groups tr[data-share] td.held')]
                 .every((cell) => /^expired [\\d.]+ s ago$/.test(cell.innerText))""",
            timeout=30_000,
        )
        renews = group.locator("tr[data-member]").all_inner_texts()
        assert len(renews) == 2 and all(re.search(r"expired [\d.]+ s ago", r) for r in renews)
        assert errors == []


def test_an_action_without_an_admin_token_is_refused_and_changes_nothing(
    tmp_path: Path, processes: Processes
) -> None:
    producer_db, billing_db, fixed = paths(tmp_path)
    address = serve(processes, producer_db)
    publish(producer_db, "oops")
    start_billing(processes, address, billing_db, fixed)
    wait_until(lambda: streamq.list_dead_letters(str(billing_db)), 30, "the record parked")
    (tmp_path / "secret").write_bytes(SECRET)
    url = console(processes, address, str(billing_db), secret=tmp_path / "secret")
    readonly = console(processes, address, str(billing_db), name="readonly")
    retry = {"database": str(billing_db), "consumer": "billing", "stream": "orders", "seq": 1}
    refusals = [
        (url, {}, "needs an admin token"),
        (url, {"Authorization": "Bearer ops:0123"}, "invalid token"),
        (url, {"Authorization": f"Bearer {make_token(SECRET, 'ops')}x"}, "invalid token"),
        (
            url,
            {"Authorization": f"Bearer {make_token(b'another-secret-0123456', 'ops')}"},
            "invalid",
        ),
        (url, {"Authorization": f"Bearer {make_token(SECRET, 'guest')}"}, "no grants"),
        (readonly, {"Authorization": f"Bearer {make_token(SECRET, 'ops')}"}, "read-only"),
    ]
    with httpx.Client(timeout=10) as http:
        for base, headers, why in refusals:
            answer = http.post(f"{base}api/dead-letters/retry", json=retry, headers=headers)
            assert answer.status_code == 403, (headers, answer.text)
            assert why in answer.json()["error"]
        [parked] = streamq.list_dead_letters(str(billing_db))
        assert parked.retry_requested_at is None  # nothing marked
        state = http.get(f"{url}api/state").json()
        assert [p["seq"] for p in state["parked"]] == [1]
        assert state["actions"] and not http.get(f"{readonly}api/state").json()["actions"]
        # A wrong request with a good token: a clear error, nothing marked.
        good = {"Authorization": f"Bearer {make_token(SECRET, 'ops')}"}
        answer = http.post(f"{url}api/dead-letters/retry", json={**retry, "seq": 9}, headers=good)
        assert answer.status_code == 404 and "no parked record" in answer.json()["error"]
        answer = http.post(f"{url}api/dead-letters/retry", json={"seq": "x"}, headers=good)
        assert answer.status_code == 400
        answer = http.get(f"{url}api/tail", params={"producer": address, "stream": "nope"})
        assert answer.status_code == 502 and "unknown stream 'nope'" in answer.json()["error"]
        answer = http.get(f"{url}api/tail", params={"producer": "127.0.0.1:1", "stream": "x"})
        assert answer.status_code == 404 and "does not watch" in answer.json()["error"]
        assert streamq.list_dead_letters(str(billing_db))[0].retry_requested_at is None


def run_console(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STREAMQ, "console", "--port", "0", *argv], capture_output=True, text=True, timeout=60
    )


def test_a_console_pointed_at_something_else_says_so_in_one_line(
    tmp_path: Path, processes: Processes
) -> None:
    producer_db = tmp_path / "shop.db"
    address = serve(processes, producer_db)
    web = console(processes, address)
    web_port = re.search(r":(\d+)/", web)[1]  # type: ignore[index]
    short = tmp_path / "short-secret"
    short.write_bytes(b"too short")
    cases = [
        ((str(producer_db),), "is a producer's database"),
        ((str(tmp_path / "typo.db"),), "does not exist"),
        ((f"127.0.0.1:{web_port}",), "is not a streamq producer"),
        (("localhost",), "HOST:PORT"),
        ((), "give producers"),
        ((address, "--admin", "ops"), "--admin needs --token-secret-file"),
        ((address, "--token-secret-file", str(short), "--admin", "ops"), "at least 16 bytes"),
        ((address, "--endpoints-provider", "nothing_here"), "must be module:function"),
    ]
    for argv, said in cases:
        done = run_console(*argv)
        assert done.returncode != 0, argv
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, (
            argv,
            done.stderr,
        )
        assert "Traceback" not in done.stderr


def test_producers_from_a_file_join_and_an_unreachable_one_is_shown(
    tmp_path: Path, processes: Processes
) -> None:
    """``--endpoints-file`` is read at every poll, as the Spark source reads it."""
    listing = tmp_path / "producers.txt"
    listing.write_text("# none yet\n127.0.0.1:1\n")
    url = console(processes, "--endpoints-file", str(listing))
    with httpx.Client(timeout=10) as http:

        def producers() -> dict[str, dict[str, object]]:
            return {p["address"]: p for p in http.get(f"{url}api/state").json()["producers"]}

        wait_until(lambda: producers().get("127.0.0.1:1", {}).get("error"), 30, "unreachable")
        assert "cannot connect" in str(producers()["127.0.0.1:1"]["error"])
        address = serve(processes, tmp_path / "shop.db")
        listing.write_text(f"{address}\n")
        wait_until(lambda: set(producers()) == {address}, 30, "the listed producer")
        wait_until(lambda: producers()[address].get("streams") == [], 30, "its status")
        # The file gone: the page says so and keeps the last list.
        listing.unlink()
        wait_until(
            lambda: "No such file" in (http.get(f"{url}api/state").json()["listing_error"] or ""),
            30,
            "the listing's error",
        )
        assert set(producers()) == {address}


def test_capture_progress_and_decoded_changes_on_the_page(
    capture_url: str, processes: Processes
) -> None:
    """A capturing producer: the page shows the tables, the LSN and the slot's lag in
    bytes, and a captured change decoded (bytea as hex), as ``streamq tail --json``."""
    with psycopg.connect(capture_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY, blob bytea)")
    processes.run("init", *STREAMQ, "init", capture_url, "--capture", "orders")
    served = processes.start(
        "producer", *STREAMQ, "serve", capture_url, "--port", "0", "--capture", "orders"
    )
    address = served.wait_for_line(r"serving producer \S+ \(epoch \d+\) on (\S+)", 30)[1]
    with psycopg.connect(capture_url, autocommit=True) as conn:
        conn.execute("INSERT INTO orders VALUES (1, '\\xff')")
    url = console(processes, address)
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(url)
        capture = page.locator("#producers p.capture")
        capture.wait_for()
        assert "capturing public.orders (slot streamq_" in capture.inner_text()
        assert re.fullmatch(r"[\d.]+ (B|KiB|MiB)", capture.locator(".slot-lag").inner_text())
        page.select_option("#tail-stream", label=f"public.orders at {address}")
        change = page.locator('#tail tr[data-seq="1"] td.value')
        change.wait_for()
        decoded = json.loads(change.inner_text())
        assert decoded["op"] == "insert" and decoded["new"] == {"id": 1, "blob": "ff"}
        assert errors == []


def test_tls_and_tokens_on_both_sides(tmp_path: Path, processes: Processes) -> None:
    """A producer serving TLS and checking tokens: the console reads its status with an
    admin token over TLS, and serves its page over HTTPS; without the token it says so in
    one line."""
    certs = make_certs(tmp_path)
    (tmp_path / "producer-secret").write_bytes(SECRET)
    (tmp_path / "ops-token").write_text(make_token(SECRET, "ops"))
    address = serve(
        processes, tmp_path / "shop.db", "--tls-cert", certs.server.cert,
        "--tls-key", certs.server.key, "--token-secret-file", str(tmp_path / "producer-secret"),
        "--grant", "billing=orders", "--admin", "ops",
    )  # fmt: skip
    refused = run_console(address, "--producer-tls-ca", certs.ca)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "requires a token" in refused.stderr and "--producer-token-file" in refused.stderr
    started = processes.start(
        "console", *STREAMQ, "console", address, "--port", "0", "--producer-tls-ca", certs.ca,
        "--producer-token-file", str(tmp_path / "ops-token"),
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key,
    )  # fmt: skip
    url = started.wait_for_line(r"console: (https://\S+/)", 30)[1]
    trusted = ssl.create_default_context(cafile=certs.ca)
    with httpx.Client(verify=trusted, timeout=10) as https:
        wait_until(
            lambda: (
                [p.get("streams") for p in https.get(f"{url}api/state").json()["producers"]] == [[]]
            ),
            30,
            "the producer's status, read over TLS with the admin token",
        )
    with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
        httpx.get(url.replace("https://", "http://") + "api/state", timeout=5)

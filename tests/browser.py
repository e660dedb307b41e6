"""Debian's Chromium, headless, driven by Playwright: the docs' fit check and the console's
tests. Chromium's own traffic (updates, sync, Google's hosts) stays off: loopback only."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MISSING = f"no {CHROMIUM}: install Debian's chromium (`make chromium`: apt-get install chromium)"


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium; fails (never skips) where Debian's package is not installed."""
    assert shutil.which(CHROMIUM) is not None, MISSING
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()

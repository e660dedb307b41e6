"""``make docs-fit``: no code block on the built site scrolls sideways at a 1280-pixel
window, seen in a real headless Chromium (Debian's, driven by Playwright).

The site is served from ``build/site`` on loopback; every page is opened at 1280x800 and
each ``pre > code`` whose content is wider than its box is reported (page, width, first
line). A screenshot of the widest page's first wide block, or of the first guide if none
is wide, goes to ``build/docs-fit.png``, for a person to look at. Exit status 1 if any
block scrolls.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.browser import CHROMIUM, MISSING, chromium

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "site"
# Each code block wider than its box: its width, its box's, and its first line.
WIDE_BLOCKS = """
() => [...document.querySelectorAll("article pre > code")]
  .filter((code) => code.scrollWidth > code.clientWidth + 1)
  .map((code) => [code.scrollWidth, code.clientWidth, code.innerText.split("\\n")[0]])
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def served(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1, on a free port: its base URL."""
    handler = functools.partial(_Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def pages(site: Path) -> list[str]:
    """Every page of the site, as paths relative to its root (``guides/spark/``)."""
    found = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site)
        if relative.parts[:1] in (("assets",), ("search",)):
            continue
        found.append("" if relative == Path(".") else f"{relative.as_posix()}/")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1280, help="the window's width, pixels")
    parser.add_argument("--screenshot", type=Path, default=ROOT / "build" / "docs-fit.png")
    args = parser.parse_args(argv)
    if not (SITE / "index.html").is_file():
        print(f"no site in {SITE}: run make docs first", file=sys.stderr)
        return 2
    if shutil.which(CHROMIUM) is None:
        print(MISSING)
        return 2
    wide: dict[str, list[list[object]]] = {}
    with served(SITE) as base, chromium() as browser:
        page = browser.new_page(viewport={"width": args.width, "height": 800})
        listed = pages(SITE)
        for path in listed:
            page.goto(base + path, wait_until="load")
            if blocks := page.evaluate(WIDE_BLOCKS):
                wide[path] = blocks
        shown = max(wide, key=lambda p: len(wide[p])) if wide else "guides/producing/"
        page.goto(base + shown, wait_until="load")
        target = page.locator("article pre > code").first
        if wide:
            target.scroll_into_view_if_needed()
        args.screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.screenshot))
    for path, blocks in wide.items():
        for width, box, first in blocks:
            print(f"{path or 'index'}: {width} px in a {box} px box: {first}")
    print(
        f"{len(listed)} pages at {args.width} px: "
        f"{sum(map(len, wide.values()))} code blocks scroll sideways; "
        f"screenshot of {shown or 'index'} in {args.screenshot}"
    )
    return 1 if wide else 0


if __name__ == "__main__":
    sys.exit(main())

"""The documentation cannot rot: every ```python block in docs/ and README.md runs here.

Each block is a complete program. It runs as ``python example.py`` in a fresh process, in an
empty temporary directory (its SQLite files land there), with warnings as errors. A block
that reads ``DATABASE_URL`` gets a fresh database on the session's PostgreSQL server
(``pg_url``). Spark blocks start their own local Spark (``spark_source.session``). A block
that cannot run (a shell command, a configuration file) belongs in another fence (```bash,
```text, ...): a fence that looks like Python but is not tagged ``python`` is refused.

The site's structure is checked here too: the API reference documents each name of
``streamq.__all__`` once, every page is in the navigation, the CLI reference covers every
command, and the README's links resolve. ``make docs`` builds the site with ``--strict``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import streamq

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
# Fence tags that must not hide Python from this test.
PYTHON_LIKE = re.compile(r"^\{?\.?(py|python|python3|py3|pycon|ipython|pyi)\b", re.IGNORECASE)
TIMEOUT = 60.0  # seconds per example; Spark examples start a JVM
SPARK_TIMEOUT = 420.0


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    info: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def tag(self) -> str:
        return self.info.split()[0] if self.info.split() else ""


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced code block of a Markdown page (indented ones in lists included)."""
    blocks = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        else:
            raise AssertionError(f"{page}:{i + 1}: a fence that is never closed")
        blocks.append(Block(page, i + 1, opening["info"].strip(), "\n".join(body) + "\n"))
        i = j + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
EXAMPLES = [block for block in ALL_BLOCKS if block.tag == "python"]


def test_there_are_examples_on_every_guide() -> None:
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert guides
    with_examples = {block.page for block in EXAMPLES}
    assert [g.name for g in guides if g not in with_examples] == []
    assert ROOT / "README.md" in with_examples


def test_no_python_hides_in_another_fence() -> None:
    """Only ```python runs, so ```py, ```python3, ```pycon ... would escape the test."""
    hidden = [b.name for b in ALL_BLOCKS if PYTHON_LIKE.match(b.tag) and b.tag != "python"]
    assert hidden == []


def test_examples_fit_in_100_columns() -> None:
    """The project's line length: wider examples scroll sideways on the site."""
    wide = [
        f"{block.name} +{n}"
        for block in EXAMPLES
        for n, line in enumerate(block.code.splitlines(), 1)
        if len(line) > 100
    ]
    assert wide == []


@pytest.mark.timeout(SPARK_TIMEOUT + 60)
@pytest.mark.parametrize("block", EXAMPLES, ids=[block.name for block in EXAMPLES])
def test_example_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMQ_", "PYTEST"))}
    if "DATABASE_URL" in block.code:
        env["DATABASE_URL"] = request.getfixturevalue("pg_url")
    spark = "spark" in block.code
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    try:
        done = subprocess.run(
            [sys.executable, "-W", "error", str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=SPARK_TIMEOUT if spark else TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.name}: still running after {exc.timeout} s") from None
    if done.returncode != 0:
        numbered = "\n".join(
            f"{block.line + n:5} | {line}" for n, line in enumerate(block.code.splitlines(), 1)
        )
        raise AssertionError(
            f"{block.name} exited with {done.returncode}\n{numbered}\n"
            f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )


# --- the site's structure ------------------------------------------------------------

API_PAGE = DOCS / "reference" / "api.md"


def test_api_reference_documents_each_public_name_once() -> None:
    documented = re.findall(r"^::: streamq\.(\w+)\s*$", API_PAGE.read_text(), re.MULTILINE)
    assert sorted(documented) == sorted(streamq.__all__)
    assert len(documented) == len(set(documented))


def _nav_pages() -> set[str]:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:") :]
    return set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE))


def test_every_page_is_in_the_navigation() -> None:
    pages = {
        str(page.relative_to(DOCS))
        for page in DOCS.rglob("*.md")
        if "hooks" not in page.relative_to(DOCS).parts
    }
    generated = {"reference/cli.md"}  # made by docs/hooks/streamq_docs.py at build time
    assert pages | generated == _nav_pages()
    assert not (pages & generated), "a generated page must not exist as a file too"


def _hook() -> object:
    spec = importlib.util.spec_from_file_location("streamq_docs", DOCS / "hooks/streamq_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_covers_every_command() -> None:
    from streamq.cli import build_parser

    page: str = _hook().cli_reference()  # type: ignore[attr-defined]
    parser = build_parser()
    top = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    listed = [choice.dest for choice in top._choices_actions]  # type: ignore[attr-defined]
    assert "serve" in listed and "dead-letters" in listed
    for name in listed:
        assert f"usage: streamq {name}" in page
    for nested in ("consumers add", "consumers list", "dead-letters retry"):
        assert f"usage: streamq {nested}" in page


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t[0] != "#"]
    assert local
    assert [t for t in local if not (ROOT / t).exists()] == []

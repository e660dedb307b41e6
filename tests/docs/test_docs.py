"""The documentation cannot rot: every ```python block in docs/ and README.md runs here.

Each block is a complete program. It runs as ``python example.py`` in a fresh process, in an
empty temporary directory (its SQLite files land there), with warnings as errors. A block
that reads ``DATABASE_URL`` gets a fresh database on the session's PostgreSQL server
(``pg_url``; ``capture_url``, on a server whose WAL can be decoded, for one that captures
tables). Spark blocks (those importing ``pyspark`` or ``spark_source``) start and stop their
own local Spark, but run one after another in one Python process
(``tests/spark/programs/examples.py``), each as ``__main__`` in its own namespace, directory
and environment, so that Spark's JVM starts once rather than once per block. A block that
cannot run (a shell command, a configuration file) belongs in another fence (```bash,
```text, ...): a fence that looks like Python but is not tagged ``python`` is refused.

The site's structure is checked here too: the API reference documents each name of
``streamq.__all__`` once, every page is in the navigation, the CLI reference covers every
command, and the README's links resolve. ``make docs`` builds the site with ``--strict``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import streamq

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
# Fence tags that must not hide Python from this test.
PYTHON_LIKE = re.compile(r"^\{?\.?(py|python|python3|py3|pycon|ipython|pyi)\b", re.IGNORECASE)
TIMEOUT = 60.0  # seconds per example
SPARK_TIMEOUT = 420.0  # the first Spark example starts the JVM
SPARK_RUNNER = ROOT / "tests" / "spark" / "programs" / "examples.py"


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


CODE_WIDTH = 88  # columns the site's content area shows without scrolling (ruff's default)


def test_code_blocks_fit_the_page() -> None:
    """Every fenced block, examples, commands and output alike: a wider line scrolls
    sideways on the site."""
    wide = [
        f"{block.name} +{n}"
        for block in ALL_BLOCKS
        for n, line in enumerate(block.code.splitlines(), 1)
        if len(line) > CODE_WIDTH
    ]
    assert wide == []


def starts_spark(block: Block) -> bool:
    return "pyspark" in block.code or "spark_source" in block.code


class SparkRunner:
    """``tests/spark/programs/examples.py``, running the Spark examples in one process: started
    for the first one, and again for the next one after one fails."""

    def __init__(self, log: Path) -> None:
        self.log = log  # the runner's own output: Spark's JVM, its Python workers
        self.log.touch()
        self.process: subprocess.Popen[str] | None = None
        self.answers: queue.Queue[str | None] = queue.Queue()
        self.reader: threading.Thread | None = None

    def _start(self, env: dict[str, str]) -> subprocess.Popen[str]:
        with self.log.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-W", "error", str(SPARK_RUNNER)],
                cwd=self.log.parent,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        answers: queue.Queue[str | None] = queue.Queue()

        def read_answers() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                answers.put(line)
            answers.put(None)  # the runner exited

        reader = threading.Thread(target=read_answers, daemon=True)
        reader.start()
        self.process, self.answers, self.reader = process, answers, reader
        return process

    def run(self, script: Path, out: Path, env: dict[str, str], timeout: float) -> str | None:
        """Run ``script`` (its output to ``out``.stdout/.stderr); None if it exited with 0,
        else what went wrong, with what the runner logged meanwhile."""
        process = self.process or self._start(env)
        assert process.stdin is not None
        offset = self.log.stat().st_size
        request = {
            "script": str(script),
            "stdout": str(out.with_suffix(".stdout")),
            "stderr": str(out.with_suffix(".stderr")),
            "env": env,
        }
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            problem = f"still running after {timeout} s"
        else:
            if answer is None:
                problem = f"the runner exited with {process.wait()}"
            else:
                status = json.loads(answer)["status"]
                problem = f"exited with {status}" if status else ""
        if not problem:
            return None
        self.close(kill=True)  # whatever the failed example left behind goes with it
        with self.log.open("rb") as log:
            log.seek(offset)
            logged = log.read().decode(errors="replace").splitlines()
        return f"{problem}\n--- the runner's log (Spark)\n" + "\n".join(logged[-100:])

    def close(self, kill: bool = False) -> None:
        """End the runner: it stops once it has read every request, or at once (``kill``);
        its JVM exits as the runner's end of its stdin closes."""
        process, self.process = self.process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        if kill:
            process.kill()
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self.reader is not None:
            self.reader.join(timeout=10)
        process.stdout.close()


@pytest.fixture(scope="module")
def spark_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkRunner]:
    runner = SparkRunner(tmp_path_factory.mktemp("spark-examples") / "runner.log")
    yield runner
    runner.close()


@pytest.mark.timeout(SPARK_TIMEOUT + 60)
@pytest.mark.parametrize(
    "block",
    [
        # The Spark examples share one process (spark_runner): in one xdist worker.
        pytest.param(block, id=block.name, marks=[pytest.mark.xdist_group("spark")])
        if starts_spark(block)
        else pytest.param(block, id=block.name)
        for block in EXAMPLES
    ],
)
def test_example_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMQ_", "PYTEST"))}
    if "DATABASE_URL" in block.code:  # capture's on a server whose WAL can be decoded
        fixture = "capture_url" if "capture=" in block.code else "pg_url"
        env["DATABASE_URL"] = request.getfixturevalue(fixture)
    script = tmp_path / "example" / "example.py"
    script.parent.mkdir()
    script.write_text(block.code, encoding="utf-8")
    if starts_spark(block):
        runner: SparkRunner = request.getfixturevalue("spark_runner")
        problem = runner.run(script, tmp_path / "output", env, SPARK_TIMEOUT)
        if problem is None:
            return
        outputs = [tmp_path / "output.stdout", tmp_path / "output.stderr"]
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in outputs)
    else:
        try:
            done = subprocess.run(
                [sys.executable, "-W", "error", str(script)],
                cwd=script.parent,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{block.name}: still running after {exc.timeout} s") from None
        if done.returncode == 0:
            return
        problem, stdout, stderr = f"exited with {done.returncode}", done.stdout, done.stderr
    numbered = "\n".join(
        f"{block.line + n:5} | {line}" for n, line in enumerate(block.code.splitlines(), 1)
    )
    raise AssertionError(
        f"{block.name} {problem}\n{numbered}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
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


def test_cli_reference_fits_the_page() -> None:
    """The generated page shows each command's ``--help`` in a code block: it fits too."""
    page: str = _hook().cli_reference()  # type: ignore[attr-defined]
    blocks = re.findall(r"```text\n(.*?)```", page, re.DOTALL)
    assert len(blocks) > 10
    assert [line for block in blocks for line in block.splitlines() if len(line) > CODE_WIDTH] == []


def test_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t[0] != "#"]
    assert local
    assert [t for t in local if not (ROOT / t).exists()] == []


DESIGN = DOCS / "reference" / "design.md"


def package_map(text: str) -> tuple[set[str], dict[str, str]]:
    """The design page's package map: its headings' folders, and each row's path (a
    module, or a folder whose modules its text names) -> its text."""
    section = text.split("## Package map\n", 1)[1].split("\n## ", 1)[0]
    headings: set[str] = set()
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if heading := re.match(r"### `(streamq/[a-z_/]*)`", line):
            headings.add(heading.group(1))
        elif row := re.match(r"\| `(streamq/[a-z_/.]*)` \| (.*) \|$", line):
            assert row.group(1) not in rows, f"{row.group(1)} is in the map twice"
            rows[row.group(1)] = row.group(2)
    return headings, rows


def unmapped(root: Path, headings: set[str], rows: dict[str, str]) -> tuple[set[str], set[str]]:
    """(modules of ``root/streamq`` the map does not name, paths it names that are not
    there). A folder row names its modules in its text (``name.py``); a heading or a folder
    row covers its package's ``__init__.py``."""
    tree = {str(p.relative_to(root)) for p in (root / "streamq").rglob("*.py")}
    named = {folder + "__init__.py" for folder in headings}
    for path, text in rows.items():
        if path.endswith("/"):
            named.add(path + "__init__.py")
            named.update(path + name for name in re.findall(r"`([a-z_]+\.py)`", text))
        else:
            named.add(path)
    return tree - named, named - tree


def test_the_design_pages_map_matches_the_tree() -> None:
    """Every module of streamq is on the design page's package map, once, and every path
    on the map is there: a module added, moved or renamed changes the map with it."""
    missing, stale = unmapped(ROOT, *package_map(DESIGN.read_text()))
    assert missing == set(), f"on no row of {DESIGN.name}'s package map: {sorted(missing)}"
    assert stale == set(), f"on {DESIGN.name}'s package map, not in the tree: {sorted(stale)}"


def test_an_unmapped_or_stale_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "streamq" / "side").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "side/__init__.py", "side/b.py", "side/c.py"):
        (tmp_path / "streamq" / name).write_text("")
    page = (
        "## Package map\n\n### `streamq/side/`\n\n| module | what |\n| --- | --- |\n"
        "| `streamq/a.py` | a |\n| `streamq/gone.py` | moved away |\n"
        "| `streamq/side/` | `b.py` (b) |\n\n## Next\n| `streamq/c.py` | not the map |\n"
    )
    missing, stale = unmapped(tmp_path, *package_map(page))
    assert missing == {"streamq/__init__.py", "streamq/side/c.py"}  # a heading covers side/
    assert stale == {"streamq/gone.py"}

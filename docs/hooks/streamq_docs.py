"""MkDocs hook (mkdocs.yml ``hooks:``): pages and files made at build time, so they cannot drift.

- ``reference/cli.md``: the command line's help, generated from ``streamq.cli.build_parser()``
  (every command and sub-command the parser has, as ``streamq COMMAND --help`` prints it).
- ``bench/results/*.png`` and ``*.json``: the benchmark charts and the figures behind them,
  served from where ``python -m bench`` writes them (linked from ``benchmarks.md``, not
  copied into docs/).

``cli_reference()`` is plain Python (no MkDocs import) so tests/test_docs.py checks it too.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
CLI_PAGE = "reference/cli.md"
HELP_WIDTH = "88"  # columns argparse wraps the help at, whatever the terminal

CLI_INTRO = """\
# Command line

`streamq` (also `python -m streamq`). This page is generated from the command's own
argument parser when the site is built: it is what `streamq COMMAND --help` prints.

Secrets come from files or the environment, never only argv ([Security](../guides/security.md)).
Every command that takes a database takes a SQLite file or a `postgresql://` URL.
"""


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """Every (sub-)command the parser lists in its help, depth first, with its help line.
    Commands without a help line are not listed by ``--help`` either (internal ones)."""
    found = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if name not in helps:
                continue
            found.append(((*path, name), helps[name], sub))
            found.extend(_commands(sub, (*path, name)))
    return found


def cli_reference() -> str:
    """The CLI reference page, in Markdown."""
    from streamq.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parser = build_parser()
        commands = _commands(parser)
        lines = [CLI_INTRO, "| command | what it does |", "| --- | --- |"]
        for path, text, _ in commands:
            anchor = "-".join(path)
            cell = text.replace("|", "\\|")  # a table cell
            lines.append(f"| [`streamq {' '.join(path)}`](#{anchor}) | {cell} |")
        lines += ["", "## streamq", "", "```text", parser.format_help().rstrip(), "```", ""]
        for path, _, sub in commands:
            heading = "#" * (1 + len(path))
            lines += [
                f"{heading} streamq {' '.join(path)} {{#{'-'.join(path)}}}",
                "",
                "```text",
                sub.format_help().rstrip(),
                "```",
                "",
            ]
        return "\n".join(lines)
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    for result in sorted([*RESULTS.glob("*.png"), *RESULTS.glob("*.json")]):
        name = f"bench/results/{result.name}"
        files.append(File.generated(config, name, abs_src_path=str(result)))
    return files

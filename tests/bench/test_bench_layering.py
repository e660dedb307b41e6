"""The benchmarks import no module in a loop: no bench module imports, even inside a
function, one that (directly or not) imports it back.

The graph is built statically from every ``import`` and ``from ... import`` anywhere in
each file of ``bench/`` (``imported_names``, shared with ``test_layering``), so a loop
hidden by a function-level import counts as much as one at the top.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..test_layering import imported_names

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def import_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (itself left out)."""
    files: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return {
        module: {name for name in imported_names(path, module) if name in files} - {module}
        for module, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph``, as the modules in order with the first repeated at
    the end (``[a, b, a]``), or None if there is none."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path: list[str] = [root]  # the modules being walked, each importing the next
        todo = [iter(sorted(graph[root]))]
        while todo:
            following = next(todo[-1], None)
            if following is None:
                done.add(path.pop())
                todo.pop()
            elif following in path:
                return [*path[path.index(following) :], following]
            elif following not in done:
                path.append(following)
                todo.append(iter(sorted(graph.get(following, ()))))
    return None


def test_bench_has_no_import_cycle() -> None:
    graph = import_graph(BENCH_DIR, "bench")
    assert {"bench.common", "bench.kafka.broker", "bench.transfer.run"} <= set(graph)
    assert "bench.common" in graph["bench.transfer.run"]  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "bench imports in a loop: " + " -> ".join(cycle or [])


def test_cycles_are_found(tmp_path: Path) -> None:
    """A loop closed inside a function, or through a package's relative import, is found
    and named; imports that merely meet again are not a loop."""
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\nfrom .sub import c\nimport json\n")
    (pkg / "b.py").write_text("from . import d\nthing = 1\n")
    (pkg / "d.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..b import thing\n")
    graph = import_graph(pkg, "fake")
    assert graph["fake.a"] == {"fake.b", "fake.sub", "fake.sub.c"}
    assert graph["fake.b"] == {"fake", "fake.d"}
    assert find_cycle(graph) is None  # a -> b, a -> c -> b: no loop

    (pkg / "d.py").write_text(
        textwrap.dedent(
            """
            def late():
                from .sub.c import thing
                return thing
            """
        )
    )
    # b -> d -> c -> b, d's import inside a function
    assert find_cycle(import_graph(pkg, "fake")) == ["fake.b", "fake.d", "fake.sub.c", "fake.b"]


def test_find_cycle_on_graphs() -> None:
    assert find_cycle({}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]

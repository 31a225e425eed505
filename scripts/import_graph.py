"""Print the import circles in weightcache, at file grain and at package grain (docs/architecture.md).

    .venv/bin/python scripts/import_graph.py

A circle is a strongly connected component of the import graph with more than one member: every module in it
reaches every other. File grain takes each module as a node; package grain folds every module into its top-level
part (weightcache.csi.node -> weightcache.csi, weightcache.fetch stays weightcache.fetch). Imports inside functions
and under TYPE_CHECKING count, as they do for lint-imports. For each circle one shortest loop is printed so the
edge to cut is plain. Exit status 1 when any circle is found, so CI can run it beside lint-imports.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

import grimp

PACKAGE = "weightcache"

Graph = Mapping[str, set[str]]


def module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports directly."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def fold(graph: Graph) -> dict[str, set[str]]:
    """The same graph with each module replaced by its top-level part of the package; self-loops dropped."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folded: dict[str, set[str]] = {}
    for source, targets in graph.items():
        folded.setdefault(top(source), set()).update(top(t) for t in targets if top(t) != top(source))
    return folded


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with two or more members (Tarjan, iterative), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def shortest_loop(graph: Graph, members: list[str]) -> list[str]:
    """One shortest loop through the circle's first member, staying inside the circle (breadth-first)."""
    inside = set(members)
    start = members[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph.get(node, set()) & inside):
                if child == start:
                    loop = [node]
                    while loop[-1] != start:
                        loop.append(previous[loop[-1]])
                    return [*reversed(loop), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return members


def report(title: str, graph: Graph) -> int:
    found = circles(graph)
    print(f"{title}: {len(found)} circle(s)")
    for members in found:
        print(f"  {len(members)} members: {', '.join(members)}")
        print(f"    e.g. {' -> '.join(shortest_loop(graph, members))}")
    return len(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    graph = module_graph()
    total = report("file grain", graph) + report("package grain", fold(graph))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())

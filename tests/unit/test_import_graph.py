"""The packages of disagg import one another in one direction only: no two of them import each
other, however indirectly; the shared protocol sits below the schedulers and the serving layer; and
the tools (`disagg_tools`: the command line, model making, repository and manifests) build on disagg,
which never imports them."""

from __future__ import annotations

import itertools

import grimp
import pytest


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("disagg", "disagg_tools")


def _packages(graph: grimp.ImportGraph) -> list[str]:
    return [*sorted(m for m in graph.find_children("disagg") if graph.find_children(m)), "disagg_tools"]


def test_no_two_packages_import_each_other(graph: grimp.ImportGraph) -> None:
    packages = _packages(graph)
    assert {"disagg.engine", "disagg.protocol", "disagg.scheduling", "disagg.serving"} <= set(packages)
    cycles = []
    for a, b in itertools.combinations(packages, 2):
        there = graph.find_shortest_chains(importer=a, imported=b, as_packages=True)
        back = graph.find_shortest_chains(importer=b, imported=a, as_packages=True)
        if there and back:
            cycles.append((sorted(there)[0], sorted(back)[0]))
    assert cycles == [], cycles


def test_disagg_never_imports_its_tools(graph: grimp.ImportGraph) -> None:
    chains = graph.find_shortest_chains(importer="disagg", imported="disagg_tools", as_packages=True)
    assert chains == set(), sorted(chains)


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("disagg.protocol", {"disagg.engine", "disagg.kv", "disagg.role"}),
        ("disagg.scheduling", {"disagg.engine", "disagg.kv", "disagg.role", "disagg.protocol"}),
    ],
)
def test_the_lower_layers_import_nothing_above_them(
    graph: grimp.ImportGraph, package: str, allowed: set[str]
) -> None:
    """The protocol and the pure schedulers know nothing of serving, Triton or the front ends."""
    imported = {
        module
        for module in graph.find_upstream_modules(package, as_package=True)
        if not module.startswith(package)
    }
    above = {m for m in imported if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert above == set(), sorted(above)

"""The packages of disagg import one another in one direction only: no two of them import each
other, however indirectly; the shared protocol sits below the schedulers and the serving layer; and
the tools (`disagg_tools`: the command line, model making, repository and manifests) build on disagg,
which never imports them."""

from __future__ import annotations

import itertools

import grimp
import pytest
import tomllib

from disagg.paths import REPO_ROOT


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("disagg", "disagg_tools", cache_dir=None)


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


BELOW = ("disagg.engine", "disagg.kv", "disagg.role")
HOST = ("disagg.compiler", "disagg.loanpath", "disagg.procfs", "disagg.statefile")  # machine helpers


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("disagg.protocol", {*BELOW}),
        ("disagg.scheduling", {*BELOW, "disagg.protocol"}),
        ("disagg.hot", {*BELOW, "disagg.protocol"}),
        # the pool side: no request side, no Triton
        ("disagg.pool", {*BELOW, *HOST, "disagg.protocol", "disagg.scheduling", "disagg.config"}),
        # the request side: no pool internals, no Triton
        ("disagg.serving", {*BELOW, *HOST, "disagg.protocol", "disagg.hot", "disagg.tls"}),
    ],
)
def test_the_lower_layers_import_nothing_above_them(
    graph: grimp.ImportGraph, package: str, allowed: set[str]
) -> None:
    """Each room imports only what lies below it: the protocol and the pure schedulers know nothing of
    serving, Triton or the front ends; the pool side and the request side know nothing of each other."""
    imported = {
        module
        for module in graph.find_upstream_modules(package, as_package=True)
        if not module.startswith(package)
    }
    above = {m for m in imported if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert above == set(), sorted(above)


def test_every_package_is_in_the_distribution() -> None:
    """pyproject lists its packages by name: a package missing there works in the editable install
    (found by path) and is absent from a wheel (`pip install .`)."""
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for name, folder in (
        ("disagg", REPO_ROOT / "backends" / "disagg"),
        ("disagg_tools", REPO_ROOT / "tools"),
    ):
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert found == listed

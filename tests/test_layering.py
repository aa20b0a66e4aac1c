"""The layering rules of docs/design.md, checked on the source: imports run down the layer table and never close a
cycle, one resolver, typed addresses above the runtime."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.paths import ROOT

PACKAGE = ROOT / "kvtier"
TOP = ("__init__", "__main__")     # the package's face: it may import any layer, and no layer imports it
LOW = ("runtime", "memory", "address.py")


def layer_table(design: str) -> dict[str, int]:
    """Each unit (a package or top-level module of kvtier) named in the first column of design.md's layer table ->
    its row, counted from the bottom layer up (0: the foundation)."""
    section = design.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `kvtier.")]
    return {name: row for row, line in enumerate(rows)
            for name in re.findall(r"`kvtier\.(\w+)`", line.split("|")[1])}


def unit_of(path: Path, package: Path) -> str:
    return path.relative_to(package).with_suffix("").parts[0]


def imported_units(path: Path) -> set[str]:
    """The units of kvtier a module imports, wherever the import sits (top level, a function, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "kvtier" else [f"kvtier.{a.name}" for a in node.names]
        else:
            continue
        found |= {name.split(".")[1] for name in names if name.startswith("kvtier.")}
    return found


def import_graph(package: Path) -> dict[str, set[tuple[str, str]]]:
    """unit -> {(imported unit, the importing file)} over every module of ``package``."""
    graph: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        unit = unit_of(path, package)
        graph.setdefault(unit, set())
        graph[unit] |= {(other, str(path.relative_to(package))) for other in imported_units(path) if other != unit}
    return graph


def layering_violations(graph: dict[str, set[tuple[str, str]]], layers: dict[str, int]) -> list[str]:
    """Every import that runs up the table, reaches a unit the table lacks, or closes a cycle between units."""
    problems = [f"{unit} is not in docs/design.md's layer table" for unit in graph
                if unit not in layers and unit not in TOP]
    for unit, edges in graph.items():
        for other, where in sorted(edges):
            if other in TOP:
                problems.append(f"{where} imports the package face kvtier.{other}")
            elif unit in layers and other in layers and layers[other] > layers[unit]:
                problems.append(f"{where} ({unit}) imports kvtier.{other}, a layer above it")
    return problems + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]


def cycles(graph: dict[str, set[tuple[str, str]]]) -> list[list[str]]:
    """One cycle through each unit that is on one (depth-first search over the unit graph)."""
    found, done = [], set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            found.append(path[path.index(unit):] + [unit])
            return
        if unit in done:
            return
        for other in sorted({o for o, _ in graph.get(unit, ())}):
            visit(other, path + [unit])
        done.add(unit)
    for unit in sorted(graph):
        visit(unit, [])
    return found


def test_imports_follow_the_layer_table_of_the_design_document():
    layers = layer_table((ROOT / "docs" / "design.md").read_text())
    assert {"errors", "runtime", "memory", "pools", "keys", "transfer", "storage", "cache", "cli"} <= set(layers)
    assert layering_violations(import_graph(PACKAGE), layers) == []


@pytest.mark.parametrize("plant, expected", [
    ("storage/planted.py", "(storage) imports kvtier.cache, a layer above it"),
    ("keys_planted.py", "keys_planted is not in docs/design.md's layer table"),
])
def test_a_planted_upward_import_fails(tmp_path, plant, expected):
    """A copy of the package with one module added that imports upward: the check names it (and the cycle)."""
    import shutil
    copy = tmp_path / "kvtier"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.fatbin", "*.cubin"))
    (copy / plant).write_text("from kvtier.cache import KVCache\n")
    layers = layer_table((ROOT / "docs" / "design.md").read_text())
    problems = layering_violations(import_graph(copy), layers)
    assert any(expected in problem for problem in problems), problems
    if plant.startswith("storage"):
        assert any(problem.startswith("import cycle") and "storage" in problem for problem in problems), problems


def _sources_above(*layers: str):
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in layers:
            continue
        yield path, path.read_text()


def test_only_the_memory_package_asks_the_runtime_for_an_alias():
    for path, text in _sources_above(*LOW):
        assert not re.search(r"host_get_device_pointer|span_alias|pointer_attributes", text), path


def test_no_address_arithmetic_on_raw_values_above_runtime_and_memory():
    for path, text in _sources_above(*LOW):
        assert not re.search(r"(Cpu|Device)Address\([^)]*\.value\s*[+-]", text), path
        assert not re.search(r"\.value\s*[+-]\s*(offset|int\()", text), path


def test_kernels_are_launched_only_at_the_launch_boundary():
    for path, text in _sources_above(*LOW):
        if path.name != "launch.py":
            assert not re.search(r"runtime\.launch\(|load_program\(", text), path


def test_the_cache_never_touches_device_addresses():
    """kvtier.cache works in page numbers; the transfer engines turn them into addresses."""
    for path in (PACKAGE / "cache").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"kvtier\.memory|DeviceAddress|CpuAddress|get_device_accessible_ptr|"
                             r"layer_device_addresses|layer_cpu_addresses|\.cpu_address", text), path


def test_storage_never_sees_a_device_address():
    """kvtier.storage reads and writes CPU-domain views of host pages (page_pieces, the offsets behind
    page_metadata, over the buffer's CPU mapping), nothing a device uses."""
    for path in (PACKAGE / "storage").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"DeviceAddress|get_device_accessible_ptr|layer_device_addresses|layer_regions|"
                             r"kvtier\.transfer|kvtier\.kernels|device_alias", text), path
    views = (PACKAGE / "storage" / "views.py").read_text()
    assert "page_pieces" in views and "cpu_address" in views


def test_disagg_hands_the_wire_cpu_addresses_and_knows_no_cache():
    """kvtier.disagg registers host memory by its CPU address (a device pool by its device addresses only where
    the wire reaches device memory) and never resolves an alias; the radix tree is out of its sight."""
    for path in (PACKAGE / "disagg").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"get_device_accessible_ptr|layer_regions|device_alias|kvtier\.cache", text), path
    sender = (PACKAGE / "disagg" / "sender.py").read_text() + (PACKAGE / "disagg" / "receiver.py").read_text()
    assert sender.count("buffer.cpu_address, ") >= 3

"""The layering rules of docs/design.md, checked on the source: one resolver, typed addresses above the runtime."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"
LOW = ("runtime", "memory", "address.py")


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

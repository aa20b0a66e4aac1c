"""The extension points' contracts as tests see them: the primitives a module docstring lists, and a subclass of an
interface that writes all of its primitives but some."""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

PRIMITIVE = re.compile(r"^- ``(\w+)\.(\w+)\b", re.MULTILINE)
"""A primitive's line in a module docstring: ``- ``Class.method(arguments)`` what it does, returns and raises``."""


def documented_primitives(module: ModuleType) -> dict[str, set[str]]:
    """Class name → the primitives the module's docstring lists for it."""
    listed: dict[str, set[str]] = {}
    for owner, name in PRIMITIVE.findall(module.__doc__ or ""):
        listed.setdefault(owner, set()).add(name)
    return listed


def _stub(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def implemented_except(interface: type, *missing: str) -> type:
    """A subclass of ``interface`` with a trivial body for each of its primitives except ``missing``."""
    bodies = {name: _stub for name in interface.__abstractmethods__ if name not in missing}
    return type(f"Partial{interface.__name__}", (interface,), bodies)

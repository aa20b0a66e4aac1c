"""The caller's-pages check and state change in C (kvtier/_page_checks.c); built by the package's install where it can
be."""

from typing import Any

def take(pages: Any, states: Any, want: int, to: int) -> bool: ...

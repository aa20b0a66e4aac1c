"""Command-line helpers the bench scripts share (not a script itself).

A comma-separated list of names is checked when the arguments are parsed, so a typo ends the run at once with one
line that lists the choices, instead of a traceback after minutes of measuring the names before it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def name_list(choices: Iterable[str], what: str = "name") -> Callable[[str], list[str]]:
    """An argparse ``type``: ``"a,b"`` -> ``["a", "b"]``, each one of ``choices``."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in allowed] or ([] if names else [text])
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, unknown))} "
                                             f"(choose from {', '.join(allowed)})")
        return names

    return parse

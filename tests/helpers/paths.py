"""Where the repository's parts are, for tests that read docs, run scripts or start children."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def child_env() -> tuple[dict[str, str], str]:
    """(an environment whose PYTHONPATH puts the kvtier this process imported first, that checkout's root): a child
    interpreter runs the same kvtier as the test, wherever it was imported from."""
    import kvtier

    root = str(Path(kvtier.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}, root

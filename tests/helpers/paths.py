"""Where the repository's parts are, for tests that read docs, run scripts or start children."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

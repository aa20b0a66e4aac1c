"""docs/disagg.md stays true: its Python example runs as written, as a script (its prefill side is a second process
started with multiprocessing's spawn), and prints the landing it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers.mooncake import need_mooncake
from helpers.paths import ROOT

pytestmark = pytest.mark.slow

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "disagg.md").read_text(), flags=re.S)


def test_the_docs_have_one_example():
    assert len(BLOCKS) == 1


def test_the_example_runs_as_written(tmp_path):
    need_mooncake()
    script = tmp_path / "disagg_example.py"
    script.write_text(BLOCKS[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "request req-1 landed in pages [40, 41, 42, 43, 50, 51, 52, 53]" in done.stdout

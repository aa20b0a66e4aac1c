"""README stays true: every Python block runs as written, every shell command that is not an install runs, and CI
runs the two set-up commands verbatim. The README names readable paths under /tmp; the tests run its code with each
of them moved into a temporary directory of their own, so they neither collide with other users of those paths nor
leave anything there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [line for lang, code in BLOCKS if lang == "bash" for line in code.strip().splitlines()]
INSTALLS = [line for line in SHELL if "pip install" in line]
TMP_PATH = re.compile(r"/tmp/([\w.-]+)")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the whole README: a later command reads what an earlier one stored, as in a shell."""
    return tmp_path_factory.mktemp("readme")


def _in_scratch(code: str, scratch: Path) -> str:
    return TMP_PATH.sub(lambda m: str(scratch / m.group(1)), code)


def _installed(line: str) -> str:
    """``python`` is the interpreter running the tests (the one kvtier is installed in, whatever ``python`` is first
    on PATH); where the package is on PYTHONPATH but not installed (the GPU machine), ``kvtier`` is ``python -m
    kvtier`` (at the start of each command of the line)."""
    line = re.sub(r"(^|&& |; )python ", lambda m: f"{m.group(1)}{sys.executable} ", line)
    if shutil.which("kvtier") is None:
        return re.sub(r"(^|&& |; )kvtier ", lambda m: f"{m.group(1)}{sys.executable} -m kvtier ", line)
    return line


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_RUNTIME"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # hangs only


def test_readme_has_the_two_set_up_commands():
    assert len(INSTALLS) == 2 and any("pytest" in line for line in INSTALLS)
    ci = (ROOT / ".ci" / "run").read_text()
    for line in INSTALLS:
        assert line in ci, f".ci/run must run README's command verbatim: {line}"


@pytest.mark.parametrize("code", PYTHON, ids=[f"python-{i}" for i in range(len(PYTHON))])
def test_python_blocks_run_as_written(code, scratch):
    done = _run([sys.executable, "-c", _in_scratch(code, scratch)])
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("line", [line for line in SHELL if line not in INSTALLS and "gpu_check" not in line])
def test_shell_commands_run_as_written(line, scratch):
    if "mooncake" in line:
        from helpers.mooncake import need_mooncake

        need_mooncake()                 # the wheel is in the test extra; a machine without it skips, CI fails
    done = _run(["bash", "-c", _installed(_in_scratch(line, scratch))])
    assert done.returncode == 0, done.stderr[-3000:]


def test_readme_paths_under_tmp_are_moved_into_the_tests_directory(tmp_path):
    named = {m for lang, code in BLOCKS for m in TMP_PATH.findall(code)}
    assert named >= {"kvtier-store", "kvtier-readme-store"}
    moved = _in_scratch(README, tmp_path / "scratch")
    assert [path for path in TMP_PATH.findall(moved) if not path.startswith("pytest-of-")] == []


def test_project_stands_alone():
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]:
        text = path.read_text()
        assert "../shared" not in text and "METHOD.md" not in text, path
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), f"{path.name} links to {target}, which a clone lacks"

"""The test run polices itself: a run that leaves kvtier's files in its temporary or shm directory fails and names
them, and the GPU runs a machine without a GPU skips are summed up in one line, other skip reasons kept. Each case
is a small pytest run in a subprocess with this suite's conftest."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import ROOT, TESTS

INNER = '''
import os, tempfile
import pytest

def test_leaves_a_directory():
    os.mkdir(os.path.join(tempfile.gettempdir(), "kvtier-left-behind"))

def test_leaves_an_shm_file():
    directory = os.environ.get("KVTIER_SHM_DIR") or os.path.join(tempfile.gettempdir(), "shm")
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, "kvtier-shm-left-behind"), "w").close()

def test_cleans_up(tmp_path):
    (tmp_path / "kvtier-in-tmp-path").mkdir()

def test_needs_a_gpu():
    pytest.skip("no usable CUDA GPU")

def test_needs_a_gpu_too():
    pytest.skip("no usable CUDA GPU")

def test_needs_a_gpu_as_well():
    pytest.skip("no usable CUDA GPU")

def test_needs_something_else():
    pytest.skip("needs something else")
'''


def inner_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVTIER_SHM_DIR", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "--rootdir",
                           str(tmp_path), str(tmp_path / "test_inner.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two xdist workers"])
def test_a_run_that_leaves_kvtier_files_fails_and_names_them(tmp_path, workers):
    """Run alone or spread over xdist workers (each with directories of its own, reporting to the controller)."""
    done = inner_run(tmp_path, "-k", "leaves", *workers)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout and "kvtier files left behind" in done.stdout
    assert "kvtier-left-behind" in done.stdout and "kvtier-shm-left-behind" in done.stdout


def test_a_clean_run_passes_and_sums_up_the_gpu_skips_in_one_line(tmp_path):
    done = inner_run(tmp_path, "-k", "not leaves")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "left behind" not in done.stdout
    gpu = [line for line in done.stdout.splitlines() if "no usable CUDA GPU" in line]
    assert len(gpu) == 1 and "[3]" in gpu[0], done.stdout
    assert any("needs something else" in line for line in done.stdout.splitlines()), done.stdout


def module_helpers(path: Path) -> set[str]:
    """The functions and classes a test module defines at its top level, tests themselves aside (fixtures count)."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith(("test_", "Test"))}


def test_every_helper_is_defined_once():
    """A helper two test files need lives in tests/helpers/, defined once: copies drift apart."""
    where: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for name in module_helpers(path):
            where.setdefault(name, []).append(str(path.relative_to(TESTS)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_no_test_file_is_named_after_an_issue_or_a_review_round():
    names = [str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")]
    assert [name for name in names if re.search(r"issue|adversar|round[0-9]|hardening|regression", name)] == []

"""Whatever goes wrong under a ``kvtier`` command reaches the user as one line on stderr, never a traceback: library
errors and refusals of the machine exit 2, anything unexpected exits 1 and says how to see the traceback."""

from __future__ import annotations

import argparse

import pytest
from helpers.cli import kvtier
from helpers.hip_fakes import NON_HIP_LIBRARY, needs_non_hip_library

from kvtier.cli import DEBUG, run
from kvtier.errors import InvalidArgument


def command(error: BaseException) -> argparse.Namespace:
    def fail(runtime, args):
        raise error

    return argparse.Namespace(command="demo", run=fail, needs_runtime=False)


@pytest.mark.parametrize("error, code, words", [
    (InvalidArgument("--users must be >= 1"), 2, "kvtier demo: --users must be >= 1"),
    (OSError(28, "No space left on device"), 2, "No space left on device"),
    (ZeroDivisionError("division by zero"), 1, f"unexpected ZeroDivisionError: division by zero (a kvtier bug: "
                                               f"{DEBUG}=1 shows the traceback"),
])
def test_an_error_is_one_line_on_stderr(error, code, words, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG, raising=False)
    assert run(command(error)) == code
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_debug_variable_shows_the_traceback_of_an_unexpected_error(monkeypatch):
    monkeypatch.setenv(DEBUG, "1")
    with pytest.raises(ZeroDivisionError):
        run(command(ZeroDivisionError("division by zero")))


@needs_non_hip_library
def test_cli_runtime_hip_with_a_non_hip_library_exits_2_without_a_traceback(monkeypatch):
    """``KVTIER_HIP_LIBRARY=<libz> kvtier --runtime hip doctor`` printed a Python traceback (AttributeError) and exited
    1; the CLI contract is one 'kvtier doctor: ...' line on stderr and exit code 2. (Found adversarially, issue #14.)"""
    monkeypatch.setenv("KVTIER_HIP_LIBRARY", NON_HIP_LIBRARY)
    done = kvtier("--runtime", "hip", "doctor")
    assert "Traceback" not in done.stderr, done.stderr[-500:]
    assert done.returncode == 2

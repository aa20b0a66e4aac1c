"""Every option of ``kvtier demo`` and ``kvtier doctor`` says what it does and, when it takes a value, its
default; ``--runtime`` names every runtime there is."""

from __future__ import annotations

import re

import pytest
from helpers.cli import kvtier

OPTION = re.compile(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$")


def options(help_text: str) -> dict[str, tuple[bool, str]]:
    """Option → (takes a value, its help text), read from argparse's help output."""
    found: dict[str, tuple[bool, str]] = {}
    current = None
    for line in help_text.splitlines():
        match = OPTION.match(line)
        if match:
            invocation = match.group(1)
            current = invocation.split(", ")[-1].split(" ")[0]
            found[current] = (" " in invocation.split(", ")[-1], match.group(2) or "")
        elif current and line.startswith("    ") and line.strip():
            takes, text = found[current]
            found[current] = (takes, f"{text} {line.strip()}".strip())
        else:
            current = None
    return found


@pytest.mark.parametrize("command", ["demo", "doctor"])
def test_every_option_has_help_and_shows_its_default(command):
    done = kvtier(command, "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    found = options(done.stdout)
    assert "--runtime" in found and len(found) > (20 if command == "demo" else 4), found
    for name, (takes_value, text) in found.items():
        assert text, f"{name} has no help text"
        if takes_value:
            assert "default" in text, f"{name} does not show its default: {text!r}"


def test_demo_help_says_how_big_a_run_may_be():
    text = " ".join(kvtier("demo", "--help", timeout=120).stdout.split())
    assert "50% of the memory this machine has available" in text and "at most 64.0 GiB" in text
    assert "exit code 130" in text


def test_cli_runtime_help_names_hip():
    """docs/hip.md documents ``kvtier --runtime hip doctor``, but ``--runtime``'s help (top level, doctor and demo)
    said 'cuda | emulated:split | emulated:unified (... else cuda when a GPU is usable, else emulated:split)': it
    lists hip and says auto selection tries HIP before the emulator. (Found adversarially, issue #14.)"""
    from kvtier.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if "--runtime" in a.option_strings)
    assert "hip" in action.help

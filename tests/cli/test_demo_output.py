"""What ``kvtier demo`` prints: results on stdout, in plain words, with every outcome a user asks about (dropped
requests too); the clock's part apart and, on the emulator, marked as no hardware rate; progress on stderr, none
with --json; the same results for the same flags and seed."""

from __future__ import annotations

import json

import pytest
from helpers.cli import SMALL_DEMO, kvtier

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them

SPLIT = ("--runtime", "emulated:split", "demo")


def results_part(table_output: str) -> str:
    """The tables minus what the clock measured (the timings table, and any row of times or rates)."""
    results = table_output.partition("Timings")[0].rstrip()     # (the timings title is centred: spaces)
    return "\n".join(line for line in results.splitlines()
                     if not any(clock in line for clock in ("wall time", "GB/s", "MB/s", " s, ")))


def test_the_table_names_dropped_requests_and_marks_emulated_rates():
    done = kvtier(*SPLIT, *SMALL_DEMO)
    assert done.returncode == 0, done.stderr[-2000:]
    out = " ".join(done.stdout.split())                  # rich wraps titles to the width
    assert "requests or replies dropped: device full" in out
    assert "(emulated)" in out and "emulated rates are not hardware rates" in out
    for jargon in ("0.00 GB/s", "no estimate given"):
        assert jargon not in out
    assert "no recompute speed known" in out
    assert done.stderr.startswith("kvtier demo: serving 6 requests"), done.stderr    # progress: stderr


def test_json_is_stdout_alone_with_the_clock_kept_apart():
    done = kvtier(*SPLIT, *SMALL_DEMO, "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report["timing"]) >= {"seconds", "load_gbps", "backup_gbps", "emulated"}
    assert report["timing"]["emulated"] and "seconds" not in report and "load_gbps" not in report
    assert report["out_of_pages"] == 0 and report["requests"] == report["requests_planned"] == 6


def test_the_default_demo_prints_the_same_results_twice():
    first, second = (kvtier(*SPLIT) for _ in range(2))
    assert first.returncode == second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert results_part(first.stdout) == results_part(second.stdout)
    assert "load-backs declined" in first.stdout and "prefill saved" in first.stdout


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_json_results_repeat_but_for_the_clock(policy):
    runs = [kvtier(*SPLIT, "--hicache-write-policy", policy, "--hicache-write-through-threshold", "1", "--json")
            for _ in range(2)]
    reports = [json.loads(run.stdout) for run in runs]
    for report in reports:
        report.pop("timing")
    assert reports[0] == reports[1]
    assert reports[0]["pages_loaded"] > 0 and reports[0]["prefill_saved_tokens"] > 0


def test_the_storage_demo_repeats_in_a_fresh_store(tmp_path):
    """README's two-run line, twice over in two fresh stores: each run prints what its twin printed."""
    outputs = []
    for store in ("a", "b"):
        spec = f"file:{tmp_path / store}"
        pair = [kvtier(*SPLIT, *SMALL_DEMO, "--storage", spec) for _ in range(2)]
        assert all(run.returncode == 0 for run in pair), [run.stderr[-2000:] for run in pair]
        outputs.append([results_part(run.stdout) for run in pair])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]               # the second run of a pair is served from storage

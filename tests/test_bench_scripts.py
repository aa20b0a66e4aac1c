"""The bench scripts stay runnable: every one answers --help quickly with every option explained, refuses unknown
names with the choices, report.py renders results, and small runs complete on the emulator. Each runs in a
subprocess, as a user would start it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
HANG = 600
"""Seconds after which a run counts as hung: runs here take seconds, but the bound must hold on a loaded machine."""


def run(*args: str, timeout: float = HANG, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``args`` through this interpreter from the repository root; ``env``: variables added to this environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=BENCH.parent, env=None if env is None else {**os.environ, **env})


def test_every_script_is_covered():
    assert {"transfer.py", "report.py", "enqueue.py", "batch_limits.py"} <= set(SCRIPTS)


def test_every_script_is_documented():
    documented = (BENCH.parent / "docs" / "benchmarking.md").read_text()
    assert [s for s in SCRIPTS if f"`bench/{s}`" not in documented] == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_zero(script):
    done = run(str(BENCH / script), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and len(done.stdout.splitlines()) > 3


HEAVY = ("torch", "transformers")
HELP_PROBE = textwrap.dedent("""
    import argparse, json, runpy, sys
    script, report = sys.argv[1], sys.argv[2]
    parsers = []
    parse_args = argparse.ArgumentParser.parse_args

    def recording(self, *args, **kwargs):
        parsers.append(self)
        return parse_args(self, *args, **kwargs)

    argparse.ArgumentParser.parse_args = recording
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        pass
    options = [{"option": "/".join(a.option_strings) or a.dest, "help": a.help or "",
                "default": None if a.default in (None, False, [], argparse.SUPPRESS) else repr(a.default)}
               for p in parsers for a in p._actions if not isinstance(a, argparse._HelpAction)]
    with open(report, "w") as out:
        json.dump({"parsers": len(parsers), "options": options, "imported": sorted(sys.modules)}, out)
""")


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_before_heavy_imports_and_explains_every_option(script, tmp_path):
    """``--help`` parses before torch or transformers load (seconds each; e2e.py once took a minute to answer), and
    every option says what it does and, where it has one, its default."""
    report = tmp_path / "help.json"
    done = run("-c", HELP_PROBE, str(BENCH / script), str(report))
    assert done.returncode == 0, done.stderr
    found = json.loads(report.read_text())
    assert found["parsers"] >= 1, "the script parses no arguments"
    assert [m for m in HEAVY if m in found["imported"]] == []
    assert [o["option"] for o in found["options"] if not o["help"].strip()] == [], "options without help"
    assert [o["option"] for o in found["options"] if o["default"] and "default" not in o["help"]] == [], \
        "options whose help does not show their default"


@pytest.mark.parametrize("script, option", [("storage.py", "--sizes"), ("storage.py", "--stores"),
                                            ("storage.py", "--host-layouts"), ("cache.py", "--pairs"),
                                            ("transfer.py", "--geometry"), ("bidirectional.py", "--pairs")])
def test_an_unknown_name_is_refused_in_one_line_with_the_choices(script, option):
    done = run(str(BENCH / script), option, "no-such-name")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "no-such-name" in last and ("choose from" in last or "LOAD/BACKUP" in last), done.stderr


RESULTS = {
    "ceiling": {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "bidirectional_gbps": 100.0},
    "rows": [
        {"geometry": "g", "layout": "page_first", "backend": "kernel", "blocks": 2, "direction": "backup",
         "gbytes": 1.0, "gbps": 50.0, "pct": 90.9, "slots": "random", "layer_us": None, "sm_busy_pct": None},
        {"geometry": "g", "layout": "page_first", "backend": "kernel", "blocks": 2, "direction": "load",
         "gbytes": 1.0, "gbps": 44.0, "pct": 80.0, "slots": "random", "layer_us": 812.4, "sm_busy_pct": None},
        {"geometry": "g", "layout": "page_first", "backend": "staged", "blocks": 0, "direction": "backup",
         "gbytes": 1.0, "gbps": 53.0, "pct": 96.4, "slots": "contiguous", "layer_us": None, "sm_busy_pct": 4.2},
    ],
    "bidirectional": {"g": [{"backend": "staged", "blocks": 2, "gbps": 85.0, "pct": 85.0}]},
    "gemm": {"g": [{"blocks": 2, "gemm_ms_alone": 1.0, "gemm_ms_with_copy": 1.01, "slowdown_pct": 1.0}]},
}


def test_report_renders_results(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    done = run(str(BENCH / "report.py"), str(path))
    assert done.returncode == 0, done.stderr
    for text in ("H2D 55.0", "| geometry | layout | dir | kernel 2 SM | staged (contiguous slots) |",
                 "| g | page_first | backup | 50.0 (91%) | 53.0 (96%) |", "| g | page_first | 812 |",
                 "g page_first backup: 4.2%", "g staged: 85.0 GB/s (85% of both-ways ceiling)", "(+1.0%)"):
        assert text in done.stdout


@pytest.mark.parametrize("content, message", [(None, "cannot read"), ("{not json", "is not JSON"),
                                              ('{"rows": []}', "not bench/transfer.py output")])
def test_report_explains_a_bad_file(tmp_path, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    done = run(str(BENCH / "report.py"), str(path))
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


def test_quick_transfer_on_the_emulator(tmp_path):
    out = tmp_path / "transfer.json"
    done = run(str(BENCH / "transfer.py"), "--quick", "--runtime", "emulated:split", "--geometry", "stress-64B-p16",
               "--gib", "0.0005", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not speeds" in done.stdout
    data = json.loads(out.read_text())
    assert data["runtime"] == "emulated:split"
    assert {r["backend"] for r in data["rows"]} == {"kernel", "staged", "direct", "batch"}
    assert {r["layout"] for r in data["rows"]} == {"layer_first", "page_first", "page_first_direct", "page_head"}
    assert all(r["gbps"] > 0 for r in data["rows"])
    assert [r["backend"] for r in data["bidirectional"]["stress-64B-p16"]] == ["kernel", "staged"]
    assert all(every_unit_checked(r["verified"]) for r in data["rows"] + data["bidirectional"]["stress-64B-p16"])
    assert {r["verified"].get("copies", 1) for r in data["rows"] if r["layer_us"]} == {2}  # + the one-layer load


def test_transfer_variants_run_at_every_budget(tmp_path):
    """``--variants`` measures each specialization at every ``--blocks`` budget (the skip A/B needs 1 and 2 SMs)."""
    out = tmp_path / "variants.json"
    done = run(str(BENCH / "transfer.py"), "--runtime", "emulated:split", "--geometry", "dsv3-mla-p16", "--layout",
               "page_first", "--backend", "kernel", "--blocks", "1,2", "--variants", "8x1024+noskip", "--gib",
               "0.004", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    variant = [r for r in rows if r["backend"] == "kernel 8x1024+noskip"]
    assert {r["blocks"] for r in variant} == {1, 2} and all(r["gbps"] > 0 for r in variant)


def test_enqueue_on_the_emulator():
    done = run(str(BENCH / "enqueue.py"), "--runtime", "emulated:split", "--gib", "0.01")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not speeds" in done.stdout
    assert done.stdout.count("queued in") == 20  # 2 geometries x 2 backends x 5 loads


def test_bidirectional_on_the_emulator(tmp_path):
    out = tmp_path / "both.json"
    done = run(str(BENCH / "bidirectional.py"), "--runtime", "emulated:split", "--layout", "layer_first",
               "--pairs", "kernel/staged,staged/staged", "--queue", "both", "--pieces", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not speeds" in done.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["load"], r["backup"], r["queue"], r["slots"]) for r in rows] == [
        (load, backup, queue, slots) for load, backup in (("kernel", "staged"), ("staged", "staged"))
        for queue in ("one thread", "two threads") for slots in ("random", "contiguous")]
    assert all(r["both_gbps"] > 0 and r["load_ms"] > 0 and r["backup_ms"] > 0 for r in rows)
    assert all(0 < r["queued_ms"] <= max(r["load_ms"], r["backup_ms"]) for r in rows)
    assert all(every_unit_checked(r["verified"]) and r["verified"]["copies"] == 2 for r in rows)  # both ways
    pieces = data["pieces"]
    assert {p["mode"] for p in pieces} == {"H2D", "D2H", "both"} and all(p["gbps"] > 0 for p in pieces)
    assert all(every_unit_checked(p["verified"]) and p["verified"]["unit"] == "piece" for p in pieces)
    assert {(p["piece_bytes"], p["order"]) for p in pieces} >= {(32 << 10, "in order"), (32 << 10, "shuffled")}


def test_bidirectional_refuses_a_bad_pair():
    done = run(str(BENCH / "bidirectional.py"), "--runtime", "emulated:split", "--pairs", "kernel/direct")
    assert done.returncode == 2 and "LOAD/BACKUP" in done.stderr


def test_sglang_compat_on_the_emulator(tmp_path):
    out = tmp_path / "compat.json"
    done = run(str(BENCH / "sglang_compat.py"), "--runtime", "emulated:split", "--geometry", "dsv3-mla-p16",
               "--json", str(out), "--profile", "transfer_kv_per_layer_mla_pf_lf")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not speeds" in done.stdout
    assert "profile of transfer_kv_per_layer_mla_pf_lf: 5 rounds of 61 compat call(s)" in done.stdout
    assert "kvcacheio.py" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["function"] for r in rows} == {
        "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla",
        "transfer_kv_per_layer_mla", "transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_per_layer_direct_pf_lf"}
    assert all(r["compat_gbps"] > 0 and r["engine_gbps"] > 0 for r in rows)
    assert all(r["calls"] == (61 if "per_layer" in r["function"] else 1) and r["compat_call_us"] > 0 for r in rows)
    # each side on its own: engine and compat, and the engine a launch per layer for per-layer functions
    assert all(every_unit_checked(r["verified"]) and r["verified"]["copies"] == (3 if "per_layer" in r["function"]
                                                                                 else 2) for r in rows)


def test_dma_queue_on_the_emulator(tmp_path):
    out = tmp_path / "dma.json"
    done = run(str(BENCH / "dma_queue.py"), "--runtime", "emulated:split", "--copies", "16", "--repeats", "1",
               "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 * 2 * 2 * 2 and all(r["queue_us_per_copy"] > 0 and r["gbps"] > 0 for r in rows)
    assert {r["mode"] for r in rows} == {"batch", "one call each"}


def test_sglang_storage_small_run(tmp_path):
    """kvtier's file store and SGLang's own file backend on the same pages of SGLang's real host pool, with the plain
    file ceiling: every row timed, every page read back byte for byte."""
    from helpers.sglang import need_sglang

    need_sglang()
    out = tmp_path / "sglang.json"
    done = run(str(BENCH / "sglang_storage.py"), "--stores", "file", "--sglang", "file", "--tokens", "512",
               "--repeats", "1", "--dir", str(tmp_path / "store"), "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert (data["tokens"], data["pages"], data["page_bytes"]) == (512, 8, 8 << 20)
    rows = {r["backend"]: r for r in data["rows"]}
    assert set(rows) == {"kvtier", "SGLang file", "plain file (ceiling)"}
    assert all(r["set_gbps"] > 0 and r["get_gbps"] > 0 and r["verified"] for r in rows.values())
    assert rows["plain file (ceiling)"]["role"] == "ceiling"
    assert rows["kvtier"]["checks_on_read"] == "header + xxh3-128"
    assert rows["SGLang file"]["checks_on_read"] == "nothing"
    assert [(g["backend"], g["against"]) for g in data["goals"]] == [("kvtier", "SGLang file")]
    assert data["failures"] == []
    assert "kvtier / SGLang file" in done.stdout


def test_disagg_on_the_emulator(tmp_path):
    """Two processes, a tiny request, every page verified; a device source staged through host memory too."""
    from helpers.mooncake import need_mooncake

    need_mooncake()
    out = tmp_path / "disagg.json"
    done = run(str(BENCH / "disagg.py"), "--runtime", "emulated:split", "--tokens", "256", "--repeats", "1",
               "--pairs", "page_first/page_first,page_first/layer_first,device/page_head", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["pair"] for r in data["rows"]] == ["page_first/page_first", "page_first/layer_first",
                                                 "device/page_head"]
    assert [r["converts"] for r in data["rows"]] == [False, True, True]
    assert all(r["kvtier_gbps"] > 0 and r["mooncake_gbps"] > 0 and r["verified_pages"] == 16 for r in data["rows"])
    assert data["machine"]["cores"] >= 1 and "kvtier / Mooncake" in done.stdout


def test_vllm_connector_scheduler_side_runs_on_the_cpu(tmp_path):
    from helpers.vllm_engine import need_vllm

    need_vllm()
    out = tmp_path / "vllm.json"
    done = run(str(BENCH / "vllm_connector.py"), "--scheduler", "--running", "8", "--steps", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"no connector", "with kvtier"}
    assert rows["with kvtier"]["connector_us_per_request"] > 0 == rows["no connector"]["connector_us_per_request"]


# -- every benchmark checks the bytes it timed (bench/_verify.py) ----------------------------------------------------
VERIFIED_RUNS = {
    "transfer.py": ["--quick", "--runtime", "emulated:split", "--geometry", "stress-64B-p16", "--gib", "0.0005"],
    "bidirectional.py": ["--runtime", "emulated:split", "--layout", "layer_first", "--pairs", "staged/staged"],
    "sglang_compat.py": ["--runtime", "emulated:split", "--geometry", "dsv3-mla-p16"],
    "families.py": ["--runtime", "emulated:split", "--blocks", "1"],
    "small_loads.py": ["--runtime", "emulated:split", "--geometry", "dsv3-mla-p16", "--pages", "1,4", "--repeats",
                       "1"],
    "cache.py": ["--runtime", "emulated:split", "--no-control", "--data", "--data-tokens", "64", "--repeats", "2",
                 "--pairs", "kernel/staged"],
    "e2e.py": ["--tiny", "--runtime", "emulated:unified", "--lengths", "256", "--suffixes", "16", "--repeats", "1",
               "--logits", "", "--no-storage"],
}
"""Small emulator runs of the scripts whose timed copies are checked afterwards."""


def every_unit_checked(check: dict) -> bool:
    """A ``verified`` record of a small run: every unit moved was compared, and some were."""
    return 0 < check["checked"] == check["of"] and check["bytes"] > 0


def test_family_transfers_and_swap_ins_are_verified(tmp_path):
    out = tmp_path / "families.json"
    done = run(str(BENCH / "families.py"), *VERIFIED_RUNS["families.py"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {r["unit"] for r in data["rows"]} == {"slot", "page", "token"}
    assert all(every_unit_checked(r["verified"]) and r["verified"]["unit"] == r["unit"] for r in data["rows"])
    assert [s["verified"]["checked"] for s in data["swap_in"]] == [s["top_k"] for s in data["swap_in"]]


def test_small_loads_are_verified(tmp_path):
    out = tmp_path / "small.json"
    done = run(str(BENCH / "small_loads.py"), *VERIFIED_RUNS["small_loads.py"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 4 and all(r["verified"]["checked"] == r["pages"] for r in rows)


def test_cache_data_plane_is_verified_on_the_emulator(tmp_path):
    """The load-back, and the load-back and backup of the both-ways rows: three checked copies per pair."""
    out = tmp_path / "cache.json"
    done = run(str(BENCH / "cache.py"), *VERIFIED_RUNS["cache.py"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["data"]["rows"]
    assert [r["verified"] for r in rows] == ["12/12 pages in 3 copies"]


def test_e2e_first_tokens_all_equal_the_device_hit(tmp_path):
    """The CPU smoke run (no peer row: it needs CUDA) checks every timed run's first token."""
    out = tmp_path / "e2e.json"
    done = run(str(BENCH / "e2e.py"), *VERIFIED_RUNS["e2e.py"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["row"] != "gather"]
    assert {r["row"] for r in rows} >= {"recompute", "torch device hit", "kvtier host, overlap"}
    assert len({r["verified"]["first_token"] for r in rows}) == 1
    assert all(r["verified"]["equals"] == "torch device hit" and r["verified"]["runs"] == 1 for r in rows)


@pytest.mark.parametrize("script", sorted(VERIFIED_RUNS))
def test_a_planted_wrong_copy_fails_the_run_in_one_line(script):
    """``KVTIER_BENCH_PLANT=1`` flips one byte of one destination after the timed copies (e2e.py: one first token):
    the check catches it, and the run ends with status 1 and one line that names the row, not a traceback."""
    done = run(str(BENCH / script), *VERIFIED_RUNS[script], env={"KVTIER_BENCH_PLANT": "1"})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: verification failed: "), done.stderr[-2000:]
    assert ("has 1 of" in last and "bytes unlike its source" in last) if script != "e2e.py" else \
        "(planted)" in last, last


CONTROL_RUN = ["--page-sizes", "16", "--lengths", "1024", "--conversations", "8", "--repeats", "2"]
"""A small control-plane run of bench/cache.py (every subject, every case, one page size)."""


def sglang_radix_caches_missing() -> str | None:
    """Why SGLang's radix caches cannot run in a bench here (None when they can), asked as the bench asks."""
    probe = "import sys; sys.path.insert(0, 'bench'); import _radix_peers as p; print('missing:', p.sglang_missing())"
    done = run("-c", probe)
    said = [line for line in done.stdout.splitlines() if line.startswith("missing: ")]
    if done.returncode or not said:
        return f"the probe failed: {done.stderr[-500:]}"
    return None if said[-1] == "missing: None" else said[-1].removeprefix("missing: ")


def test_the_control_plane_runs_beside_sglangs_radix_caches_and_their_answers_agree(tmp_path):
    missing = sglang_radix_caches_missing()
    if missing:
        if os.environ.get("KVTIER_REQUIRE_SGLANG"):
            pytest.fail(f"KVTIER_REQUIRE_SGLANG is set: {missing}")
        pytest.skip(missing)
    out = tmp_path / "control.json"
    done = run(str(BENCH / "cache.py"), *CONTROL_RUN, "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    names = {"kvtier KVCache", "kvtier index alone", "SGLang RadixCache (Python)", "SGLang UnifiedRadixCache (Rust)"}
    rows = data["control"]
    assert {r["case"] for r in rows} >= {"insert, empty index", "match hit, populated", "match cold (miss)"}
    assert all(set(r["cpu_ms"]) == names or r["case"].startswith("evict") for r in rows)
    assert all(set(r["answers"]) <= {1024, None} for r in rows if "hit" in r["case"])
    assert [r["page"] for r in data["keys"]] == [16] and len(data["keys"][0]["ms"]) == 2


def test_a_planted_wrong_answer_fails_the_control_plane_in_one_line():
    done = run(str(BENCH / "cache.py"), *CONTROL_RUN, "--no-sglang", env={"KVTIER_BENCH_PLANT": "1"})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cache.py: verification failed: insert, empty index, page 16") and "(planted)" in last


def load_verify_module():
    """bench/_verify.py, imported from its file (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_verify", BENCH / "_verify.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module             # while it runs: its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_verify_compares_every_unit_of_a_small_copy_and_a_spread_sample_of_a_large_one():
    verify = load_verify_module()
    small = np.arange(10)
    assert verify.checked_positions(small, 1 << 20).tolist() == list(range(10))
    dst = np.random.default_rng(0).permutation(4096)
    picked = verify.checked_positions(dst, 1 << 20)               # 4 GiB: sampled
    assert picked[0] == 0 and picked[-1] == 4095 and verify.SAMPLE <= picked.size <= verify.SAMPLE + 2
    assert {int(dst.argmin()), int(dst.argmax())} <= set(picked.tolist())
    assert np.diff(picked).max() <= 2 * 4096 // verify.SAMPLE     # spread over the whole copy


def test_verify_names_the_unit_that_differs_and_how_many_bytes():
    verify = load_verify_module()
    memory = verify.random_bytes(8 * 64)
    source, destination = verify.flat_host(memory, 0, 64), verify.flat_host(memory, 4 * 64, 64)
    verify.poison(destination, [0, 1, 2, 3])
    assert (memory[4 * 64:] == verify.POISON).all()
    memory[4 * 64:] = memory[:4 * 64][np.r_[3 * 64:4 * 64, 0:3 * 64]]     # pieces 3, 0, 1, 2 copied to 0..3
    check = verify.verify("row", destination, [0, 1, 2, 3], source, [3, 0, 1, 2])
    assert check == {"unit": "piece", "checked": 4, "of": 4, "bytes": 256}
    memory[4 * 64 + 2 * 64 + 5] ^= 1
    with pytest.raises(verify.Mismatch) as failed:
        verify.verify("row", destination, [0, 1, 2, 3], source, [3, 0, 1, 2])
    assert str(failed.value).endswith("verification failed: row: host piece 2 (from host piece 1) has 1 of 64 bytes "
                                      "unlike its source; 1 of 4 checked pieces differ, 1 bytes in all")
    verify.poison(source, [1])
    with pytest.raises(verify.Mismatch, match="source host piece 1 holds no data"):
        verify.verify("row", destination, [2], source, [1])


def test_the_planted_wrong_copy_is_caught_once(monkeypatch):
    verify = load_verify_module()
    memory = verify.random_bytes(2 * 64)
    memory[64:] = memory[:64]
    source, destination = verify.flat_host(memory, 0, 64), verify.flat_host(memory, 64, 64)
    monkeypatch.setenv(verify.PLANT, "1")
    with pytest.raises(verify.Mismatch, match="has 1 of 64 bytes unlike its source"):
        verify.verify("row", destination, [0], source, [0])
    memory[64:] = memory[:64]
    assert verify.verify("row", destination, [0], source, [0])["checked"] == 1    # one plant a run


def test_same_answers_names_the_row_that_differs():
    """e2e.py's first-token check: every timed run of every row answers what the reference row answered first."""
    verify = load_verify_module()
    assert verify.same_answers("prefix", {"device hit": [5, 5], "host": [5, 5], "peer": [5]}, "device hit") == 5
    with pytest.raises(verify.Mismatch, match="row 'host' answered 7 in 1 of 2 timed runs, 'device hit' answered 5"):
        verify.same_answers("prefix", {"device hit": [5, 5], "host": [5, 7]}, "device hit")
    with pytest.raises(verify.Mismatch, match="no answers from the reference row"):
        verify.same_answers("prefix", {"host": [5]}, "device hit")


# -- bench/storage.py: every contender's bytes verified; a planted wrong copy fails the run ---------------------------
def storage_run(tmp_path: Path, stores: str, plant: bool) -> subprocess.CompletedProcess[str]:
    """A tiny bench/storage.py run (32 pages of 2 MiB per row, one repeat, no prefetch rows), JSON in tmp_path."""
    return run(str(BENCH / "storage.py"), "--stores", stores, "--sizes", "llama3-8b-p16", "--mib", "1", "--repeats",
               "1", "--prefetch-tokens", "0", "--dir", str(tmp_path / "store"),
               "--json", str(tmp_path / "storage.json"), env={"KVTIER_BENCH_PLANT": "1" if plant else "0"})


def test_storage_small_run_names_each_rows_ceiling_and_verifies_every_contender(tmp_path):
    import shutil

    redis = shutil.which("redis-server") is not None
    done = storage_run(tmp_path, "file,redis" if redis else "file", plant=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no mismatch" in done.stdout
    data = json.loads((tmp_path / "storage.json").read_text())
    assert data["verified"] is True
    rows = {(r["store"], r["op"], r["cache"]): r for r in data["rows"]}
    assert set(rows) == {("file", "set", ""), ("file", "get", "warm"), ("file", "get", "cold")} | (
        {("redis", "set", ""), ("redis", "get", "")} if redis else set())
    for r in rows.values():
        assert r["gbps"] > 0 and r["ceiling"] and r["ceiling_gbps"] > 0 and r["pct"] > 0
        assert r["verified"] == "every byte, every call"
        assert all(ref["gbps"] > 0 and ref["verified"] for ref in r["references"])
    file_roles = {ref["role"] for ref in rows["file", "get", "warm"]["references"]}
    assert file_roles == {"ceiling", "typical user", "medium bound"}
    assert rows["file", "set", ""]["ceiling"].startswith("pwritev, a file per page")
    if redis:
        get = rows["redis", "get", ""]
        assert get["ceiling"].startswith("raw RESP, kvtier's requests")
        assert {"ceiling", "typical user", "previous kvtier path"} <= {ref["role"] for ref in get["references"]}


def test_storage_run_with_a_planted_wrong_copy_fails_naming_it(tmp_path):
    done = storage_run(tmp_path, "file", plant=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("storage.py: verification failed:") and "differs from the source" in last
    assert not (tmp_path / "storage.json").exists()


def test_sglang_kernels_side_says_why_it_is_absent_without_cuda():
    sys.path.insert(0, str(BENCH))
    try:
        import _sglang_kernels
    finally:
        sys.path.remove(str(BENCH))
    reason = _sglang_kernels.load()
    assert isinstance(reason, str) and "CUDA" in reason

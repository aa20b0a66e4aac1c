"""``kvtier demo`` and the cache's rate table from the command line."""

from __future__ import annotations

import json

import pytest

from kvtier.cache import H200_TABLE, PairRate, RateTable
from kvtier.cli import main
from kvtier.errors import InvalidArgument


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("runtime_name", ["emulated:split", "emulated:unified"])
def test_demo_serves_right_bytes_and_saves_prefill(runtime_name, policy, tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = main(["--runtime", runtime_name, "demo", "--users", "4", "--turns", "3", "--system-tokens", "256",
                 "--user-tokens", "64", "--reply-tokens", "32", "--hicache-write-policy", policy,
                 "--hicache-write-through-threshold", "1", "--save", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads(out.read_text()) == report
    assert report["requests"] == 12 and report["mismatched_pages"] == 0
    assert report["pages_checked"] == report["pages_loaded"] > 0          # every loaded page was checked
    assert report["host_hit_rate"] > 0 and report["device_hit_rate"] > 0
    assert report["prefill_saved_tokens"] > 0
    assert report["prefill_tokens"] + (report["device_hit_rate"] + report["host_hit_rate"]) * \
        report["prompt_tokens"] == pytest.approx(report["prompt_tokens"])


def test_demo_table_names_what_users_look_for(capsys):
    assert main(["--runtime", "emulated:split", "demo", "--users", "2", "--turns", "2", "--system-tokens", "64",
                 "--user-tokens", "32", "--reply-tokens", "16"]) == 0
    text = capsys.readouterr().out
    for words in ("hit rate", "prefill saved", "loaded back", "backed up", "declined", "byte for byte"):
        assert words in text


def test_demo_declines_load_backs_slower_than_recompute(capsys):
    assert main(["--runtime", "emulated:split", "demo", "--users", "3", "--turns", "3", "--system-tokens", "128",
                 "--user-tokens", "64", "--reply-tokens", "32", "--prefill-tokens-per-s", "1e12",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["declined_slower_than_recompute"] > 0 and report["pages_loaded"] == 0


def test_doctor_writes_a_rate_table_the_demo_reads(tmp_path, capsys):
    path = tmp_path / "rates.json"
    assert main(["--runtime", "emulated:split", "doctor", "--probe-mib", "2", "--no-bandwidth",
                 "--cache-rates", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    table = RateTable.load(path)
    assert {(r.load, r.backup) for r in table.rows} >= {("kernel", "kernel"), ("staged", "staged")}
    assert all(r.load_gbps > 0 and r.backup_gbps > 0 and r.both_gbps for r in table.rows)
    assert report["cache_rates"]["rows"]
    assert main(["--runtime", "emulated:split", "demo", "--users", "2", "--turns", "2", "--system-tokens", "64",
                 "--user-tokens", "32", "--reply-tokens", "16", "--hicache-rate-table", str(path), "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    best = table.best_pair()
    assert (chosen["load_backend"], chosen["backup_backend"]) == (best.load, best.backup)


def test_auto_prefers_layerwise_loads():
    assert (H200_TABLE.best_pair().load, H200_TABLE.best_pair().backup) == ("kernel", "kernel")
    table = RateTable([PairRate("staged", "staged", 60, 60, 110, layerwise=False),
                       PairRate("kernel", "staged", 40, 60, 70, layerwise=True)])
    assert table.best_pair().load == "kernel"
    with pytest.raises(InvalidArgument):
        RateTable([]).best_pair()


def test_a_broken_rate_table_is_refused(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text('{"rows": [{"load": "kernel"}]}')
    with pytest.raises(InvalidArgument, match="rate table"):
        RateTable.load(path)


def test_a_rate_table_with_bad_fields_is_refused(tmp_path, capsys):
    path = tmp_path / "rates.json"
    path.write_text('{"rows": [{"load": "kernel", "backup": "kernel", "load_gbps": "fast", "backup_gbps": 48}]}')
    with pytest.raises(InvalidArgument, match="bad row"):
        RateTable.load(path)
    assert main(["--runtime", "emulated:split", "demo", "--hicache-rate-table", str(path)]) == 2
    assert "rate table" in capsys.readouterr().err

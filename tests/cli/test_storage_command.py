"""``kvtier demo --storage`` (a second run is served from storage) and ``kvtier storage ls/stats/clear``; a bad spec
is one line on stderr and exit code 2 from the real command, and makes nothing."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
from helpers.cli import Running, kvtier
from helpers.storage import GEOMETRY, namespace

from kvtier.cache import page_keys
from kvtier.cli import main
from kvtier.storage import open_store

DEMO = ["--runtime", "emulated:split", "demo", "--users", "3", "--turns", "2", "--system-tokens", "256",
        "--user-tokens", "64", "--reply-tokens", "32", "--json"]


def spec_of(kind: str, tmp_path, request) -> str:
    """A store of ``kind`` for the command line (servers of the session's fixtures)."""
    if kind == "file":
        return f"file:{tmp_path / 'store'}"
    return request.getfixturevalue({"redis": "redis_url", "redis-cluster": "redis_cluster_url",
                                    "mooncake": "mooncake_spec"}[kind])


@pytest.mark.parametrize("kind", ["file", "redis", "mooncake"])
def test_a_second_demo_run_is_served_from_storage(kind, tmp_path, capsys, request):
    spec = spec_of(kind, tmp_path, request)
    seed = str(np.random.default_rng().integers(1 << 30))     # fresh tokens: nothing of an earlier test hits
    first_code = main([*DEMO, "--seed", seed, "--storage", spec])
    first = json.loads(capsys.readouterr().out)
    second_code = main([*DEMO, "--seed", seed, "--storage", spec])
    second = json.loads(capsys.readouterr().out)
    assert first_code == second_code == 0
    assert first["storage_pages_written"] > 0 and first["mismatched_pages"] == second["mismatched_pages"] == 0
    assert second["storage_pages_read"] > 0 and second["storage_hit_rate"] > 0.2
    assert second["prefill_tokens"] < first["prefill_tokens"] / 2, (first, second)
    assert second["pages_checked"] == second["pages_loaded"] > 0          # what came from storage was checked
    if kind != "file":
        assert main(["storage", "clear", spec, "--all"]) == 0


def test_demo_with_a_store_that_is_down_still_serves(capsys):
    code = main([*DEMO, "--storage", "redis://127.0.0.1:1/0"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["mismatched_pages"] == 0 and report["storage_errors"] >= 1
    assert report["storage_pages_read"] == 0 and report["prefill_saved_tokens"] > 0


@pytest.mark.parametrize("kind", ["file", "redis", "redis-cluster", "mooncake"])
def test_operators_list_total_and_clear(kind, tmp_path, capsys, request):
    spec = spec_of(kind, tmp_path, request)
    ns = namespace(model="operators/test")
    with open_store(spec, ns) as store:
        keys = page_keys(ns, np.arange(7 * GEOMETRY.page_size))
        store.set(keys, [[np.random.default_rng().integers(1, 256, GEOMETRY.bytes_per_page, dtype=np.uint8)]
                         for _ in keys])
    assert main(["storage", "ls", spec, "--json"]) == 0
    rows = {r["namespace"]: r for r in json.loads(capsys.readouterr().out)}
    mine = rows[store.namespace_id]
    assert mine["model"] == "operators/test" and mine["pages"] == 7 and mine["tenant"] == ns.tenant
    assert main(["storage", "ls", spec]) == 0
    assert store.namespace_id in capsys.readouterr().out
    assert main(["storage", "ls", spec, "--namespace", store.namespace_id]) == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()) == sorted(k.hex() for k in keys)
    assert main(["storage", "stats", spec, "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)
    assert totals["pages"] >= 7
    if kind == "mooncake":                              # the master's own count of the memory it holds
        assert totals["allocated_bytes"] >= totals["bytes"] > 0 and totals["capacity_bytes"] > 0
    assert main(["storage", "clear", spec, "--namespace", store.namespace_id]) == 0
    assert "removed 7 pages" in capsys.readouterr().out
    assert main(["storage", "clear", spec, "--namespace", "nothex"]) == 2
    assert "16 lowercase hex digits" in capsys.readouterr().err


def refused_in_one_line(done: subprocess.CompletedProcess[str], command: str, words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith(f"kvtier {command}: ") and words in done.stderr, done.stderr


TINY_DEMO = ["--runtime", "emulated:split", "demo", "--users", "1", "--turns", "1", "--system-tokens", "64",
              "--user-tokens", "16", "--reply-tokens", "16"]


@pytest.mark.parametrize("spec, words", [
    ("file:/proc/nope", "file store /proc/nope: cannot make /proc/nope: No such file or directory"),
    ("bogus:x", "storage spec 'bogus:x': unknown scheme 'bogus'"),
    ("store", "storage spec 'store' has no scheme: for a directory write file:store"),
    ("redis://127.0.0.1:1/notanumber", "the path '/notanumber' must be a database number"),
    ("mooncake://127.0.0.1:1?protocol=udp", "protocol='udp'; expected one of tcp, rdma"),
])
def test_demo_with_a_bad_storage_spec_is_one_line_and_makes_nothing(tmp_path, spec, words):
    refused_in_one_line(kvtier(*TINY_DEMO, "--storage", spec, cwd=tmp_path), "demo", words)
    assert list(tmp_path.iterdir()) == [], "a refused spec made something"


@pytest.mark.parametrize("spec, words", [
    ("bogus:x", "unknown scheme 'bogus'"),
    ("/tmp/kvtier-store", "has no scheme: for a directory write file:/tmp/kvtier-store"),
    ("unix://", "unix:// needs the socket's path"),
    ("redis+cluster://127.0.0.1:1/3", "a cluster URL takes no path"),
    ("redis://127.0.0.1:1/0?socket_timeout=soon", "socket_timeout='soon': expected a finite number of seconds"),
    ("rediss://127.0.0.1:1/0?ssl_ca_certs=/nonexistent.pem", "ssl_ca_certs='/nonexistent.pem': expected no such"),
    ("file:{tmp}/a-file", "file store {tmp}/a-file: not a directory"),
])
def test_storage_ls_with_a_bad_spec_is_one_line_and_makes_nothing(tmp_path, spec, words):
    (tmp_path / "a-file").write_text("x")
    spec, words = spec.format(tmp=tmp_path), words.format(tmp=tmp_path)
    refused_in_one_line(kvtier("storage", "ls", spec, cwd=tmp_path), "storage", words)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_an_unreachable_store_with_a_password_is_reported_without_it(capsys):
    assert main(["storage", "stats", "redis://kv:s3cret@127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier storage: redis://kv:***@127.0.0.1:1/0: ConnectionError") and "s3cret" not in err


def test_listing_a_mooncake_store_without_its_admin_endpoint_is_one_line(mooncake_spec, tmp_path):
    refused_in_one_line(kvtier("storage", "ls", mooncake_spec.split("&admin=")[0], cwd=tmp_path), "storage",
                        "add ?admin=http://MASTER_HOST:9003")


def test_an_unreachable_mooncake_master_is_one_line_and_quick(tmp_path):
    started = time.monotonic()
    refused_in_one_line(kvtier("storage", "stats", "mooncake://127.0.0.1:1?admin=http://127.0.0.1:1", cwd=tmp_path),
                        "storage", "the Mooncake master is unreachable: 127.0.0.1:1")
    assert time.monotonic() - started < 20


def test_an_unreachable_store_is_one_line_from_the_cli(capsys):
    assert main(["storage", "stats", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier storage: redis://127.0.0.1:1/0: ConnectionError") and "Traceback" not in err


def test_a_demo_whose_mooncake_master_is_killed_midway_serves_right_kv_and_recovers(mooncake_servers, tmp_path):
    servers = mooncake_servers
    report = tmp_path / "report.json"
    demo = Running("--runtime", "emulated:split", "demo", "--users", "8", "--turns", "8", "--system-tokens", "1024",
                   "--user-tokens", "64", "--reply-tokens", "32", "--storage", servers.spec, "--save", str(report))
    try:
        demo.wait_for("serving")
        time.sleep(1.0)
        servers.stop_master()
        code, _, err = demo.finish()
    finally:
        demo.kill()
    assert code == 0 and "Traceback" not in err, err[-2000:]
    seen = json.loads(report.read_text())
    assert seen["mismatched_pages"] == 0 and seen["storage_errors"] >= 1, seen
    assert "mooncake" in err.lower(), "the outage is said on stderr"
    servers.start_master()
    servers.wait_segment()
    seed = str(np.random.default_rng().integers(1 << 30))
    runs = [kvtier(*DEMO, "--seed", seed, "--storage", servers.spec, cwd=tmp_path) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr[-2000:]
    first, second = (json.loads(run.stdout) for run in runs)
    assert first["storage_pages_written"] > 0 and second["storage_pages_read"] > 0
    assert first["mismatched_pages"] == second["mismatched_pages"] == 0

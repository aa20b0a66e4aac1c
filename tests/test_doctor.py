"""kvtier doctor: runs on every runtime and its verdict matches what the platform does."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main


def _report(capsys, spec, *extra):
    assert main(["--runtime", spec, "doctor", "--json", "--probe-mib", "8", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("spec, separate", [("emulated:split", True), ("emulated:unified", False)])
def test_doctor_verdict_matches_the_mode(capsys, spec, separate):
    report = _report(capsys, spec)
    assert report["runtime"] == spec and len(report["devices"]) == 2
    kinds = {k["kind"]: k for k in report["host_buffers"]}
    for kind in ("pinned", "registered", "shm"):
        assert kinds[kind]["ok"] and kinds[kind]["device_accessible"]
        assert set(kinds[kind]["alias_equals_cpu"].values()) == {not separate}
    assert kinds["pageable"]["ok"] and not kinds["pageable"]["device_accessible"]
    assert kinds["hugetlb"]["ok"] or "vm.nr_hugepages" in kinds["hugetlb"]["error"]
    assert ("separate device aliases" in report["verdict"][0]) == separate
    assert report["bandwidth"] is None


def test_doctor_tables(capsys):
    assert main(["--runtime", "emulated:split", "doctor", "--probe-mib", "4"]) == 0
    out = capsys.readouterr().out
    for text in ("Devices", "Host buffers", "Verdict", "separate device aliases", "registered"):
        assert text in out


def test_runtime_flag_after_the_command(capsys):
    assert main(["doctor", "--runtime", "emulated:unified", "--json", "--probe-mib", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == "emulated:unified"


def test_unknown_runtime_is_a_clear_error(capsys):
    assert main(["--runtime", "tpu", "doctor"]) == 2
    assert "unknown runtime 'tpu'" in capsys.readouterr().err


@pytest.mark.gpu
def test_doctor_on_cuda(capsys, cuda):
    report = _report(capsys, "cuda")
    assert report["devices"][0]["can_use_host_pointer_for_registered_mem"] in (True, False)
    bandwidth = report["bandwidth"]
    assert bandwidth["h2d_gbps"] > 1 and bandwidth["d2h_gbps"] > 1 and bandwidth["bidirectional_gbps"] > 1
    same = report["devices"][0]["can_use_host_pointer_for_registered_mem"]
    registered = next(k for k in report["host_buffers"] if k["kind"] == "registered")
    assert set(registered["alias_equals_cpu"].values()) == {same}


@pytest.mark.parametrize("argv, match", [
    (["doctor", "--probe-mib", "0"], "kvtier doctor: --probe-mib must be positive"),
    (["--runtime", "emulated:split:x", "doctor"], "kvtier doctor: bad runtime")])
def test_bad_arguments_are_named_with_the_command_prefix(capsys, argv, match):
    assert main(argv) == 2
    assert match in capsys.readouterr().err

"""kvtier doctor: runs on every runtime and its verdict matches what the platform does."""

from __future__ import annotations

import json
import types

import pytest
from helpers.cli import kvtier

from kvtier.cli import main
from kvtier.errors import RuntimeUnavailable


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


class _NoDeviceCudart:
    """cuda-bindings' runtime as a machine without a usable GPU answers: no device, for ``status``."""

    def __init__(self, status: int, name: bytes, driver: int, runtime: int = 13050) -> None:
        self.cudaError_t = types.SimpleNamespace(cudaSuccess=0)
        self.status, self.name, self.driver, self.runtime = status, name, driver, runtime

    def cudaGetDeviceCount(self):  # noqa: N802 (the driver's names)
        return self.status, 0

    def cudaGetErrorName(self, status):  # noqa: N802
        return 0, self.name

    def cudaGetErrorString(self, status):  # noqa: N802
        return 0, b"CUDA driver version is insufficient for CUDA runtime version"

    def cudaDriverGetVersion(self):  # noqa: N802
        return 0, self.driver

    def cudaRuntimeGetVersion(self):  # noqa: N802
        return 0, self.runtime


@pytest.mark.parametrize("driver, says", [
    (0, "no NVIDIA driver found"),
    (12020, "the NVIDIA driver supports CUDA 12.2, older than the CUDA 13.5 runtime of cuda-bindings: update the "
            "driver, or install cuda-bindings 12.x")])
def test_a_missing_driver_and_an_old_one_are_told_apart(monkeypatch, driver, says):
    import kvtier.runtime.cuda as cuda_module

    fake = _NoDeviceCudart(35, b"cudaErrorInsufficientDriver", driver)
    monkeypatch.setattr(cuda_module, "_bindings", lambda: fake)
    with pytest.raises(RuntimeUnavailable) as caught:
        cuda_module.CudaRuntime()
    assert says in str(caught.value) and "insufficient" not in str(caught.value)


def test_cuda_doctor_without_a_driver_says_no_driver_was_found():
    """This machine's case (no NVIDIA driver), through the real command and the real cuda-bindings."""
    bindings = pytest.importorskip("cuda.bindings.runtime")
    if bindings.cudaDriverGetVersion()[1]:
        pytest.skip("an NVIDIA driver is installed here")
    done = kvtier("--runtime", "cuda", "doctor", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier doctor: cuda runtime unusable on this machine (no NVIDIA "
                                                   "driver found"), lines
    assert "insufficient" not in lines[0]

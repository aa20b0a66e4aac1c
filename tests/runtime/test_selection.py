"""Runtime selection: explicit spec, environment, automatic fallback, clear errors."""

from __future__ import annotations

import pytest
from helpers.runtimes import cuda_runtime

from kvtier.errors import RuntimeUnavailable
from kvtier.runtime import create, get


def test_env_var_and_spec(monkeypatch):
    monkeypatch.setenv("KVTIER_RUNTIME", "emulated:unified")
    assert get().name == "emulated:unified"
    assert get("emulated:split").name == "emulated:split"
    assert get("emulated:split") is get("emulated:split")
    assert create("emulated:split:4").device_count() == 4


def test_auto_picks_cuda_only_when_usable(monkeypatch):
    monkeypatch.delenv("KVTIER_RUNTIME", raising=False)
    expected = "cuda" if cuda_runtime() is not None else "emulated:split"
    assert get().name == expected


@pytest.mark.parametrize("spec", ["tpu", "emulated:sideways", "emulated:split:0", "cuda:3"])
def test_bad_specs(spec):
    with pytest.raises(RuntimeUnavailable):
        create(spec)


def test_cuda_without_a_gpu_is_a_clear_error():
    if cuda_runtime() is not None:
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeUnavailable, match="cuda runtime"):
        create("cuda")

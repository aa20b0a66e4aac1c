"""Fixtures of the vLLM connector's tests: vLLM's scheduler and a model-runner stand-in over the emulated runtime
(split and unified), built per test and closed after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import vllm_engine as ve


@pytest.fixture
def vllm() -> None:
    """vLLM's own modules (a skip without them, a failure in CI)."""
    ve.need_vllm()


@pytest.fixture(params=["emulated:split", "emulated:unified"])
def engines(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch, vllm: None
            ) -> Iterator[Callable[..., Any]]:
    """``engines(extra, **config)``: a VllmHarness of vLLM's scheduler and kvtier's connector with ``extra`` as the
    connector's extra config; every one is closed after the test."""
    monkeypatch.setenv("KVTIER_RUNTIME", request.param)
    made: list[Any] = []

    def build(extra: dict[str, Any] | None = None, *, blocks: int = 96, model: str = "model", mla: bool = False,
              **config: Any) -> Any:
        """``model``: the directory name of the model (another name is another model, with the same shape)."""
        options = {"host_tokens": 2048, "io_backend": "direct", **(extra or {})}
        (tmp_path / model).mkdir(exist_ok=True)
        engine = ve.VllmHarness(ve.vllm_config(ve.model_dir(tmp_path / model), options, **config), blocks=blocks,
                                mla=mla)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.close()


@pytest.fixture
def written(engines: Callable[..., Any]) -> Callable[..., Any]:
    """``written(store, tokens)``: an instance that served ``tokens`` once with ``store`` behind it (so the store
    holds their whole blocks); returns it."""

    def write(store: str, tokens: list[int]) -> Any:
        writer = engines({"store": store})
        writer.add(ve.request(tokens))
        writer.run()
        return writer

    return write

"""kvtier calls transformers through its current API: README's transformers example and a request's own forward emit
no FutureWarning or DeprecationWarning (newer transformers renamed ``past_key_values`` to ``cache``; kvtier passes
the cache under the name the model's forward takes)."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.models import emulated, forward, tiny_llama  # noqa: E402
from helpers.paths import ROOT  # noqa: E402

README = (ROOT / "README.md").read_text()


@contextlib.contextmanager
def deprecations_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_readme_transformers_example_uses_no_deprecated_api():
    section = README.split("### With transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    with deprecations_are_errors():
        exec(compile(code, "README.md (With transformers)", "exec"), {})


def test_a_request_cache_passed_under_the_models_keyword_uses_no_deprecated_api():
    model = tiny_llama()
    ids = torch.randint(0, 1000, (1, 40))
    with deprecations_are_errors(), contextlib.closing(emulated(model)) as generation:
        for _ in range(2):
            with generation.request(ids) as request:
                forward(generation, ids[:, request.cached_tokens:], request.cache)
                request.finish()
        assert generation.turns[-1].device_tokens == 32

"""A placeholder for torchvision, put on ``sys.path`` by the test session (``helpers.sglang.place_torchvision``) only
where torchvision is not installed and SGLang is: SGLang's host-pool modules import every model config, one of which
imports ``torchvision.transforms`` at module level, and PyPI's torchvision is a CUDA build that does not import beside
the CPU build of torch. Nothing the tests run calls it; every name it is asked for is a placeholder object."""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.28.0"                              # the release that goes with torch 2.13


class Placeholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:
        return Placeholder()

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder()


for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops",
              "models", "utils", "datasets"):
    _module = PlaceholderModule(f"{__name__}.{_name}")
    _module.__path__ = []
    sys.modules[_module.__name__] = _module
    if "." not in _name:
        setattr(sys.modules[__name__], _name, _module)
sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
sys.modules["torchvision.transforms"].v2 = sys.modules["torchvision.transforms.v2"]
sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder()

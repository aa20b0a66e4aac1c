"""``is_hip``: whether torch is a ROCm build (the one function SGLang's kvcacheio test imports from SGLang)."""

import torch


def is_hip() -> bool:
    return torch.version.hip is not None

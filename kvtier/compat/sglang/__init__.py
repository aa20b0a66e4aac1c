"""SGLang compatibility: ``from kvtier.compat.sglang import kvcacheio`` in place of ``from sgl_kernel import
kvcacheio`` (see docs/sglang.md)."""

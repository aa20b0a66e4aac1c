"""Drop-in replacements for other projects' KV transfer APIs, built on kvtier's resolver and launch boundary.

``kvtier.compat.sglang.kvcacheio`` has the functions of SGLang's ``sgl_kernel.kvcacheio``. :class:`DeviceArray` stands
in for a CUDA tensor where torch has none (the emulated runtime), so the same calls run in CI.
"""

from kvtier.compat.device_array import DeviceArray

__all__ = ["DeviceArray"]

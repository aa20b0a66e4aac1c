"""``sgl_kernel.kvcacheio`` as kvtier provides it: the thirteen functions of ``kvtier.compat.sglang.kvcacheio``."""

from kvtier.compat.sglang.kvcacheio import *  # noqa: F403
from kvtier.compat.sglang.kvcacheio import __all__  # noqa: F401

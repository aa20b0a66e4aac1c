"""Moving KV between kvtier's device pages and torch tensors in transformers' ``[batch, heads, seq, dim]`` layout.

A device page holds ``page_size`` tokens of one layer's K (or V) as ``[tokens, kv_heads, head_dim]``; attention takes
``[1, heads, seq, dim]`` per layer. ``gather`` copies the pages once, whole (one ``index_select`` of page-sized
rows into a ``[1, seq, heads, dim]`` tensor, which runs near HBM speed), leaves room for the new tokens so the suffix is
placed without a second copy of the prefix (``DynamicLayer`` would ``cat`` it again), and returns the
``[1, heads, seq, dim]`` view of it. Attention reads any strides but the last: ``repeat_kv`` (GQA with a mask)
copies K and V anyway, and the flash kernels want ``[seq, heads, dim]`` rows, which this layout already is. A
head-major gather (256-byte rows) moved only 1.07 TB/s on the H200; ``bench/e2e.py`` reports this one's rate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool


class PagedKV:
    """The pool's pages as torch tensors. A pool made from torch tensors (CUDA) is indexed directly; any other (the
    emulated runtime's) is copied page by page through the runtime, then moved to ``device``."""

    def __init__(self, pool: DevicePool, dtype: Any, device: Any, tensors: list[list[Any]] | None = None) -> None:
        self.pool, self.dtype, self.device, self.tensors = pool, dtype, device, tensors
        g = pool.geometry
        self.page_size, self.heads = g.page_size, g.heads
        self.head_dim = g.head_bytes // itemsize(dtype)

    @property
    def on_device(self) -> bool:
        """Whether the pages are torch tensors the model's kernels read in place (CUDA)."""
        return self.tensors is not None

    def index(self, pages: np.ndarray) -> Any:
        """``pages`` as the index tensor ``gather`` and ``write`` take (uploaded once per request)."""
        import torch

        index = torch.as_tensor(np.ascontiguousarray(pages, dtype=np.int64))
        return index.to(self.device, non_blocking=True) if self.on_device else index

    def gather(self, layer: int, index: Any, key_states: Any, value_states: Any) -> tuple[Any, Any]:
        """K and V of the pages in ``index`` followed by ``key_states`` / ``value_states`` (``[1, heads, new, dim]``),
        as new contiguous ``[1, heads, cached + new, dim]`` tensors, on the current stream."""
        return (self._gather(0, layer, index, key_states), self._gather(1, layer, index, value_states))

    def write(self, layer: int, index: Any, keys: Any, values: Any) -> None:
        """Store ``[1, heads, tokens, dim]`` K and V (whole pages of tokens) into the pages in ``index``."""
        for t, states in enumerate((keys, values)):
            rows = states[0].transpose(0, 1).reshape(len(index), self.page_size, self.heads, self.head_dim)
            if self.tensors is not None:
                self._pages(t, layer).index_copy_(0, index, rows.to(self.dtype))
            else:
                self._host_copy(t, layer, index, rows.to("cpu", self.dtype).contiguous(), to_device=True)

    def _gather(self, t: int, layer: int, index: Any, states: Any) -> Any:
        import torch

        cached = len(index) * self.page_size
        out = torch.empty((1, cached + states.shape[-2], self.heads, self.head_dim), dtype=self.dtype,
                          device=states.device)
        prefix = out[0, :cached].view(len(index), self.page_size, self.heads, self.head_dim)
        if self.tensors is not None:
            torch.index_select(self._pages(t, layer), 0, index, out=prefix)
        else:
            self._host_copy(t, layer, index, prefix, to_device=False)
        out[0, cached:] = states[0].transpose(0, 1)
        return out.transpose(1, 2)

    def _pages(self, t: int, layer: int) -> Any:
        assert self.tensors is not None
        return self.tensors[t][layer].view(self.pool.pages, self.page_size, self.heads, self.head_dim)

    def _host_copy(self, t: int, layer: int, index: Any, rows: Any, *, to_device: bool) -> None:
        """Emulated pools: copy whole pages between ``rows`` (CPU, ``[pages, tokens, heads, dim]``) and the pool."""
        import torch

        g = self.pool.geometry
        raw = rows.view(torch.uint8).numpy().reshape(len(index), -1)
        base = self.pool.layer_device_addresses(t)[layer]
        for i, page in enumerate(index.tolist()):
            host, device = CpuAddress(raw[i].ctypes.data), base + int(page) * g.page_bytes
            src, dst = (host, device) if to_device else (device, host)
            self.pool.runtime.memcpy(dst, src, g.page_bytes)
        self.pool.runtime.synchronize(self.pool.device)


def itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()

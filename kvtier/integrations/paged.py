"""Moving KV between kvtier's device pages and torch tensors in transformers' ``[batch, heads, seq, dim]`` layout.

A device page holds ``page_size`` tokens of one layer's K (or V) as ``[tokens, kv_heads, head_dim]``; attention takes
``[batch, heads, seq, dim]`` per layer. ``gather`` copies each row's pages once, whole (one ``index_select`` of
page-sized rows into a ``[batch, seq, heads, dim]`` tensor, which runs near HBM speed), leaves room for the new tokens
so the suffix is placed without a second copy of the prefix (``DynamicLayer`` would ``cat`` it again), and returns the
``[batch, heads, seq, dim]`` view of it. Attention reads any strides but the last: ``repeat_kv`` (GQA with a mask)
copies K and V anyway, and the flash kernels want ``[seq, heads, dim]`` rows, which this layout already is. A
head-major gather (256-byte rows) moved only 1.07 TB/s on the H200; ``bench/e2e.py`` reports this one's rate.

A row's ``CachedRow`` says what it reads: left padding (zeros; the attention mask hides them, so any value serves),
then its prompt's cached tokens. The rows of one prompt (its beams, its samples) read its pages once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool


@dataclass(frozen=True)
class CachedRow:
    """What one batch row of a request's cache holds before the model adds to it: ``pad`` positions of left padding,
    then the first ``tokens`` tokens of the pages in ``index`` (an index tensor from ``PagedKV.index``). Every row of
    a cache has one ``length``; rows of one ``prompt`` read the same pages."""

    prompt: int
    pad: int
    tokens: int
    index: Any

    @property
    def length(self) -> int:
        return self.pad + self.tokens


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

    def gather(self, layer: int, rows: Sequence[CachedRow] | Any, key_states: Any, value_states: Any
               ) -> tuple[Any, Any]:
        """K and V of what ``rows`` hold followed by ``key_states`` / ``value_states`` (``[rows, heads, new, dim]``),
        as ``[rows, heads, length + new, dim]`` views of new contiguous tensors, on the current stream. ``rows``: a
        ``CachedRow`` per batch row, or an index tensor (one row: those whole pages)."""
        if not isinstance(rows, list | tuple):
            rows = [CachedRow(0, 0, len(rows) * self.page_size, rows)]
        return (self._gather(0, layer, rows, key_states), self._gather(1, layer, rows, value_states))

    def write(self, layer: int, index: Any, keys: Any, values: Any) -> None:
        """Store ``[1, heads, tokens, dim]`` K and V (whole pages of tokens) into the pages in ``index``."""
        for t, states in enumerate((keys, values)):
            rows = states[0].transpose(0, 1).reshape(len(index), self.page_size, self.heads, self.head_dim)
            if self.tensors is not None:
                self._pages(t, layer).index_copy_(0, index, rows.to(self.dtype))
            else:
                self._host_copy(t, layer, index, rows.to("cpu", self.dtype).contiguous(), to_device=True)

    def _gather(self, t: int, layer: int, rows: Sequence[CachedRow], states: Any) -> Any:
        import torch

        length = rows[0].length
        out = torch.empty((len(rows), length + states.shape[-2], self.heads, self.head_dim), dtype=self.dtype,
                          device=states.device)
        first: dict[int, int] = {}                      # prompt -> the row that read its pages
        for r, row in enumerate(rows):
            out[r, :row.pad].zero_()
            if not row.tokens:
                continue
            cached = out[r, row.pad:length]
            if row.prompt in first:
                cached.copy_(out[first[row.prompt], row.pad:length])
            else:
                self._read(t, layer, row.index, cached)
                first[row.prompt] = r
        out[:, length:] = states.transpose(1, 2)
        return out.transpose(1, 2)

    def _read(self, t: int, layer: int, index: Any, into: Any) -> None:
        """The first ``len(into)`` tokens of the pages in ``index`` into ``into`` (``[tokens, heads, dim]``): straight
        into it when they are whole pages, else through a page-sized buffer."""
        import torch

        shape = (len(index), self.page_size, self.heads, self.head_dim)
        whole = len(index) * self.page_size == into.shape[0]
        pages = into.view(shape) if whole else torch.empty(shape, dtype=self.dtype, device=into.device)
        if self.tensors is not None:
            torch.index_select(self._pages(t, layer), 0, index, out=pages)
        else:
            self._host_copy(t, layer, index, pages, to_device=False)
        if not whole:
            into.copy_(pages.view(-1, self.heads, self.head_dim)[:into.shape[0]])

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

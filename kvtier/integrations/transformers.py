"""Hugging Face transformers with kvtier's cache behind it: the KV of prompts seen before is served from the device
tier, or loaded back from host memory (or storage), instead of being recomputed.

``KVTierGeneration`` wraps a causal LM and a ``KVCache`` whose geometry matches the model (one MHA page holds
``page_size`` tokens of every layer's K and V, ``[tokens, kv_heads, head_dim]`` per layer and tensor, the layout
kvtier's device pools use). Per request it matches the prompt's prefix, loads a host-tier part back, hands
transformers a ``DynamicCache`` holding the prefix (its own ``[batch, heads, seq, dim]`` layout: one gather per layer
from the pool's pages), lets ``model.generate`` compute the rest, and inserts the new whole pages so the next turn
hits. The output is the model's own: greedy generation gives the same tokens with or without kvtier.

This first version fills the prefix before the forward pass (the CPU waits for each layer of a load-back); the
layer-wise overlap inside attention comes next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.cache import CacheSettings, KVCache, Namespace, OutOfPages
from kvtier.errors import InvalidArgument
from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime


def geometry_of(config: Any, page_size: int, dtype: Any) -> KVGeometry:
    """The KV geometry of a transformers decoder config (MHA / GQA) whose KV is kept in ``dtype``."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVGeometry.mha(layers=config.num_hidden_layers, kv_heads=heads, head_dim=head_dim,
                          itemsize=_itemsize(dtype), page_size=page_size)


class PagedKV:
    """Moves the KV of whole pages between a device pool and torch tensors in transformers' layout. A pool made from
    torch tensors (CUDA) is indexed directly; any other (the emulated runtime's) is copied page run by page run."""

    def __init__(self, pool: DevicePool, dtype: Any, device: Any, tensors: list[list[Any]] | None = None) -> None:
        self.pool, self.dtype, self.device, self.tensors = pool, dtype, device, tensors
        g = pool.geometry
        self.heads, self.head_dim = g.heads, g.head_bytes // _itemsize(dtype)

    def read(self, layer: int, pages: np.ndarray) -> tuple[Any, Any]:
        """K and V of ``pages`` (in order) as ``[1, heads, tokens, head_dim]``."""
        return self._read(0, layer, pages), self._read(1, layer, pages)

    def write(self, layer: int, pages: np.ndarray, keys: Any, values: Any) -> None:
        """Store ``[1, heads, tokens, head_dim]`` K and V (whole pages of tokens) into ``pages``."""
        for t, states in enumerate((keys, values)):
            self._write(t, layer, pages, states)

    def _pages_view(self, tensor: Any) -> Any:
        g = self.pool.geometry
        return tensor.view(self.pool.pages, g.page_size, self.heads, self.head_dim)

    def _read(self, t: int, layer: int, pages: np.ndarray) -> Any:
        import torch

        g = self.pool.geometry
        tokens = len(pages) * g.page_size
        if self.tensors is not None:
            index = torch.as_tensor(pages, device=self.device, dtype=torch.long)
            rows = self._pages_view(self.tensors[t][layer]).index_select(0, index)
        else:
            rows = torch.empty((len(pages), g.page_size, self.heads, self.head_dim), dtype=self.dtype)
            host = rows.view(torch.uint8).numpy().reshape(len(pages), -1)
            base = self.pool.layer_device_addresses(t)[layer]
            for i, page in enumerate(pages):
                self.pool.runtime.memcpy(CpuAddress(host[i].ctypes.data), base + int(page) * g.page_bytes,
                                         g.page_bytes)
            self.pool.runtime.synchronize(self.pool.device)
            rows = rows.to(self.device)
        return rows.reshape(tokens, self.heads, self.head_dim).transpose(0, 1).unsqueeze(0)

    def _write(self, t: int, layer: int, pages: np.ndarray, states: Any) -> None:
        import torch

        g = self.pool.geometry
        rows = states[0].transpose(0, 1).reshape(len(pages), g.page_size, self.heads, self.head_dim)
        if self.tensors is not None:
            index = torch.as_tensor(pages, device=self.device, dtype=torch.long)
            self._pages_view(self.tensors[t][layer]).index_copy_(0, index, rows.to(self.dtype))
            return
        host = rows.to("cpu", self.dtype).contiguous()
        raw = host.view(torch.uint8).numpy().reshape(len(pages), -1)
        base = self.pool.layer_device_addresses(t)[layer]
        for i, page in enumerate(pages):
            self.pool.runtime.memcpy(base + int(page) * g.page_bytes, CpuAddress(raw[i].ctypes.data), g.page_bytes)
        self.pool.runtime.synchronize(self.pool.device)


@dataclass
class Turn:
    """What one ``generate`` call found: prompt tokens, tokens served from the device tier, loaded back from host
    memory (or storage, through a prefetch), and computed."""

    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    computed_tokens: int


class KVTierGeneration:
    """``generate`` for a transformers causal LM with a kvtier cache behind it. Build with :meth:`build` (it makes the
    pools and the cache for the model) or pass a ``KVCache`` whose geometry matches the model."""

    def __init__(self, model: Any, cache: KVCache, paged: PagedKV, owned: tuple[Any, ...] = ()) -> None:
        """``owned``: pools this object made (``build``) and closes after the cache."""
        self.model, self.cache, self.paged = model, cache, paged
        self.turns: list[Turn] = []
        self.skipped_inserts = 0
        """Turns whose new pages could not be had (locked or in flight): their output stands, uncached."""
        self._owned = owned

    @classmethod
    def build(cls, model: Any, *, device_tokens: int, host_tokens: int, page_size: int = 16,
              runtime: Runtime | str | None = None, settings: CacheSettings | None = None, storage: Any = None,
              model_id: str | None = None) -> KVTierGeneration:
        import torch

        runtime = get_runtime(runtime) if not isinstance(runtime, Runtime) else runtime
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        geometry = geometry_of(model.config, page_size, dtype)
        pages = -(-device_tokens // page_size)
        if runtime.name == "cuda":
            if device.type != "cuda":
                raise InvalidArgument(f"the model is on {device}; the cuda runtime needs it on a CUDA device")
            tensors = [[torch.empty((pages * page_size, geometry.heads, geometry.head_bytes // _itemsize(dtype)),
                                    dtype=dtype, device=device) for _ in range(geometry.layers)] for _ in range(2)]
            pool = DevicePool.from_tensors(geometry, tensors, runtime=runtime)
        else:
            tensors = None
            pool = DevicePool.allocate(geometry, pages, 0, runtime=runtime)
        host = HostPool.allocate(geometry, "page_first", tokens=host_tokens, kind="pinned", runtime=runtime)
        namespace = Namespace(model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type,
                              geometry, str(dtype).replace("torch.", ""))
        settings = settings or CacheSettings(calibrate=False, load_back_min_tokens=0)
        cache = KVCache(pool, host, namespace, settings, storage=storage)
        return cls(model, cache, PagedKV(pool, dtype, device, tensors), owned=(pool, host))

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate`` for one sequence (``[1, tokens]``), with the cached prefix served by kvtier and the new
        whole pages inserted afterwards. ``kwargs`` go to ``model.generate``."""
        import torch
        from transformers import DynamicCache

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgument(f"generate takes one sequence, shape [1, tokens]; got {tuple(input_ids.shape)}")
        tokens = input_ids[0].detach().cpu().numpy()
        page = self.cache.page_size
        if self.cache.storage is not None:
            self.cache.prefetch(tokens[:-1]).settle()
        match = self.cache.match_prefix(tokens[:-1], lock=True)  # at least one token is left to compute
        try:
            prefix = match.device_pages
            load = self.cache.load_back(match)
            if load is not None:
                prefix = load.prefix_pages
            for op in match.pending:
                op.wait()
            past = DynamicCache(config=self.model.config)
            for layer in range(self.cache.geometry.layers):
                if load is not None:
                    load.wait_layer(layer)
                if len(prefix):
                    keys, values = self.paged.read(layer, prefix)
                    past.update(keys, values, layer)
            with torch.no_grad():
                output = self.model.generate(input_ids, past_key_values=past, **kwargs)
            cached = len(prefix) * page
            self.turns.append(Turn(len(tokens), match.device_tokens, cached - match.device_tokens,
                                   len(tokens) - cached))
            self._insert(output[0].detach().cpu().numpy(), prefix, past)
        finally:
            self.cache.unlock(match)
        return output

    def _insert(self, sequence: np.ndarray, prefix: np.ndarray, past: Any) -> None:
        page = self.cache.page_size
        stored = past.get_seq_length()
        whole = min(stored, len(sequence)) // page
        whole = min(whole, self.cache.device.pages)        # a sequence longer than the pool keeps what fits
        if whole <= len(prefix):
            return
        try:
            new = self.cache.allocate(whole - len(prefix))
        except OutOfPages:                                  # the output stands; this turn is just not cached
            self.skipped_inserts += 1
            return
        start, end = len(prefix) * page, whole * page
        for layer, states in enumerate(past.layers):
            self.paged.write(layer, new, states.keys[:, :, start:end], states.values[:, :, start:end])
        self.cache.insert(sequence[:end], np.concatenate([prefix, new]))

    def close(self) -> None:
        self.cache.close()
        for pool in reversed(self._owned):
            pool.close()


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()

"""Hugging Face transformers with kvtier's cache behind it: the KV of prompts seen before is served from the device
tier, or loaded back from host memory (or storage), instead of being recomputed.

``KVTierGeneration`` wraps a causal LM and a ``KVCache`` whose geometry matches the model. Per request it matches the
prompt's prefix, queues the load-back of its host-tier part (one event per layer), and hands the model a
``KVTierCache``: a transformers ``Cache`` whose layers hold no tensors yet, only the pages to read. The attention of
layer i calls ``update(…, i)``; only then does the layer make the compute stream wait, *on the GPU*, for layer i's
load, and gather its pages into the ``[batch, heads, seq, dim]`` tensor attention reads. So layer 0 computes while
layers 1… are still crossing the link, and the time to first token approaches the larger of the two, not their sum.
After the request, the new whole pages are inserted so the next turn hits. The output is the model's own: greedy
generation gives the same tokens with or without kvtier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers.cache_utils import Cache, DynamicLayer

from kvtier.cache import CacheSettings, KVCache, LoadBack, Match, Namespace, OutOfPages
from kvtier.errors import InvalidArgument
from kvtier.integrations.paged import PagedKV, itemsize
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime
from kvtier.storage import open_store

Fill = Callable[[Any, Any], tuple[Any, Any]]


def geometry_of(config: Any, page_size: int, dtype: Any) -> KVGeometry:
    """The KV geometry of a transformers decoder config (MHA / GQA, every layer full attention) kept in ``dtype``."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise InvalidArgument(f"kvtier serves full-attention layers only; this model has layer types {sorted(kinds)}")
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVGeometry.mha(layers=config.num_hidden_layers, kv_heads=heads, head_dim=head_dim,
                          itemsize=itemsize(dtype), page_size=page_size)


class KVTierLayer(DynamicLayer):
    """A ``DynamicLayer`` whose first ``cached_tokens`` come from kvtier pages. They are read when attention first
    updates the layer (``fill`` waits for the layer's load, then gathers), so its length is known before its bytes
    are; anything else that needs the tensors reads them first."""

    def __init__(self, cached_tokens: int = 0, fill: Fill | None = None) -> None:
        super().__init__()
        self.cached_tokens, self._fill = cached_tokens, fill if cached_tokens else None

    @property
    def pending(self) -> bool:
        return self._fill is not None

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self._fill is None:
            return super().update(key_states, value_states, *args, **kwargs)
        fill, self._fill = self._fill, None
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = fill(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cached_tokens if self._fill is not None else super().get_seq_length()

    def settle(self) -> None:
        """Read the cached tokens now, if attention has not (an empty update)."""
        if self._fill is None:
            return
        fill, self._fill = self._fill, None
        self.keys, self.values = fill(None, None)
        self.dtype, self.device, self.is_initialized = self.keys.dtype, self.keys.device, True

    def crop(self, tokens_to_remove: int) -> None:
        self.settle()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: Any) -> None:
        self.settle()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.settle()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: Any) -> None:
        self.settle()
        super().batch_select_indices(indices)


class KVTierCache(Cache):
    """The transformers ``Cache`` of one request, one ``KVTierLayer`` per model layer (``kvtier_layers``, typed)."""

    def __init__(self, layers: list[KVTierLayer]) -> None:
        self.kvtier_layers = list(layers)
        super().__init__(layers=list(self.kvtier_layers))

    def settle(self) -> None:
        for layer in self.kvtier_layers:
            layer.settle()


@dataclass
class Turn:
    """What one request found: prompt tokens, tokens served from the device tier, loaded back from host memory (or
    storage, through a prefetch), and computed."""

    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    computed_tokens: int


class Request:
    """One prompt's use of the kvtier cache. Give ``cache`` to the model (``forward`` with the uncached
    ``input_ids[:, cached_tokens:]``, or ``generate`` with all of them), then ``finish(sequence)`` to insert the new
    whole pages of the tokens the model saw, or ``release()`` to insert nothing. Holds the match locked until then."""

    def __init__(self, owner: KVTierGeneration, tokens: np.ndarray, match: Match, load: LoadBack | None,
                 prefix: np.ndarray, overlap: bool) -> None:
        self._owner, self.tokens, self.match, self.load, self.prefix = owner, tokens, match, load, prefix
        paged, page_size = owner.paged, owner.cache.page_size
        self.cached_tokens = len(prefix) * page_size
        self.turn = Turn(len(tokens), match.device_tokens, self.cached_tokens - match.device_tokens,
                         len(tokens) - self.cached_tokens)
        self._index = paged.index(prefix)
        if not overlap:
            self._wait()
        layers = [KVTierLayer(self.cached_tokens, self._filler(layer) if self.cached_tokens else None)
                  for layer in range(owner.cache.geometry.layers)]
        self.cache = KVTierCache(layers)
        self._open = True

    def _filler(self, layer: int) -> Fill:
        def fill(key_states: Any, value_states: Any) -> tuple[Any, Any]:
            self._wait(layer)
            if key_states is None:
                key_states = value_states = self._empty()
            return self._owner.paged.gather(layer, self._index, key_states, value_states)
        return fill

    def _wait(self, layer: int | None = None) -> None:
        """Order what follows after the loads this request reads (all of them, or one layer's): on the GPU when the
        pages are the model's tensors, else on the CPU."""
        loads = list(self.match.pending) + ([self.load] if self.load is not None else [])
        if self._owner.paged.on_device:
            import torch

            stream = torch.cuda.current_stream(self._owner.paged.device)
            for op in loads:
                op.stream_wait(stream, layer=layer)
        else:
            for op in loads:
                op.wait() if layer is None else op.wait_layer(layer)

    def _empty(self) -> Any:
        import torch

        paged = self._owner.paged
        return torch.empty((1, paged.heads, 0, paged.head_dim), dtype=paged.dtype, device=paged.device)

    def finish(self, sequence: Any = None) -> int:
        """Insert the new whole pages of ``sequence`` (default: the prompt), whose KV the cache now holds (at least
        up to its last token but one), and unlock. Returns the tokens newly cached (0 when none could be had)."""
        if not self._open:
            return 0
        try:
            tokens = self.tokens if sequence is None else _tokens_of(sequence)
            return self._owner._insert(tokens, self.prefix, self.cache)
        finally:
            self.release()

    def release(self) -> None:
        """Unlock without inserting (idempotent)."""
        if self._open:
            self._open = False
            self._owner.cache.unlock(self.match)

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class KVTierGeneration:
    """``generate`` for a transformers causal LM with a kvtier cache behind it. Build with :meth:`build` (it makes the
    pools and the cache for the model) or pass a ``KVCache`` whose geometry matches the model."""

    def __init__(self, model: Any, cache: KVCache, paged: PagedKV, owned: tuple[Any, ...] = ()) -> None:
        """``owned``: pools this object made (``build``) and closes after the cache."""
        if cache.geometry != paged.pool.geometry:
            raise InvalidArgument("the cache and the paged view must share one device pool geometry")
        self.model, self.cache, self.paged = model, cache, paged
        self.turns: list[Turn] = []
        self.skipped_inserts = 0
        """Requests whose new pages could not be had (locked or in flight): their output stands, uncached."""
        self._owned = owned

    @classmethod
    def build(cls, model: Any, *, device_tokens: int, host_tokens: int, page_size: int = 16,
              runtime: Runtime | str | None = None, settings: CacheSettings | None = None, storage: Any = None,
              model_id: str | None = None) -> KVTierGeneration:
        """Pools for ``device_tokens`` on the model's device and ``host_tokens`` of pinned host memory, in the model's
        dtype, and a cache over them. The host pool is ``page_first_direct`` (each page's layer one contiguous
        piece) and loads use the copy engines (``direct``): one layer of a run of pages is one strided copy, at the
        link's ceiling, with an event per layer. ``settings`` default: that, and load back whatever is cached (no
        recompute estimate). ``storage``: a spec
        (``file:PATH``, ``redis://…``; opened for this model's namespace and closed with this object) or a backend
        opened for that namespace."""
        import torch

        runtime = get_runtime(runtime) if not isinstance(runtime, Runtime) else runtime
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        geometry = geometry_of(model.config, page_size, dtype)
        pages = -(-device_tokens // page_size)
        if runtime.name == "cuda":
            if device.type != "cuda":
                raise InvalidArgument(f"the model is on {device}; the cuda runtime needs it on a CUDA device")
            tensors = [[torch.empty((pages * page_size, geometry.heads, geometry.head_bytes // itemsize(dtype)),
                                    dtype=dtype, device=device) for _ in range(geometry.layers)] for _ in range(2)]
            pool = DevicePool.from_tensors(geometry, tensors, runtime=runtime)
        else:
            tensors = None
            pool = DevicePool.allocate(geometry, pages, 0, runtime=runtime)
        try:
            host = HostPool.allocate(geometry, "page_first_direct", tokens=host_tokens, kind="pinned",
                                     runtime=runtime)
        except BaseException:
            pool.close()
            raise
        namespace = Namespace(model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type,
                              geometry, str(dtype).replace("torch.", ""))
        settings = settings or CacheSettings(calibrate=False, load_back_min_tokens=0, load_backend="direct")
        owned: tuple[Any, ...] = (pool, host)
        try:
            if isinstance(storage, str):
                storage = open_store(storage, namespace)
                owned += (storage,)
            cache = KVCache(pool, host, namespace, settings, storage=storage)
        except BaseException:
            for resource in reversed(owned):
                resource.close()
            raise
        return cls(model, cache, PagedKV(pool, dtype, device, tensors), owned=owned)

    def request(self, input_ids: Any, *, overlap: bool = True) -> Request:
        """Match ``input_ids`` (``[1, tokens]``) in the cache, queue the load-back of its host part, and return the
        request whose ``cache`` serves the prefix to the model. ``overlap=False`` makes the model wait for the whole
        load before its first layer (copy, then compute). At least the last token is left to compute."""
        tokens = _tokens_of(input_ids)
        if self.cache.storage is not None:
            self.cache.prefetch(tokens[:-1]).settle()
        match = self.cache.match_prefix(tokens[:-1], lock=True)
        try:
            load = self.cache.load_back(match)
            prefix = load.prefix_pages if load is not None else match.device_pages
            request = Request(self, tokens, match, load, prefix, overlap)
        except BaseException:
            self.cache.unlock(match)
            raise
        self.turns.append(request.turn)
        return request

    def generate(self, input_ids: Any, *, overlap: bool = True, **kwargs: Any) -> Any:
        """``model.generate`` for one sequence (``[1, tokens]``), with the cached prefix served by kvtier and the new
        whole pages inserted afterwards. ``kwargs`` go to ``model.generate``."""
        import torch

        with self.request(input_ids, overlap=overlap) as request:
            with torch.no_grad():
                output = self.model.generate(input_ids, past_key_values=request.cache, **kwargs)
            request.finish(output)
        return output

    def _insert(self, sequence: np.ndarray, prefix: np.ndarray, past: KVTierCache) -> int:
        page = self.cache.page_size
        past.settle()
        stored = past.get_seq_length()
        whole = min(stored, len(sequence)) // page
        whole = min(whole, self.cache.device.pages)        # a sequence longer than the pool keeps what fits
        if whole <= len(prefix):
            return 0
        try:
            new = self.cache.allocate(whole - len(prefix))
        except OutOfPages:                                  # the output stands; this request is just not cached
            self.skipped_inserts += 1
            return 0
        start, end = len(prefix) * page, whole * page
        index = self.paged.index(new)
        for layer, states in enumerate(past.kvtier_layers):
            assert states.keys is not None and states.values is not None
            self.paged.write(layer, index, states.keys[:, :, start:end], states.values[:, :, start:end])
        self.cache.insert(sequence[:end], np.concatenate([prefix, new]))
        return end - start

    def close(self) -> None:
        """Close the cache, then what ``build`` made (idempotent)."""
        self.cache.close()
        for resource in reversed(self._owned):
            resource.close()


def _tokens_of(input_ids: Any) -> np.ndarray:
    shape = tuple(getattr(input_ids, "shape", ()))
    if len(shape) != 2 or shape[0] != 1:
        raise InvalidArgument(f"kvtier serves one sequence at a time, shape [1, tokens]; got {shape}")
    if shape[1] < 1:
        raise InvalidArgument("the prompt is empty")
    return np.asarray(input_ids[0].detach().cpu().numpy(), dtype=np.int64)

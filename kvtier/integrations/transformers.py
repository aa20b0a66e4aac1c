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
    """The KV geometry of a transformers decoder config (MHA / GQA / MQA, every layer full attention) kept in
    ``dtype``. Latent-attention (MLA) models and K and V of different head sizes are refused: a kvtier MHA page holds
    K and V of one shape. ``KVTierGeneration.build`` takes the geometry from the model's own cache instead."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise InvalidArgument(f"kvtier serves full-attention layers only; this model has layer types {sorted(kinds)}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", head_dim) != head_dim:
        raise InvalidArgument(f"{config.model_type}: latent attention (MLA) or K and V of different head sizes; "
                              "kvtier's transformers integration serves MHA / GQA / MQA KV only")
    multi_query = getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False)
    heads = 1 if multi_query else (getattr(config, "num_key_value_heads", None)
                                   or getattr(config, "num_kv_heads", None) or config.num_attention_heads)
    return KVGeometry.mha(layers=config.num_hidden_layers, kv_heads=heads, head_dim=head_dim,
                          itemsize=itemsize(dtype), page_size=page_size)


def checked_geometry(model: Any, page_size: int, dtype: Any) -> KVGeometry:
    """The geometry of the K and V the model's own cache holds after a one-token forward (configs name their KV
    heads in several ways; the cache does not), after ``geometry_of`` has refused what kvtier cannot page."""
    import torch
    from transformers import DynamicCache

    geometry_of(model.config, page_size, dtype)
    probe = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device), past_key_values=probe)
    shapes = [(tuple(keys.shape), tuple(values.shape)) for keys, values in
              ((getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in probe.layers)
              if keys is not None and values is not None]
    kinds = set(shapes)
    if len(kinds) != 1 or len(shapes) != len(probe.layers) or shapes[0][0] != shapes[0][1] or \
            len(shapes[0][0]) != 4:
        raise InvalidArgument(f"{model.config.model_type}: the model's own cache holds K/V shaped "
                              f"{sorted(kinds)[:3]} over {len(shapes)} of {len(probe.layers)} layers; kvtier pages "
                              "one K and V shape for every layer")
    _, heads, _, head_dim = shapes[0][0]
    return KVGeometry.mha(layers=len(shapes), kv_heads=heads, head_dim=head_dim, itemsize=itemsize(dtype),
                          page_size=page_size)


def namespace_of(model: Any, geometry: KVGeometry | int = 16, model_id: str | None = None) -> Namespace:
    """The namespace ``KVTierGeneration.build`` keys this model's pages by (open a storage backend with it to pass
    one in): ``model_id`` (default: the config's ``_name_or_path``, else its model type) plus a hash of a sample of
    the weights, the KV geometry (or its page size, the rest read from the model) and the dtype."""
    dtype = next(model.parameters()).dtype
    if not isinstance(geometry, KVGeometry):
        geometry = checked_geometry(model, geometry, dtype)
    name = model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type
    return Namespace(f"{name}@{model_fingerprint(model)}", geometry, str(dtype).replace("torch.", ""))


def model_fingerprint(model: Any) -> str:
    """A short hash of a sample of the weights (the first 4,096 elements of up to 8 tensors spread over the
    model), so two models of one name or type with other weights never share stored pages."""
    import xxhash

    parameters = list(model.parameters())
    digest = xxhash.xxh3_64()
    for tensor in parameters[::max(1, len(parameters) // 8)][:8]:
        sample = tensor.detach().reshape(-1)[:4096].float().cpu().numpy()
        digest.update(sample.tobytes())
    return digest.hexdigest()


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
        if key_states.shape[0] != 1:
            raise InvalidArgument(f"this cache holds one sequence but the forward has {key_states.shape[0]} rows: "
                                  "expand it first (cache.batch_repeat_interleave(rows))")
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

    def batch_rows(self) -> int:
        """Rows the cache holds now (1, or more after beam search / several samples expanded it)."""
        keys = self.kvtier_layers[0].keys if self.kvtier_layers else None
        return 1 if keys is None or keys.dim() != 4 else int(keys.shape[0])


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
        self._stream: Any = None
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
            if self._stream is None:                    # the model's stream, wrapped once per request
                import torch

                self._stream = self._owner.cache.device_pool.runtime.as_stream(
                    torch.cuda.current_stream(self._owner.paged.device))
            for op in loads:
                op.stream_wait(self._stream, layer=layer)
        else:
            for op in loads:
                op.wait() if layer is None else op.wait_layer(layer)

    def _empty(self) -> Any:
        import torch

        paged = self._owner.paged
        return torch.empty((1, paged.heads, 0, paged.head_dim), dtype=paged.dtype, device=paged.device)

    def finish(self, sequence: Any = None) -> int:
        """Insert the new whole pages of ``sequence`` (default: the prompt; a ``generate`` output or its
        ``.sequences`` too), whose KV the cache now holds (at least up to its last token but one), and unlock.
        Returns the tokens newly cached (0 when none could be had). Refused (nothing inserted, still unlocked) when
        ``sequence`` neither extends the prompt nor is its beginning, or the cache holds more tokens than it (a
        forward that was given tokens other than ``input_ids[:, cached_tokens:]``). Several sequences (sampling,
        beams) share only the prompt: its pages are inserted."""
        if not self._open:
            return 0
        try:
            tokens = self.tokens if sequence is None else _sequences_of(sequence)
            if tokens.ndim == 2:                        # several continuations of one prompt: only it is shared
                if not (tokens[:, :len(self.tokens)] == self.tokens).all():
                    raise InvalidArgument("finish: the sequences do not all extend the request's prompt")
                tokens = self.tokens
            common = min(len(tokens), len(self.tokens))
            if not np.array_equal(tokens[:common], self.tokens[:common]):
                raise InvalidArgument("finish: the sequence does not extend the request's prompt (nor is it a part of "
                                      "it); its KV is not what this request's cache holds")
            if self.cache.batch_rows() > 1:
                tokens = self.tokens                    # rows (beams, samples) share the prompt's KV, not more
            elif (held := self.cache.get_seq_length()) > len(tokens):
                raise InvalidArgument(f"finish: the cache holds {held} tokens but the sequence has {len(tokens)}; "
                                      f"forward input_ids[:, cached_tokens:] ({self.cached_tokens} are cached), not "
                                      "the whole prompt")
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
              model_id: str | None = None, host_layout: str = "layer_first") -> KVTierGeneration:
        """Pools for ``device_tokens`` on the model's device and ``host_tokens`` of pinned host memory, in the model's
        dtype, and a cache over them. The host pool is ``layer_first`` and loads use the copy engines (``direct``):
        a layer of a run of host pages is one contiguous piece, so a load-back is one copy per layer and tensor at the
        link's rate, an event after each (``host_layout="page_first_direct"`` makes them strided copies instead).
        ``settings`` default: that, and load back whatever is cached (no recompute estimate). ``storage``: a spec
        (``file:PATH``, ``redis://…``; opened for this model's namespace and closed with this object) or a backend
        opened for ``namespace_of(model, page_size, model_id)`` and ``layout=host_layout``: ``model_id`` (default:
        the config's ``_name_or_path``, else its model type) plus a hash of a sample of the weights, so other weights
        never read these pages."""
        import torch

        runtime = get_runtime(runtime) if not isinstance(runtime, Runtime) else runtime
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        geometry = checked_geometry(model, page_size, dtype)
        pages = -(-device_tokens // page_size)
        if runtime.torch_device is not None:
            if device.type != runtime.torch_device:
                raise InvalidArgument(f"the model is on {device}; the {runtime.name} runtime needs it on a GPU "
                                      f"({runtime.torch_device}) device")
            tensors = [[torch.empty((pages * page_size, geometry.heads, geometry.head_bytes // itemsize(dtype)),
                                    dtype=dtype, device=device) for _ in range(geometry.layers)] for _ in range(2)]
            pool = DevicePool.from_tensors(geometry, tensors, runtime=runtime)
        else:
            tensors = None
            pool = DevicePool.allocate(geometry, pages, 0, runtime=runtime)
        try:
            host = HostPool.allocate(geometry, host_layout, tokens=host_tokens, kind="pinned", runtime=runtime)
        except BaseException:
            pool.close()
            raise
        namespace = namespace_of(model, geometry, model_id)
        settings = settings or CacheSettings(calibrate=False, load_back_min_tokens=0, load_backend="direct")
        owned: tuple[Any, ...] = (pool, host)
        try:
            if isinstance(storage, str):
                storage = open_store(storage, namespace, layout=host_layout)
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
        """``model.generate`` for one prompt (``[1, tokens]``), with the cached prefix served by kvtier and the new
        whole pages inserted afterwards (only the prompt's when several sequences come back: beams, samples).
        ``kwargs`` go to ``model.generate``; those a pre-filled cache cannot serve exactly are refused before any
        work: an attention mask with padding (the KV would not be the tokens' own), ``use_cache=False``, and
        assisted / prompt-lookup decoding."""
        import torch

        rows = _check_generate_kwargs(self.model, kwargs)
        with self.request(input_ids, overlap=overlap) as request:
            if rows > 1:                                # generate expands the prompt, not a cache it is given
                request.cache.batch_repeat_interleave(rows)
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
        try:
            index = self.paged.index(new)
            for layer, states in enumerate(past.kvtier_layers):
                assert states.keys is not None and states.values is not None
                self.paged.write(layer, index, states.keys[:1, :, start:end], states.values[:1, :, start:end])
            self.cache.insert(sequence[:end], np.concatenate([prefix, new]))
        except BaseException:
            self.cache.free(new)                        # a failed write (e.g. out of memory) gives its pages back
            raise
        return end - start

    def close(self) -> None:
        """Close the cache, then what ``build`` made (idempotent)."""
        self.cache.close()
        for resource in reversed(self._owned):
            resource.close()


UNSERVED_GENERATE = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
"""generate arguments whose decoding loop re-runs positions a pre-filled cache already holds (transformers gives
other tokens with a pre-filled ``DynamicCache`` too)."""


def _check_generate_kwargs(model: Any, kwargs: dict[str, Any]) -> int:
    """Refuse what a pre-filled cache cannot serve; return the rows ``generate`` will run the prompt as (several
    samples of one prompt without beam search: generate expands the inputs but not a cache it is given)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name in UNSERVED_GENERATE:
        if kwargs.get(name) is not None or getattr(config, name, None) is not None:
            raise InvalidArgument(f"generate({name}=...): assisted and prompt-lookup decoding do not give the model's "
                                  "own tokens with a pre-filled cache; call model.generate without kvtier for it")
    if kwargs.get("use_cache") is False or getattr(config, "use_cache", True) is False:
        raise InvalidArgument("generate(use_cache=False) computes without a cache; call model.generate directly")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise InvalidArgument("an attention mask with padding changes the KV of the tokens it covers, and kvtier "
                              "keys KV by token ids: pass the sequence without padding (and without a mask)")
    def setting(name: str, default: int) -> int:
        value = kwargs.get(name)
        return int(value if value is not None else getattr(config, name, None) or default)
    return setting("num_return_sequences", 1) if setting("num_beams", 1) == 1 else 1


def _sequences_of(output: Any) -> np.ndarray:
    """Token ids of a ``generate`` output (a tensor or an output with ``.sequences``): one row as 1-D, more as 2-D."""
    sequences = getattr(output, "sequences", output)
    shape = tuple(getattr(sequences, "shape", ()))
    if len(shape) != 2 or shape[0] < 1:
        raise InvalidArgument(f"expected token ids of shape [rows, tokens] (or a generate output), got {shape}")
    ids = np.asarray(sequences.detach().cpu().numpy(), dtype=np.int64)
    return ids[0] if shape[0] == 1 else ids


def _tokens_of(input_ids: Any) -> np.ndarray:
    shape = tuple(getattr(input_ids, "shape", ()))
    if len(shape) != 2 or shape[0] != 1:
        raise InvalidArgument(f"kvtier serves one sequence at a time, shape [1, tokens]; got {shape}")
    if shape[1] < 1:
        raise InvalidArgument("the prompt is empty")
    return np.asarray(input_ids[0].detach().cpu().numpy(), dtype=np.int64)

"""The transformers ``Cache`` of a kvtier request: one ``KVTierLayer`` per model layer, each knowing its length before
its bytes exist, so layer i reads its pages (and waits for its load-back) only when its attention first runs.

transformers widens and reshuffles a cache's batch for beam search and several samples (``batch_repeat_interleave``,
``reorder_cache``, ``batch_select_indices``). Before a layer is read those only reorder the ``CachedRow`` list it
will read, so no layer waits for its load early; after, they are ``DynamicLayer``'s own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers.cache_utils import Cache, DynamicLayer

from kvtier.errors import InvalidArgument
from kvtier.integrations.paged import CachedRow

Read = Callable[[Sequence[CachedRow], Any, Any], tuple[Any, Any]]
"""``read(rows, key_states, value_states)``: wait for the layer's load, then gather ``rows`` followed by the new
states (None: none), as ``DynamicLayer.update`` returns them."""


class KVTierLayer(DynamicLayer):
    """A ``DynamicLayer`` whose first ``cached_tokens`` positions of each batch row come from kvtier pages (``rows``:
    one ``CachedRow`` each). They are read when attention first updates the layer; anything else that needs the
    tensors (``crop``) reads them first."""

    def __init__(self, rows: Sequence[CachedRow] = (), read: Read | None = None) -> None:
        super().__init__()
        self.rows = list(rows)
        self.cached_tokens = self.rows[0].length if self.rows else 0
        self._read = read if self.cached_tokens else None

    @property
    def pending(self) -> bool:
        return self._read is not None

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self._read is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[0] != len(self.rows):
            held = f"{len(self.rows)} row" + ("s" if len(self.rows) != 1 else "")
            raise InvalidArgument(f"this cache holds {held} but the forward has {key_states.shape[0]}: widen it first "
                                  "(cache.batch_repeat_interleave(repeats))")
        self._settle(key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cached_tokens if self._read is not None else super().get_seq_length()

    def settle(self) -> None:
        """Read the cached tokens now, if attention has not (an empty update)."""
        if self._read is not None:
            self._settle(None, None)

    def _settle(self, key_states: Any, value_states: Any) -> None:
        read, self._read = self._read, None
        assert read is not None
        keys, values = read(self.rows, key_states, value_states)
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def rows_held(self) -> int:
        """Batch rows: of the tensors once read, else of the rows to read."""
        if self.is_initialized and self.keys is not None and self.keys.dim() == 4:
            return int(self.keys.shape[0])
        return len(self.rows)

    def crop(self, tokens_to_remove: int) -> None:
        self.settle()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self._read, self.cached_tokens = None, 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)
        else:
            self.rows = [row for row in self.rows for _ in range(repeats)]

    def batch_select_indices(self, indices: Any) -> None:
        if self.is_initialized:
            super().batch_select_indices(indices)
        else:
            self.rows = self._select(indices)

    def reorder_cache(self, beam_idx: Any) -> None:
        if self.is_initialized:
            super().reorder_cache(beam_idx)
        else:
            self.rows = self._select(beam_idx)

    def _select(self, indices: Any) -> list[CachedRow]:
        """The rows ``tensor[indices]`` would keep (positions or a boolean mask)."""
        import torch

        kept = torch.arange(len(self.rows))[torch.as_tensor(indices, device="cpu")]
        return [self.rows[i] for i in kept.reshape(-1).tolist()]


class KVTierCache(Cache):
    """The transformers ``Cache`` of one request, one ``KVTierLayer`` per model layer (``kvtier_layers``, typed)."""

    def __init__(self, layers: list[KVTierLayer]) -> None:
        self.kvtier_layers = list(layers)
        super().__init__(layers=list(self.kvtier_layers))

    def settle(self) -> None:
        for layer in self.kvtier_layers:
            layer.settle()

    def batch_rows(self) -> int:
        """Rows the cache holds now: a request's prompts, more once beams or samples widened it."""
        return self.kvtier_layers[0].rows_held() if self.kvtier_layers else 0

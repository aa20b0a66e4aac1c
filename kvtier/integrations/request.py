"""One use of the kvtier cache by a batch of prompts: each prompt's locked match and load-back, the ``KVTierCache``
that serves them to the model, and the insert of each prompt's new whole pages afterwards.

The model's cache is one tensor per layer, so every row skips the same number of positions in its first forward.
A row's positions are its left padding, then its prompt; the cache length is the least over the rows of padding plus
cached prefix. A row serves that many positions (its padding as zeros, the rest from its pages) and loads back its
host part only when it reads into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.cache import CacheRequest, LoadBack, Match
from kvtier.errors import InvalidArgument
from kvtier.integrations.cache_layers import KVTierCache, KVTierLayer, Read
from kvtier.integrations.paged import CachedRow

if TYPE_CHECKING:
    from kvtier.integrations.transformers import KVTierGeneration


@dataclass
class Turn:
    """What one prompt of a request found: prompt tokens, tokens served from the device tier, loaded back from host
    memory (or storage, through a prefetch), and computed."""

    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    computed_tokens: int


class PromptUse:
    """One prompt of a request: its tokens (padding removed), the left padding before them in the batch, and its
    use of the cache (``cached``: matched on all but the last token, locked until the request is released)."""

    def __init__(self, tokens: np.ndarray, pad: int, cached: CacheRequest) -> None:
        self.tokens, self.pad, self.cached = tokens, pad, cached

    @property
    def match(self) -> Match:
        assert self.cached.match is not None
        return self.cached.match

    @property
    def load(self) -> LoadBack | None:
        """Its load-back (None: none needed, not needed by the rows' common length, or declined)."""
        return self.cached.load

    @property
    def prefix(self) -> np.ndarray:
        """Device pages of the cached prefix: the match's device part, then what the load-back filled."""
        return self.cached.prefix_pages


class Request:
    """A batch of prompts' use of the kvtier cache. Give ``cache`` to the model (``forward`` with the uncached
    ``input_ids[:, cached_tokens:]``, or ``generate`` with all of them), then ``finish(sequences)`` to insert each
    prompt's new whole pages, or ``release()`` to insert nothing. Holds the matches locked until then."""

    def __init__(self, owner: KVTierGeneration, prompts: list[PromptUse], overlap: bool) -> None:
        self._owner, self.prompts = owner, prompts
        self.cached_tokens = self._queue_loads()
        page, rows = owner.cache.page_size, []
        self.turns: list[Turn] = []
        for i, prompt in enumerate(prompts):
            served = max(0, self.cached_tokens - prompt.pad)
            rows.append(CachedRow(i, self.cached_tokens - served, served,
                                  owner.paged.index(prompt.prefix[:-(-served // page)])))
            device = min(served, prompt.cached.device_tokens)
            self.turns.append(Turn(len(prompt.tokens), device, served - device, len(prompt.tokens) - served))
        self._stream: Any = None
        if not overlap:
            self._wait()
        layers = range(owner.cache.geometry.layers)
        self.cache = KVTierCache([KVTierLayer(rows, self._reader(layer)) for layer in layers])
        self._open = True

    def _queue_loads(self) -> int:
        """Queue the load-backs the rows read into and return the positions every row serves from the cache. A
        declined load-back shortens its row's prefix to the device part, and so maybe every row's; one whose host
        part a row before it is loading (shared pages) finds it on the device (``CacheRequest.load_back``)."""
        cached = [prompt.match.cached_tokens for prompt in self.prompts]
        asked: set[int] = set()
        while True:
            length = min(prompt.pad + tokens for prompt, tokens in zip(self.prompts, cached, strict=True))
            short = [i for i, prompt in enumerate(self.prompts)
                     if i not in asked and length - prompt.pad > prompt.cached.device_tokens]
            if not short:
                return length
            i = short[0]
            asked.add(i)
            self.prompts[i].cached.load_back()
            cached[i] = self.prompts[i].cached.cached_tokens

    @property
    def turn(self) -> Turn:
        """The turn of a one-prompt request (``turns`` has every prompt's)."""
        self._only()
        return self.turns[0]

    @property
    def tokens(self) -> np.ndarray:
        """The prompt of a one-prompt request."""
        return self._only().tokens

    @property
    def match(self) -> Match:
        return self._only().match

    @property
    def load(self) -> LoadBack | None:
        """The load-back of a one-prompt request (None: its prefix is on the device, or the load was declined)."""
        return self._only().load

    def _only(self) -> PromptUse:
        if len(self.prompts) != 1:
            raise InvalidArgument(f"this request has {len(self.prompts)} prompts: see request.prompts and turns")
        return self.prompts[0]

    def _reader(self, layer: int) -> Read:
        def read(rows: Any, key_states: Any, value_states: Any) -> tuple[Any, Any]:
            self._wait(layer)
            if key_states is None:
                key_states = value_states = self._empty(len(rows))
            return self._owner.paged.gather(layer, list(rows), key_states, value_states)
        return read

    def _wait(self, layer: int | None = None) -> None:
        """Order what follows after the loads this request reads (all of them, or one layer's): on the GPU when the
        pages are the model's tensors, else on the CPU."""
        if self._owner.paged.on_device:
            if self._stream is None:                    # the model's stream, wrapped once per request
                import torch

                self._stream = self._owner.cache.device_pool.runtime.as_stream(
                    torch.cuda.current_stream(self._owner.paged.device))
            for prompt in self.prompts:
                prompt.cached.stream_wait(self._stream, layer=layer)
        else:
            for prompt in self.prompts:
                prompt.cached.wait(layer)

    def _empty(self, rows: int) -> Any:
        import torch

        paged = self._owner.paged
        return torch.empty((rows, paged.heads, 0, paged.head_dim), dtype=paged.dtype, device=paged.device)

    def finish(self, sequences: Any = None) -> int:
        """Insert each prompt's new whole pages, whose KV the cache now holds (at least up to a row's last token but
        one), and unlock. ``sequences`` (default: the prompts; a ``generate`` output or its ``.sequences`` too) are
        rows of ``input_ids``' width and padding, continued or cut short. Where each prompt has one row in the cache
        and one sequence, the sequence is inserted; several (beams, samples) share only the prompt, which is.
        Returns the tokens newly cached. Refused (nothing inserted, still unlocked) when a sequence neither extends
        its prompt nor is its beginning, or the cache holds more tokens than it (a forward that was given tokens
        other than ``input_ids[:, cached_tokens:]``)."""
        if not self._open:
            return 0
        try:
            inserts = self._inserts(sequences)
            return sum(self._owner._insert(tokens, prompt.cached, prompt.pad, self.cache, row)
                       for prompt, tokens, row in inserts)
        finally:
            self.release()

    def _inserts(self, sequences: Any) -> list[tuple[PromptUse, np.ndarray, int]]:
        """(prompt, tokens to insert, cache row holding their KV) for each prompt, every sequence checked first."""
        count, rows = len(self.prompts), self.cache.batch_rows()
        if rows % count:
            raise InvalidArgument(f"finish: the cache holds {rows} rows for {count} prompts; only widening (beams, "
                                  "samples) keeps each prompt's rows together")
        per_prompt = rows // count
        given = _sequences_of(sequences) if sequences is not None else np.zeros((0, 0), dtype=np.int64)
        if len(given) % count:
            raise InvalidArgument(f"finish: {len(given)} sequences for {count} prompts")
        each = len(given) // count
        inserts = []
        for b, prompt in enumerate(self.prompts):
            tokens = prompt.tokens
            for s in range(b * each, (b + 1) * each):
                real = given[s, prompt.pad:]
                common = min(len(real), len(prompt.tokens))
                if not np.array_equal(real[:common], prompt.tokens[:common]):
                    raise InvalidArgument(f"finish: sequence {s} does not extend the request's prompt {b} (nor is it "
                                          "a part of it); its KV is not what this request's cache holds")
                tokens = real
            if per_prompt > 1 or each > 1:
                tokens = prompt.tokens                  # rows (beams, samples) share the prompt's KV, not more
            elif (held := self.cache.get_seq_length() - prompt.pad) > len(tokens):
                raise InvalidArgument(f"finish: the cache holds {held} tokens but the sequence has {len(tokens)}; "
                                      f"forward input_ids[:, cached_tokens:] ({self.cached_tokens} are cached), not "
                                      "the whole prompt")
            inserts.append((prompt, tokens, b * per_prompt))
        return inserts

    def release(self) -> None:
        """Unlock without inserting (idempotent); pages allocated for an insert that failed go back."""
        if self._open:
            self._open = False
            failure: BaseException | None = None
            for prompt in self.prompts:
                try:
                    prompt.cached.close()
                except BaseException as error:  # noqa: BLE001 - the other prompts are closed first
                    failure = failure or error
            if failure is not None:
                raise failure

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _sequences_of(output: Any) -> np.ndarray:
    """Token ids of a ``generate`` output (a tensor or an output with ``.sequences``), ``[rows, tokens]``."""
    sequences = getattr(output, "sequences", output)
    shape = tuple(getattr(sequences, "shape", ()))
    if len(shape) != 2 or shape[0] < 1:
        raise InvalidArgument(f"expected token ids of shape [rows, tokens] (or a generate output), got {shape}")
    return np.asarray(sequences.detach().cpu().numpy(), dtype=np.int64)

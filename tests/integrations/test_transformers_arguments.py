"""Arguments ``KVTierGeneration.generate`` and ``request`` cannot serve are refused before any cache work: no match, no
lock, no load-back queued, no forward, the cache's statistics unchanged; the error names the bad argument."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.models import GREEDY, emulated, held_locks, host_only, reference, tiny_llama  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvtier.errors import InvalidArgument  # noqa: E402

PROMPT = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(3))


def hole(ids):
    mask = torch.ones_like(ids)
    mask[0, 10:14] = 0
    return mask


BAD_GENERATE = {
    "past_key_values": (lambda model, ids: dict(past_key_values=DynamicCache(config=model.config)),
                        "past_key_values"),
    "cache": (lambda model, ids: dict(cache=DynamicCache(config=model.config)), "cache"),
    "cache_implementation": (lambda model, ids: dict(cache_implementation="static"), "cache_implementation"),
    "a typo": (lambda model, ids: dict(max_new_tokenz=3), "max_new_tokenz"),
    "inputs_embeds": (lambda model, ids: dict(inputs_embeds=torch.zeros((1, 48, 128))), "inputs_embeds"),
    "beams fewer than sequences": (lambda model, ids: dict(num_beams=2, num_return_sequences=3),
                                   "num_return_sequences"),
    "max_length below the prompt": (lambda model, ids: dict(max_length=20, max_new_tokens=None), "max_length"),
    "prefill_chunk_size": (lambda model, ids: dict(prefill_chunk_size=16), "prefill_chunk_size"),
    "prompt lookup": (lambda model, ids: dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    "use_cache=False": (lambda model, ids: dict(use_cache=False), "use_cache=False"),
    "custom_generate": (lambda model, ids: dict(custom_generate=lambda **kw: None), "custom_generate"),
    "a mask with a hole": (lambda model, ids: dict(attention_mask=hole(ids)), "left padding"),
    "a mask of another shape": (lambda model, ids: dict(attention_mask=torch.ones((1, 7), dtype=torch.long)),
                                "attention_mask"),
    "a mask of other values": (lambda model, ids: dict(attention_mask=2 * torch.ones_like(ids)), "attention_mask"),
}

BAD_IDS = {
    "float ids": (lambda ids: ids.float(), "dtype"),
    "bool ids": (lambda ids: ids > 500, "dtype"),
    "1-D ids": (lambda ids: ids[0], "shape"),
    "3-D ids": (lambda ids: ids[None], "shape"),
    "no tokens": (lambda ids: ids[:, :0], "empty"),
    "no rows": (lambda ids: ids[:0], "shape"),
    "ids past the vocabulary": (lambda ids: torch.cat([ids, torch.tensor([[1000]])], dim=1), "vocabulary"),
    "negative ids": (lambda ids: torch.cat([ids, torch.tensor([[-1]])], dim=1), "vocabulary"),
    "ids on another device": (lambda ids: ids.to("meta"), "device"),
    "not a tensor": (lambda ids: ids.tolist(), "tensor"),
}


@contextlib.contextmanager
def untouched(generation):
    """A generation whose cache holds PROMPT's pages on the host tier only (a match would count a hit, a load-back
    would take device pages); checks that what runs inside leaves the cache exactly as it was."""
    generation.generate(PROMPT, max_new_tokens=1)
    host_only(generation)
    model, calls = generation.model, []
    original = model.forward
    model.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    before, turns = generation.cache.stats(), list(generation.turns)
    try:
        yield
    finally:
        model.forward = original
    assert not calls, "the model ran"
    assert generation.turns == turns
    assert held_locks(generation) == 0
    assert generation.cache.stats() == before


@pytest.mark.parametrize("bad, message", BAD_GENERATE.values(), ids=BAD_GENERATE.keys())
def test_generate_arguments_it_cannot_serve_are_refused_before_any_cache_work(bad, message):
    model = tiny_llama()
    ids = torch.cat([PROMPT, torch.randint(3, 1000, (1, 8))], dim=1)
    with contextlib.closing(emulated(model)) as generation, untouched(generation):
        with pytest.raises(InvalidArgument, match=message):
            generation.generate(ids, **{**GREEDY, **bad(model, ids)})


@pytest.mark.parametrize("bad, message", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("call", ["generate", "request"])
def test_bad_input_ids_are_refused_before_any_cache_work(bad, message, call):
    model = tiny_llama()
    ids = bad(torch.cat([PROMPT, torch.randint(3, 1000, (1, 8))], dim=1))
    with contextlib.closing(emulated(model)) as generation, untouched(generation):
        with pytest.raises(InvalidArgument, match=message):
            generation.generate(ids, **GREEDY) if call == "generate" else generation.request(ids)


def test_a_bad_mask_is_refused_by_request_before_any_cache_work():
    model = tiny_llama()
    with contextlib.closing(emulated(model)) as generation, untouched(generation):
        with pytest.raises(InvalidArgument, match="left padding"):
            generation.request(PROMPT, attention_mask=hole(PROMPT))


def test_left_padding_of_one_prompt_is_served_as_the_prompt_without_it():
    """The mask was refused whatever its padding; left padding (the only kind decoder-only generate takes) is the
    prompt's tokens after it, and hits its cached pages."""
    model = tiny_llama()
    with contextlib.closing(emulated(model)) as generation:
        generation.generate(PROMPT, max_new_tokens=1)
        ids = torch.cat([torch.zeros((1, 20), dtype=torch.long), PROMPT], dim=1)
        mask = torch.cat([torch.zeros((1, 20), dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
        kwargs = dict(attention_mask=mask, pad_token_id=0, **GREEDY)
        assert torch.equal(generation.generate(ids, **kwargs), reference(model, ids, **kwargs))
        assert generation.turns[-1].device_tokens == 32 and generation.turns[-1].prompt_tokens == 40

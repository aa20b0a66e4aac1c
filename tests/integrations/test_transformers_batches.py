"""Beam search, several samples per prompt and batches of prompts through kvtier give the model's own tokens while
their cached prefixes are served: each row's prompt is its own request to the cache (left padding stripped), the beams
and samples of a prompt share its prefix, and each prompt's new pages are inserted afterwards."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.models import (  # noqa: E402
    GREEDY,
    emulated,
    forward,
    host_only,
    left_padded,
    reference,
    run_prefill,
    tiny_llama,
)


@pytest.fixture(params=["emulated:split", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request) -> tuple[object, str]:
    """(runtime, torch device): the emulated runtime on the CPU, and the GPU where one is usable."""
    if request.param == "cuda":
        return request.getfixturevalue("cuda"), "cuda"
    return "emulated:split", "cpu"


DECODING = {
    "beams": dict(max_new_tokens=6, do_sample=False, num_beams=3),
    "beams, two returned": dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2),
    "samples": dict(max_new_tokens=6, do_sample=True, num_return_sequences=3),
}


def same_draws(call):
    """``call()`` with the random generator in one state, so two sampled generations draw alike."""
    torch.manual_seed(77)
    return call()


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
def test_several_sequences_of_a_cached_prompt_are_the_models_own(where, tier, decoding):
    """Beam search on a prompt with a cached page raised "the forward has 3 rows": the cache was never widened."""
    runtime, device = where
    model = tiny_llama(device)
    prompt = torch.randint(0, 1000, (1, 40), device=device)
    with contextlib.closing(emulated(model, runtime=runtime)) as generation:
        generation.generate(prompt, **GREEDY)
        if tier == "host":
            host_only(generation)
        longer = torch.cat([prompt, torch.randint(0, 1000, (1, 9), device=device)], dim=1)
        output = same_draws(lambda: generation.generate(longer, **decoding))
        assert torch.equal(output, same_draws(lambda: reference(model, longer, **decoding)))
        turn = generation.turns[-1]
        assert (turn.device_tokens, turn.host_tokens) == ((32, 0) if tier == "device" else (0, 32))
        generation.cache.check()


BATCH_DECODING = {"greedy": GREEDY, "beams": dict(max_new_tokens=6, do_sample=False, num_beams=2,
                                                  num_return_sequences=2)}


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("decoding", BATCH_DECODING.values(), ids=BATCH_DECODING.keys())
def test_a_left_padded_batch_with_other_cached_prefixes_is_the_models_own_and_caches_each_prompt(where, tier,
                                                                                                 decoding):
    """A batch was refused ("one sequence at a time") and a padding mask too. Rows share one cache length (the
    positions the first forward skips), so each row serves its cached tokens up to the shortest row's padding plus
    cached prefix: here 80 - 30 = 50 positions, partial pages included."""
    runtime, device = where
    model = tiny_llama(device)
    a, b = (torch.randint(0, 1000, (1, n), device=device) for n in (70, 40))
    with contextlib.closing(emulated(model, runtime=runtime)) as generation:
        for ids in (a, b):
            generation.generate(ids, max_new_tokens=1)              # caches 64 and 32 tokens
        if tier == "host":
            host_only(generation)
        rows = [torch.cat([a, torch.randint(0, 1000, (1, 10), device=device)], dim=1),
                torch.cat([b, torch.randint(0, 1000, (1, 5), device=device)], dim=1),
                torch.randint(0, 1000, (1, 30), device=device)]
        ids, mask = left_padded(rows)
        kwargs = dict(attention_mask=mask, pad_token_id=0, **decoding)
        assert torch.equal(generation.generate(ids, **kwargs), reference(model, ids, **kwargs))
        served = [(t.device_tokens, t.host_tokens) for t in generation.turns[-3:]]
        assert served == ([(50, 0), (15, 0), (0, 0)] if tier == "device" else [(0, 50), (0, 15), (0, 0)])
        assert [t.computed_tokens for t in generation.turns[-3:]] == [30, 30, 30]
        for row, cached in zip(rows, (64, 32, 16), strict=True):   # each prompt was inserted, the third one too
            assert torch.equal(generation.generate(row, **GREEDY), reference(model, row, **GREEDY))
            assert generation.turns[-1].device_tokens == cached
        generation.cache.check()


def test_widening_a_request_for_beams_reads_no_pages_until_attention_does():
    """batch_repeat_interleave and reorder_cache read every layer's pages at once (each layer waiting for its
    load-back before the first layer computed); they reorder the rows to read instead."""
    model = tiny_llama()
    prompt = torch.randint(0, 1000, (1, 40))
    with contextlib.closing(emulated(model)) as generation:
        run_prefill(generation, prompt)
        host_only(generation)
        ids = torch.cat([prompt, torch.randint(0, 1000, (1, 3))], dim=1)
        with generation.request(ids) as request:
            request.cache.batch_repeat_interleave(3)
            request.cache.reorder_cache(torch.tensor([2, 0, 1]))
            request.cache.batch_select_indices(torch.tensor([True, True, False]))
            assert all(layer.pending for layer in request.cache.layers)
            assert request.cache.get_seq_length() == 32 and request.cache.batch_rows() == 2
            logits = forward(generation, ids[:, 32:].repeat(2, 1), request.cache).logits[:, -1]
        with torch.no_grad():
            expected = model(ids).logits[0, -1]
        assert (logits - expected).abs().max() < 1e-4


def test_prompts_of_a_batch_sharing_a_host_prefix_all_serve_it():
    """The first row's load-back moved the shared pages to the device, the second row's then found nothing to load
    and was served none of them: the whole batch recomputed the prefix."""
    model = tiny_llama()
    shared = torch.randint(0, 1000, (1, 40))
    with contextlib.closing(emulated(model)) as generation:
        generation.generate(shared, max_new_tokens=1)
        host_only(generation)
        ids = torch.cat([shared.repeat(2, 1), torch.randint(0, 1000, (2, 6))], dim=1)
        assert torch.equal(generation.generate(ids, **GREEDY), reference(model, ids, **GREEDY))
        assert [t.device_tokens + t.host_tokens for t in generation.turns[-2:]] == [32, 32]
        assert generation.turns[-2].host_tokens == 32
        generation.cache.check()


def test_rows_gather_alike_from_torch_pages_and_from_the_emulated_pool():
    """What each row reads (left padding as zeros, a part of its last page, one prompt's rows read once) is the same
    from pages kept as torch tensors (the CUDA path, indexed in place) and from the emulated pool (copied through the
    runtime), and is the pages' tokens in order."""
    from kvtier.integrations.paged import CachedRow, PagedKV
    from kvtier.pools import DevicePool, KVGeometry
    from kvtier.runtime import create

    g = KVGeometry.mha(layers=2, kv_heads=2, head_dim=8, itemsize=4, page_size=16)
    pages = 8
    tensors = [[torch.randn(pages * 16, 2, 8) for _ in range(g.layers)] for _ in range(2)]
    with contextlib.closing(DevicePool.allocate(g, pages, 0, runtime=create("emulated:split"))) as pool:
        in_place, copied = PagedKV(pool, torch.float32, "cpu", tensors), PagedKV(pool, torch.float32, "cpu")
        everything = torch.arange(pages)
        for layer in range(g.layers):
            keys, values = (tensors[t][layer].transpose(0, 1)[None] for t in range(2))
            copied.write(layer, everything, keys, values)
        index = (torch.tensor([5, 2]), torch.tensor([1, 7]))
        rows = [CachedRow(0, 3, 21, index[0]), CachedRow(1, 0, 24, index[1]), CachedRow(0, 3, 21, index[0]),
                CachedRow(2, 24, 0, index[0][:0])]
        new = torch.randn(4, 2, 5, 8)
        for layer in range(g.layers):
            for t, (a, b) in enumerate(zip(in_place.gather(layer, rows, new, new), copied.gather(layer, rows, new, new),
                                           strict=True)):
                assert torch.equal(a, b) and a.shape == (4, 2, 29, 8)
                tokens = tensors[t][layer].view(pages, 16, 2, 8)
                for r, row in enumerate(rows):
                    expected = torch.cat([torch.zeros(row.pad, 2, 8)] + [tokens[int(p)] for p in row.index])[:24]
                    expected = expected.transpose(0, 1)
                    assert torch.equal(a[r, :, :24], expected), (layer, t, r)
                    assert torch.equal(a[r, :, 24:], new[r])

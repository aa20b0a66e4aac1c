"""The caller's-pages check and state change of every insert and free: the C pass (``kvtier._page_checks``) agrees
with the numpy checks on every input, and changes nothing when it says no."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest
from helpers.cache import P, build, prompt, serve
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.cache.allocator as allocator
from kvtier.cache.allocator import distinct, take_pages
from kvtier.errors import InvalidArgument
from kvtier.runtime import create

STATES = 5


def numpy_take(pages: np.ndarray, states: np.ndarray, want: int) -> bool:
    """What the C pass must answer, from the numpy checks the cache falls back on."""
    if not pages.size:
        return True
    if pages.min() < 0 or pages.max() >= len(states) or not distinct(pages):
        return False
    return bool((states[pages] == want).all())


pools = st.integers(1, 64).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, STATES - 1), min_size=n, max_size=n),
    st.one_of(st.lists(st.integers(-3, n + 3), max_size=2 * n),               # scattered, maybe bad
              st.tuples(st.integers(-2, n), st.integers(0, n + 2)).map(         # one run, maybe past the end
                  lambda run: list(range(run[0], run[0] + run[1]))))))


@pytest.mark.skipif(allocator._native is None, reason="kvtier._page_checks was not built here")
@settings(max_examples=400, deadline=None)
@given(pools, st.integers(0, STATES - 1), st.integers(0, STATES - 1))
def test_the_c_pass_answers_as_the_numpy_checks_and_changes_nothing_on_no(pool, want, to):
    states = np.array(pool[0], dtype=np.uint8)
    pages = np.array(pool[1], dtype=np.int64)
    before = states.copy()
    expected = numpy_take(pages, before, want)
    assert take_pages(pages, states, want, to) is expected
    if expected:
        after = before.copy()
        after[pages] = to
        assert np.array_equal(states, after)
    else:
        assert np.array_equal(states, before)


def test_arrays_the_c_pass_cannot_read_fall_back_to_the_numpy_checks():
    states = np.ones(8, dtype=np.uint8)
    assert take_pages(np.arange(4, dtype=np.int32), states, 1, 2) is False
    assert take_pages(np.arange(8, dtype=np.int64)[::2], states, 1, 2) is False
    assert (states == 1).all()


def test_the_c_pass_is_built_by_the_install_where_it_can_be():
    cc = sysconfig.get_config_var("CC")
    if shutil.which(cc.split()[0] if cc else "cc") is None:
        pytest.skip("no C compiler here: the optional C pass is not built")
    assert allocator._native is not None, "pip install did not build kvtier._page_checks"


@pytest.mark.parametrize("native", [True, False], ids=["c-pass", "numpy"])
def test_refused_inserts_and_frees_leave_every_page_the_callers(native, monkeypatch):
    """With the C pass and without it: a bad page anywhere in the call (named twice, out of range, another's)
    refuses the whole call, and every page stays the caller's to insert or free."""
    if native and allocator._native is None:
        pytest.skip("kvtier._page_checks was not built here")
    if not native:
        monkeypatch.setattr(allocator, "_native", None)
    cache, model, dev, host = build(create("emulated:split"), device_pages=16)
    tokens = prompt(4 * P)
    mine = cache.allocate(4)
    model.write(tokens, mine)
    bad = [np.array([mine[0], mine[1], mine[2], mine[2]]), np.array([mine[0], mine[1], mine[2], 99]),
           np.array([mine[3], mine[2], mine[1], 15 if 15 not in mine else 14])]
    for pages in bad:
        for call in (lambda p=pages: cache.insert(tokens, p), lambda p=pages: cache.free(p)):
            with pytest.raises(InvalidArgument):
                call()
            assert (cache.tiers.page_state[mine] == cache.tiers.page_state[mine[0]]).all()
    cache.insert(tokens, mine)
    assert cache.match_prefix(tokens).device_tokens == 4 * P
    cache.close()
    host.close()
    dev.close()


def test_insert_of_minus_one_pages_over_a_host_only_prefix_is_refused(rt):
    """A host-only node's positions are -1 along the tree, and a caller page -1 there was taken for the tree's own:
    the node was revived on device page -1 (the pool's last page) and matches handed it out. Refused now.
    (Found adversarially.)"""
    cache, model, dev, host = build(rt, device_pages=16)
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=16)
    assert cache.match_prefix(tokens).host_tokens == 4 * P
    with pytest.raises(InvalidArgument):
        cache.insert(tokens, np.array([-1, -1, -1, -1]))
    cache.check()
    assert cache.match_prefix(tokens).device_tokens == 0
    cache.close()
    host.close()
    dev.close()

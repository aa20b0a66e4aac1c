"""RangeIndex against a brute-force model."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.runtime.ranges import RangeIndex


@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 300)), max_size=40), st.lists(st.integers(0, 2400)))
def test_index_matches_a_brute_force_model(ranges, probes):
    index, kept = RangeIndex[int](), []
    for start, size in ranges:
        overlaps = any(start < s + n and s < start + size for s, n in kept)
        try:
            index.add(start, size, len(kept))
            added = True
        except ValueError:
            added = False
        assert added != overlaps
        assert index.generation == len(kept) + added     # a refused add changes nothing
        if added:
            kept.append((start, size))
    for probe in probes:
        expected = [(s, n) for s, n in kept if s <= probe < s + n]
        found = index.find(probe)
        assert (found.start, found.nbytes) == expected[0] if expected else found is None
    before = index.generation
    for start, _ in kept[::2]:
        index.pop(start)
    assert len(index) == len(kept) - len(kept[::2])
    assert index.generation == before + len(kept[::2])

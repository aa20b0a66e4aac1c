"""The storage interface is its abstract methods: a store missing one cannot be opened, every shipped store writes
all of them, and the module docstring a newcomer implements from lists exactly them."""

from __future__ import annotations

import inspect

import pytest
from helpers.interfaces import documented_primitives, implemented_except

import kvtier.storage.backend as backend
from kvtier.storage import FileStore, MemoryStore, RedisStore, StorageBackend


def test_the_docstring_lists_exactly_the_primitives():
    assert StorageBackend.__abstractmethods__
    assert documented_primitives(backend) == {"StorageBackend": set(StorageBackend.__abstractmethods__)}


@pytest.mark.parametrize("primitive", sorted(StorageBackend.__abstractmethods__))
def test_a_store_missing_a_primitive_cannot_be_opened_and_is_told_which(primitive):
    with pytest.raises(TypeError, match=rf"abstract method.*\b{primitive}\b"):
        implemented_except(StorageBackend, primitive)(None)


def test_a_store_writing_every_primitive_opens_and_gets_the_shared_rules():
    store = implemented_except(StorageBackend)(None)
    with pytest.raises(backend.StorageError, match="without a namespace"):
        store.get([bytes(32)], [[bytearray(8)]])
    store.close()
    with pytest.raises(backend.StorageError, match="closed"):
        store.entries()


@pytest.mark.parametrize("shipped", [FileStore, RedisStore, MemoryStore], ids=lambda c: c.__name__)
def test_every_shipped_store_writes_every_primitive(shipped):
    assert issubclass(shipped, StorageBackend)
    assert not inspect.isabstract(shipped), sorted(shipped.__abstractmethods__)

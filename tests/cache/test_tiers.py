"""The tiers are built from one settings object and collaborators that exist before them (nothing is filled in
afterwards), use those collaborators for backups and waits, and hand what a completed backup produced back to their
caller, which passes it on (to storage, to another backup)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cache import TINY, prompt

from kvtier.cache.controller import Controller
from kvtier.cache.index import RadixIndex
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.operation import BACKUP
from kvtier.cache.settings import WritePolicy
from kvtier.cache.tiers import NOTHING, TREE, MustWait, Tiers, TierSettings
from kvtier.errors import InvalidArgument
from kvtier.transfer.engine import CURRENT


class RecordingEngine:
    """The backup engine's part the tiers use: records each backup."""

    def __init__(self) -> None:
        self.backups: list[tuple[list[int], list[int], object]] = []

    def backup(self, device, host, *, after):
        self.backups.append((device.tolist(), host.tolist(), after))
        return None


def built(**settings):
    """Tiers over a fresh index with a recording engine, a controller that is never started, and markers that
    return the request itself."""
    engine = RecordingEngine()
    controller = Controller(lambda nodes, after: None, lambda op: None, lambda queue, depth: None)
    tiers = Tiers(TierSettings(TINY, **{"device_pages": 4, "host_pages": 8, **settings}),
                  index=RadixIndex(TINY.page_size, b"\0" * 32), metrics=CacheMetrics(), backup_engine=engine,
                  controller=controller, markers=lambda after: [after])
    return tiers, engine, controller


def cached(tiers: Tiers, pages: int):
    """A prompt of ``pages`` pages in the tree, on the device only."""
    device = tiers.allocate_device(pages)
    placed = tiers.index.place(prompt(pages * TINY.page_size), device)
    tiers.page_state[device] = TREE
    return placed.last_node


def test_a_completed_backup_hands_its_nodes_on_once():
    tiers, engine, _ = built()
    node = cached(tiers, 2)
    op = tiers.start_backup([node], None)
    assert engine.backups == [(node.device.tolist(), node.host.tolist(), None)]
    completed = tiers.complete(op)
    assert completed.backed_up == [node] and completed.state_left == []
    assert tiers.complete(op) is NOTHING
    tiers.check()


def test_a_failed_backup_hands_nothing_on():
    tiers, _, _ = built()
    node = cached(tiers, 2)
    op = tiers.start_backup([node], None)
    op.error = RuntimeError("the copy failed")
    assert tiers.complete(op) is NOTHING
    assert node.host is None
    tiers.check()


def test_write_back_eviction_backs_up_through_its_collaborators_and_waits_for_the_controllers_transfers():
    tiers, engine, controller = built(device_pages=2, write_policy="write_back")
    node = cached(tiers, 2)
    with pytest.raises(MustWait) as waiting:
        tiers.allocate_device(1)
    [op] = waiting.value.ops
    assert controller.inflight(BACKUP) == [op]
    assert engine.backups == [(node.device.tolist(), node.host.tolist(), [CURRENT])]
    with pytest.raises(MustWait) as again:           # nothing evictable now: it waits for what is in flight
        tiers.allocate_device(1)
    assert again.value.ops == [op] and len(engine.backups) == 1


@pytest.mark.parametrize(("field", "value", "match"), [
    ("geometry", "tiny", "KVGeometry"),
    ("device_pages", 0, "device_pages"),
    ("host_pages", 1.5, "host_pages"),
    ("write_policy", "write_sometimes", "write policy"),
    ("contiguous_device", "yes", "contiguous_device"),
])
def test_tier_settings_refuse_bad_values(field, value, match):
    given = {"geometry": TINY, "device_pages": 4, "host_pages": 8, field: value}
    with pytest.raises(InvalidArgument, match=match):
        TierSettings(**given)


def test_tier_settings_take_numpy_page_counts_and_policy_names():
    settings = TierSettings(TINY, np.int64(4), np.int32(8), "write_back")
    assert (settings.device_pages, settings.host_pages) == (4, 8) and type(settings.device_pages) is int
    assert settings.write_policy is WritePolicy.WRITE_BACK

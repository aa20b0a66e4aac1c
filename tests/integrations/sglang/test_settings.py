"""Whose pages are whose: SGLang's HiCacheStorageConfig maps onto a kvtier namespace, so deployments of different
models, parallel layouts, adapters or tenants never share a page, and the same deployment (restarted, or a second
instance) does. MLA's latent cache is the same on every TP rank: one rank writes it, every rank reads it."""

from __future__ import annotations

import pytest
import torch
from helpers import sglang as sg

TENANT = "deployment"


def _deployment(spec, pool, backends, config=None, **options):
    backend = sg.create_backend(spec, pool, config=config, tenant=options.pop("tenant", TENANT), **options)
    backends.append(backend)
    keys, indices = sg.page_keys(3, "namespaces"), sg.pages_at(pool, 3)
    sg.fill_pages(pool, indices, seed=5)
    return backend, keys, indices


def test_a_restarted_deployment_hits_what_it_deployment(spec, backends):
    pool = sg.mha_host_pool("page_first")
    first, keys, indices = _deployment(spec, pool, backends)
    expected = sg.page_bytes(pool, indices)
    assert first.batch_set_v1(keys, indices) == [True] * 3
    first.close()
    again = sg.create_backend(spec, pool, tenant=TENANT)
    backends.append(again)
    sg.poison_pages(pool, indices)
    assert again.batch_get_v1(keys, indices) == [True] * 3
    assert sg.page_bytes(pool, indices) == expected


@pytest.mark.parametrize("other", [
    dict(model_name="Qwen/Qwen3-8B"),
    dict(tp_rank=0, tp_size=2),
    dict(pp_rank=0, pp_size=2),
    dict(attn_cp_rank=0, attn_cp_size=2),
], ids=["model", "tp", "pp", "cp"])
def test_other_models_and_parallel_layouts_never_share_a_page(file_spec, backends, other):
    pool = sg.mha_host_pool("page_first")
    writer, keys, indices = _deployment(file_spec, pool, backends)
    assert writer.batch_set_v1(keys, indices) == [True] * 3
    reader = sg.create_backend(file_spec, pool, config=sg.storage_config(**other), tenant=TENANT)
    backends.append(reader)
    assert reader.batch_exists(keys) == 0 and reader.batch_get_v1(keys, indices) == [False] * 3
    assert reader.store.namespace_id != writer.store.namespace_id


@pytest.mark.parametrize("option", [dict(tenant="someone-else"), dict(adapter="lora-a")])
def test_a_tenant_or_an_adapter_in_the_extra_config_keeps_pages_apart(file_spec, backends, option):
    pool = sg.mha_host_pool("page_first")
    writer, keys, indices = _deployment(file_spec, pool, backends)
    assert writer.batch_set_v1(keys, indices) == [True] * 3
    reader = sg.create_backend(file_spec, pool, **{"tenant": TENANT, **option})
    backends.append(reader)
    assert reader.batch_exists(keys) == 0


def test_the_model_option_names_the_model_only_where_sglang_gives_none(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    unnamed = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name=None), model="llama",
                                tenant=TENANT)
    named = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name="llama"), model="other",
                              tenant=TENANT)
    backends += [unnamed, named]
    keys, _, _ = sg.store_pages(unnamed, pool, pages=2, salt="model-option")
    assert named.batch_exists(keys) == 2


def test_a_different_kv_geometry_or_dtype_is_another_namespace(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    writer, keys, indices = _deployment(file_spec, pool, backends)
    assert writer.batch_set_v1(keys, indices) == [True] * 3
    for other in (sg.mha_host_pool("page_first", heads=4), sg.mha_host_pool("page_first", dtype=torch.float16)):
        reader = sg.create_backend(file_spec, other, tenant=TENANT)
        backends.append(reader)
        assert reader.batch_exists(keys) == 0


def test_deployments_of_two_byte_orders_keep_a_copy_each_and_of_one_order_share(file_spec, backends):
    """page_first and layer_first order a page's bytes differently: each deployment stores and reads its own copy
    (never the other's bytes transposed). layer_first and page_first_direct order them the same: they share."""
    pool = sg.mha_host_pool("page_first")
    writer, keys, indices = _deployment(file_spec, pool, backends)
    assert writer.batch_set_v1(keys, indices) == [True] * 3
    other = sg.mha_host_pool("layer_first")
    reader = sg.create_backend(file_spec, other, tenant=TENANT)
    backends.append(reader)
    at = sg.pages_at(other, 3)
    assert reader.batch_exists(keys) == 0 and reader.batch_get_v1(keys, at) == [False] * 3
    sg.fill_pages(other, at, seed=6)
    own = sg.page_bytes(other, at)
    assert reader.batch_set_v1(keys, at) == [True] * 3
    sg.poison_pages(other, at)
    assert reader.batch_get_v1(keys, at) == [True] * 3 and sg.page_bytes(other, at) == own

    direct = sg.mha_host_pool("page_first_direct")
    sharer = sg.create_backend(file_spec, direct, tenant=TENANT)
    backends.append(sharer)
    into = sg.pages_at(direct, 3)
    assert sharer.batch_get_v1(keys, into) == [True] * 3
    assert _flat(direct, into) == _flat(other, at)


def _flat(pool, indices) -> bytes:
    """The pages at ``indices`` as SGLang flattens them (``get_data_page``): the bytes storage keeps."""
    return b"".join(pool.get_data_page(int(i)).view(torch.uint8).numpy().tobytes()
                    for i in indices[::pool.page_size])


def test_mla_is_written_once_and_read_by_every_tp_rank(file_spec, backends):
    rank0_pool, rank1_pool = sg.mla_host_pool("page_first"), sg.mla_host_pool("page_first")
    rank1 = sg.create_backend(file_spec, rank1_pool, tenant=TENANT,
                              config=sg.storage_config(is_mla_model=True, tp_rank=1, tp_size=2))
    rank0 = sg.create_backend(file_spec, rank0_pool, tenant=TENANT,
                              config=sg.storage_config(is_mla_model=True, tp_rank=0, tp_size=2))
    backends += [rank0, rank1]
    keys, indices = sg.page_keys(3, "mla"), sg.pages_at(rank1_pool, 3)
    sg.fill_pages(rank1_pool, indices, seed=11)
    assert rank1.batch_set_v1(keys, indices) == [True] * 3        # not the writer: reports success, writes nothing
    assert rank0.batch_exists(keys) == 0 and rank1.stats()["calls"]["set.skipped"] == 3

    at0 = sg.pages_at(rank0_pool, 3)
    sg.fill_pages(rank0_pool, at0, seed=11)
    expected = sg.page_bytes(rank0_pool, at0)
    assert rank0.batch_set_v1(keys, at0) == [True] * 3
    sg.poison_pages(rank1_pool, indices)
    assert rank1.batch_get_v1(keys, indices) == [True] * 3
    assert sg.page_bytes(rank1_pool, indices) == expected

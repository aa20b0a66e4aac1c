"""Page keys: stable across processes and versions, different for every namespace field."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.cache import Namespace, page_keys, token_array
from kvtier.errors import InvalidArgument
from kvtier.pools import KVGeometry

LLAMA = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16)
NS = Namespace("meta-llama/Llama-3.1-8B", LLAMA, "bfloat16")


def test_keys_are_pinned_across_versions():
    """These values are the format: a change here loses every stored page of every user (bump KEY_FORMAT)."""
    assert NS.digest.hex() == "d777e02664dfab041cc5c6f57e5071b8883b5f3d242fbbbfe7ba999ac13bd1c1"
    keys = page_keys(NS, list(range(1000, 1048)))
    assert [k.hex()[:16] for k in keys] == ["6fc2c7e342765363", "14de53b8991505bd", "0d6a547129f01adb"]


def test_keys_chain_sha256_over_parent_and_little_endian_uint32_tokens():
    tokens = np.random.default_rng().integers(0, 128256, 40)
    expected, parent = [], NS.digest
    for start in range(0, 32, 16):
        parent = hashlib.sha256(parent + tokens[start:start + 16].astype("<u4").tobytes()).digest()
        expected.append(parent)
    assert page_keys(NS, tokens) == expected          # the partial last page has no key


def test_keys_are_the_same_in_another_process():
    tokens = np.random.default_rng().integers(0, 128256, 64).tolist()
    code = ("import sys, json; from kvtier.cache import Namespace, page_keys; from kvtier.pools import KVGeometry; "
            "g = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16); "
            "ns = Namespace('meta-llama/Llama-3.1-8B', g, 'bfloat16'); "
            "print(json.dumps([k.hex() for k in page_keys(ns, json.loads(sys.argv[1]))]))")
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps(tokens)], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin",
                              **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    assert json.loads(out.stdout) == [k.hex() for k in page_keys(NS, tokens)]


@pytest.mark.parametrize("change", [
    {"model": "meta-llama/Llama-3.1-8B-Instruct"}, {"dtype": "fp8_e4m3"}, {"tp_rank": 1, "tp_size": 2},
    {"tp_size": 2}, {"adapter": "lora-a"}, {"tenant": "acme"},
    {"geometry": KVGeometry.mha(layers=31, kv_heads=8, head_dim=128, itemsize=2, page_size=16)},
    {"geometry": KVGeometry.mla(layers=32, latent_bytes=2048, page_size=16)},
])
def test_two_namespaces_never_share_a_key(change):
    other = dataclasses.replace(NS, **change)
    tokens = np.random.default_rng().integers(0, 128256, 64)
    mine, theirs = page_keys(NS, tokens), page_keys(other, tokens)
    assert not set(mine) & set(theirs)


def test_tenants_adapters_differ_from_none_and_from_each_other():
    digests = {dataclasses.replace(NS, tenant=t, adapter=a).digest for t in (None, "a", "b") for a in (None, "a")}
    assert len(digests) == 6


@pytest.mark.parametrize("bad", [[[1, 2]], [-1, 2], [1 << 32], [1.5, 2.0], [True, False], "abc"])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(InvalidArgument):
        token_array(bad)


def test_namespace_checks_its_fields():
    with pytest.raises(InvalidArgument, match="rank"):
        Namespace("m", LLAMA, "bfloat16", tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgument, match="model"):
        Namespace("", LLAMA, "bfloat16")
    with pytest.raises(InvalidArgument, match="geometry"):
        Namespace("m", "llama", "bfloat16")  # type: ignore[arg-type]


def test_torch_tokens_work_like_lists():
    torch = pytest.importorskip("torch")
    tokens = torch.randint(0, 128256, (48,))
    assert page_keys(NS, tokens) == page_keys(NS, tokens.tolist())


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_the_c_chain_and_the_hashlib_chain_give_the_same_keys(page, monkeypatch):
    """Where the install built ``kvtier._chain_keys`` the chain runs in C; without it, in hashlib: a key is the
    same either way (storage written by one is read by the other)."""
    import kvtier.keys as keys

    tokens = np.random.default_rng(page).integers(0, 2**32, 1000 + page, dtype=np.uint64).astype(np.uint32)
    parent = hashlib.sha256(b"parent").digest()
    built = keys.chain_keys(parent, tokens, page)
    monkeypatch.setattr(keys, "_native", None)
    assert keys.chain_keys(parent, tokens, page) == built
    assert len(built) == len(tokens) // page
    assert built[0] == hashlib.sha256(parent + tokens[:page].astype("<u4").tobytes()).digest()
    assert keys.chain_keys(parent, tokens[:page - 1], page) == []


def test_the_c_chain_is_built_by_the_install_where_it_can_be():
    """The package's normal install builds the C chain where a C compiler and OpenSSL's headers are present (CI's
    machines); elsewhere the build is optional and hashlib serves."""
    import shutil
    import sysconfig
    from pathlib import Path

    import kvtier.keys as keys

    compiler = shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
    if compiler is None or not Path("/usr/include/openssl/sha.h").exists():
        pytest.skip("no C compiler or OpenSSL headers here: the optional C chain is not built")
    assert keys._native is not None, "pip install did not build kvtier._chain_keys"

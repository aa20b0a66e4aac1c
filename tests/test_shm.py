"""Shared-memory host buffers: another process attaches by name; the owner's file is private and cleaned up."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from device_kernels import random_bytes
from kvtier.errors import KvtierError
from kvtier.memory import HostBuffer, HostKind
from shm_child import attach_and_reply


def test_second_process_attaches_by_name_and_sees_the_same_bytes(runtime):
    n, reply = 1 << 20, os.urandom(64)
    data = random_bytes(n)
    with HostBuffer.allocate(n, HostKind.SHM, runtime=runtime) as buf:
        view = buf.as_tensor().numpy()
        view[:] = data
        assert stat.S_IMODE(os.stat(buf.path).st_mode) == 0o600
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        child = context.Process(target=attach_and_reply, args=(runtime.name, buf.name, reply, results))
        child.start()
        status, digest, nbytes, child_split = results.get(timeout=120)
        child.join(60)
        assert status == "ok", digest
        assert nbytes == n and child.exitcode == 0
        assert digest == hashlib.sha256(data[: n - len(reply)].tobytes()).hexdigest()
        assert view[n - len(reply):].tobytes() == reply
        assert child_split == (runtime.name == "emulated:split")
        assert os.path.exists(buf.path), "a non-owner's close must not remove the owner's file"
        path = buf.path
        del view
    assert not os.path.exists(path)


def test_owner_removes_the_file_at_interpreter_exit(tmp_path):
    code = ("from kvtier.memory import HostBuffer; from kvtier.runtime import create\n"
            "buf = HostBuffer.allocate(1 << 16, 'shm', runtime=create('emulated:split'))\n"
            "print(buf.path)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/") and not os.path.exists(path)


def test_names_are_exclusive_and_attach_needs_an_existing_buffer(split):
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split) as buf:
        with pytest.raises(KvtierError, match="already exists"):
            HostBuffer.allocate(4096, HostKind.SHM, runtime=split, name=buf.name)
    with pytest.raises(KvtierError, match="no shm buffer"):
        HostBuffer.attach_shm(buf.name, runtime=split)


def test_attached_buffer_in_the_same_process_shares_bytes(split):
    with HostBuffer.allocate(8192, HostKind.SHM, runtime=split) as owner:
        with HostBuffer.attach_shm(owner.name, runtime=split) as second:
            assert second.cpu_address != owner.cpu_address
            data = random_bytes(8192)
            owner_view, second_view = owner.as_tensor().numpy(), second.as_tensor().numpy()
            owner_view[:] = data
            np.testing.assert_array_equal(second_view, data)
            del owner_view, second_view

"""Shared-memory host buffers: another process attaches by name; the owner's file is private and cleaned up."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.device_kernels import random_bytes
from helpers.shm_child import FORKING_OWNER, KILLED_OWNER, attach_and_reply

from kvtier import cli
from kvtier.errors import KvtierError
from kvtier.memory import HostBuffer, HostKind, sweep_shm


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


def test_owner_removes_the_file_at_interpreter_exit(monkeypatch):
    monkeypatch.delenv("KVTIER_SHM_DIR", raising=False)
    code = ("from kvtier.memory import HostBuffer; from kvtier.runtime import create\n"
            "buf = HostBuffer.allocate(1 << 16, 'shm', runtime=create('emulated:split'))\n"
            "print(buf.path)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/kvtier/") and not os.path.exists(path)


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


# -- lifecycle: fork children, killed owners, the sweep, reserved names ---------------------------------------------
@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private kvtier shm directory (inherited by subprocesses), so no sweep here touches the real one."""
    directory = tmp_path / "kvtier-shm"
    monkeypatch.setenv("KVTIER_SHM_DIR", str(directory))
    yield directory
    leftovers = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    for name in leftovers:
        (directory / name).unlink()
    assert not leftovers, f"a test left shm files behind: {leftovers}"


def _wait_until_unlocked(path: str, seconds: float = 30.0) -> None:
    """Wait for the kernel to drop a dead owner's lock. It may do so only after the process is reaped: on the H200
    machine, with a CUDA context busy in the test process, /proc/locks still listed a killed owner's lock (its pid
    gone) when the next call ran. The tests below check what kvtier does once the owner is gone for the kernel."""
    deadline = time.monotonic() + seconds
    while True:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                with open("/proc/locks") as locks:
                    raise AssertionError(f"a killed owner's lock on {path} was still held after {seconds} s; "
                                         f"/proc/locks:\n{locks.read()}") from None
        finally:
            os.close(fd)
        time.sleep(0.02)


@pytest.fixture
def killed_owner(shm_dir: Path) -> Iterator[Callable[[], str]]:
    """Makes shm owners that die by SIGKILL (no finalizer runs) and returns their file's path."""
    paths: list[str] = []

    def make() -> str:
        out = subprocess.run([sys.executable, "-c", KILLED_OWNER], capture_output=True, text=True, timeout=120)
        assert out.returncode == -signal.SIGKILL, out.stderr
        paths.append(out.stdout.strip())
        _wait_until_unlocked(paths[-1])
        return paths[-1]

    yield make
    for path in paths:  # wherever they went, even if the sweep under test did not remove them
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_a_fork_child_exiting_normally_leaves_the_owners_file(shm_dir):
    out = subprocess.run([sys.executable, "-c", FORKING_OWNER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, child_exit, after_child, after_close = out.stdout.split()
    assert child_exit == "0"
    assert after_child == "True", "the fork child's finalizer removed the owner's file"
    assert after_close == "False", "the owner's close() must still remove it"
    assert not os.path.exists(path)


def test_a_killed_owners_file_stays_until_the_sweep_removes_it(killed_owner):
    path = killed_owner()
    assert os.path.exists(path), "nothing runs at SIGKILL, so the file stays"
    assert sweep_shm() == [path]
    assert not os.path.exists(path)
    assert sweep_shm() == []


def test_a_sweep_that_cannot_open_a_file_says_why_instead_of_calling_it_live(killed_owner, monkeypatch):
    path = killed_owner()
    real_open = os.open

    def out_of_descriptors(name, flags, *args, **kwargs):
        if name == os.path.basename(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(name, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("kvtier.memory.shm.os.open", out_of_descriptors)
        with pytest.raises(KvtierError, match=f"cannot check the shm file {os.path.basename(path)}.*Too many open"):
            sweep_shm()
    assert os.path.exists(path) and sweep_shm() == [path]


def test_the_sweep_leaves_a_live_owners_file(shm_dir, split):
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split) as buf:
        assert sweep_shm() == [] and sweep_shm(dry_run=True) == []
        assert os.path.exists(buf.path)
        with HostBuffer.attach_shm(buf.name, runtime=split):
            assert sweep_shm() == []
    assert not os.path.exists(buf.path)


def test_an_attacher_does_not_keep_a_dead_owners_file(killed_owner, split):
    path = killed_owner()
    with HostBuffer.attach_shm(os.path.basename(path), runtime=split) as attached:
        view = attached.as_tensor().numpy()
        view[:] = 7
        assert sweep_shm() == [path] and not os.path.exists(path)
        assert (view == 7).all(), "an attacher's mapping outlives the removed file"
        del view


def test_creating_an_owner_sweeps_dead_owners_files(killed_owner, split):
    dead = [killed_owner(), killed_owner()]
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split) as buf:
        assert [os.path.exists(path) for path in dead] == [False, False]
        assert os.path.exists(buf.path)


def test_creating_an_owner_takes_over_a_dead_owners_name(killed_owner, split):
    path = killed_owner()
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split, name=os.path.basename(path)) as buf:
        assert buf.path == path and os.path.exists(path)
    assert not os.path.exists(path)


def test_the_sweep_keeps_young_hidden_temporaries_and_removes_old_ones(shm_dir, split):
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split):  # creates the directory
        young, old = shm_dir / ".young.tmp", shm_dir / ".old.tmp"
        for path in (young, old):
            path.write_bytes(b"x")
            path.chmod(0o600)
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        assert sweep_shm() == [str(old)]
        assert young.exists()
        young.unlink()


def test_cli_shm_sweep_prints_what_it_removes(killed_owner, capsys):
    path = killed_owner()
    assert cli.main(["shm", "sweep", "--dry-run"]) == 0
    assert path in capsys.readouterr().out and os.path.exists(path)
    assert cli.main(["shm", "sweep"]) == 0
    assert path in capsys.readouterr().out and not os.path.exists(path)
    assert cli.main(["shm", "sweep"]) == 0
    assert "no dead owners" in capsys.readouterr().out


def test_the_directory_is_shared_like_tmp_and_files_are_private(shm_dir, split):
    with HostBuffer.allocate(4096, HostKind.SHM, runtime=split) as buf:
        assert os.path.dirname(buf.path) == str(shm_dir)
        assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(buf.path).st_mode) == 0o600


def test_a_world_writable_directory_without_the_sticky_bit_is_refused(shm_dir, split):
    shm_dir.mkdir()
    shm_dir.chmod(0o777)
    with pytest.raises(KvtierError, match="sticky"):
        HostBuffer.allocate(4096, HostKind.SHM, runtime=split)


@pytest.mark.parametrize(("name", "problem"), [(".", "only of dots"), ("..", "only of dots"),
                                               ("...", "only of dots"), (".hidden", "starting with '.'")])
def test_dot_names_are_refused(shm_dir, split, name, problem):
    with pytest.raises(KvtierError, match=f"shm name .* is refused: .*{problem}"):
        HostBuffer.allocate(4096, HostKind.SHM, runtime=split, name=name)
    with pytest.raises(KvtierError, match=f"shm name .* is refused: .*{problem}"):
        HostBuffer.attach_shm(name, runtime=split)

"""kvtier's shared-memory files: where they live, who owns them, and the sweep that removes dead owners' files.

Every shm buffer is a file in one dedicated directory, ``/dev/shm/kvtier`` (``$KVTIER_SHM_DIR`` overrides it, for
tests or a private location). The directory is created mode 1777, like /tmp, so several users can share it; each
file is mode 0600. The owner (the process that created the file) holds a shared ``flock`` on it for the buffer's
whole life, through a close-on-exec descriptor it closes on release. The kernel drops that lock when the owner dies,
even by SIGKILL, so "can I take an exclusive lock?" tells a dead owner's file from a live one without trusting pids,
which get reused. :func:`sweep_shm` removes exactly the files nobody holds; it runs whenever a new owner creates a
buffer and from ``kvtier shm sweep``.

Who keeps a file alive: its owner, and any fork child of it (a child inherits the locked descriptor until it exits or
execs). Attachers (``HostBuffer.attach_shm``) do not: once the owner is gone the sweep removes the name, and their
mappings stay valid until they unmap. A file is created under a hidden temporary name, locked, sized, and only then
linked to its final name, so no visible name ever exists unlocked; names starting with '.' are therefore reserved.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import uuid

from kvtier.errors import KvtierError

DIR_ENV_VAR = "KVTIER_SHM_DIR"
DEFAULT_DIR = "/dev/shm/kvtier"
#: a hidden temporary younger than this may belong to an owner between creating and locking it: the sweep skips it
TEMPORARY_GRACE_SECONDS = 60.0
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def shm_dir() -> str:
    """The directory of kvtier's shm files; read at each call, so a test can point it elsewhere."""
    return os.environ.get(DIR_ENV_VAR) or DEFAULT_DIR


def check_name(name: str) -> str:
    """``name`` if it can name a buffer: one path component that is neither a directory entry nor a temporary."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise KvtierError(f"shm name {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-'")
    if not name.strip("."):
        raise KvtierError(f"shm name {name!r} is refused: a name made only of dots is a directory entry ('.', '..') "
                          f"or looks like one, not a buffer")
    if name.startswith("."):
        raise KvtierError(f"shm name {name!r} is refused: names starting with '.' are reserved for kvtier's "
                          f"temporary files")
    return name


def shm_path(name: str) -> str:
    return os.path.join(shm_dir(), check_name(name))


def new_shm_name() -> str:
    return f"kvtier-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def ensure_dir() -> str:
    """Create the shm directory (mode 1777) if needed, and refuse one where another user could swap our files."""
    directory = shm_dir()
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o1777)  # after mkdir, because the umask would strip bits from mkdir's mode
    except FileExistsError:
        pass
    except OSError as exc:
        raise KvtierError(f"cannot create the shm directory {directory} ({exc}); set ${DIR_ENV_VAR} to a directory "
                          f"on a tmpfs you can write") from exc
    mode = os.lstat(directory).st_mode
    if not stat.S_ISDIR(mode):
        raise KvtierError(f"the shm directory {directory} is not a directory (a symlink or a file is in its place)")
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise KvtierError(f"the shm directory {directory} is writable by others but not sticky (mode "
                          f"{stat.S_IMODE(mode):o}), so another user could remove or replace kvtier's files: "
                          f"`chmod 1777 {directory}`")
    return directory


def create_owned(name: str, nbytes: int) -> tuple[str, int]:
    """A new file of ``nbytes`` named ``name``, mode 0600; returns its path and the descriptor that holds the lock.

    Sweeps dead owners' files first, so a name a killed owner left behind can be created again. The file is made
    under a hidden temporary name and locked before it gets its final name through ``link``, which fails if the name
    exists (O_EXCL for names), so the sweep never sees a visible name unlocked. Release with :func:`remove_owned`.
    """
    check_name(name)
    directory = ensure_dir()
    sweep_shm()
    path = os.path.join(directory, name)
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise KvtierError(f"cannot create an shm file in {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        _publish(temporary, path, name)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return path, fd


def _publish(temporary: str, path: str, name: str) -> None:
    try:
        os.link(temporary, path)
    except FileExistsError as exc:
        raise KvtierError(f"shm {path} already exists and its owner holds it (or died an instant ago and the kernel "
                          f"has not dropped its lock yet): attach to it with HostBuffer.attach_shm({name!r})") from exc
    except OSError as exc:
        raise KvtierError(f"cannot name the shm file {path} ({exc}): its filesystem must support hard links") from exc


def remove_owned(path: str, fd: int) -> None:
    """Remove the owner's file, then drop its lock by closing ``fd``.

    Unlinks only if ``path`` is still the file ``fd`` holds, so an owner never removes a file that replaced its own.
    Never call ``flock(LOCK_UN)`` here: a fork child shares the lock, and unlocking would drop it for both.
    """
    try:
        with contextlib.suppress(FileNotFoundError):
            if _same_file(os.fstat(fd), path):
                os.unlink(path)
    finally:
        os.close(fd)


def _same_file(held: os.stat_result, path: str, dir_fd: int | None = None) -> bool:
    try:
        now = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def sweep_shm(*, dry_run: bool = False) -> list[str]:
    """Remove the shm files whose owner is gone (killed, or crashed before its finalizer ran); return their paths.

    A file is removed only if an exclusive, non-blocking ``flock`` on it succeeds: a live owner (or a fork child of
    it) holds a shared lock, which the kernel drops when the process dies, so pid reuse cannot fool the sweep. Hidden
    temporaries younger than :data:`TEMPORARY_GRACE_SECONDS` are skipped (their owner may not have locked them yet).
    Files another user owns are skipped when this process cannot open them. ``dry_run`` lists without removing.
    A missing directory has nothing to sweep.
    """
    directory = shm_dir()
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise KvtierError(f"cannot read the shm directory {directory}: {exc}") from exc
    try:
        now = time.time()
        names = sorted(os.listdir(dir_fd))
        return [os.path.join(directory, name) for name in names if _sweep_one(dir_fd, name, now, dry_run)]
    finally:
        os.close(dir_fd)


def _sweep_one(dir_fd: int, name: str, now: float, dry_run: bool) -> bool:
    """Whether ``name`` is a dead owner's file; unless ``dry_run`` it is removed, while this process holds its lock."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    if name.startswith(".") and now - info.st_mtime < TEMPORARY_GRACE_SECONDS:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except (FileNotFoundError, PermissionError):  # gone meanwhile, or another user's file
        return False
    except OSError as exc:  # e.g. out of descriptors: taking the file for a live owner's would hide the real cause
        raise KvtierError(f"cannot check the shm file {name} in {shm_dir()} for a live owner: {exc}") from exc
    try:
        if not _lock_if_unowned(fd) or not _same_file(os.fstat(fd), name, dir_fd):
            return False  # a live owner, or the name now points at a newer file than the one locked
        if not dry_run:
            os.unlink(name, dir_fd=dir_fd)
        return True
    except (FileNotFoundError, PermissionError):  # another sweep was first, or the sticky bit protects it
        return False
    finally:
        os.close(fd)


def _lock_if_unowned(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True

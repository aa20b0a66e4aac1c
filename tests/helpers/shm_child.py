"""Runs in a spawned process: attach to a shm buffer by name, report what it sees, write a reply."""

from __future__ import annotations

import hashlib


def attach_and_reply(spec: str, name: str, reply: bytes, results) -> None:
    from kvtier.memory import HostBuffer, get_device_accessible_ptr
    from kvtier.runtime import get

    try:
        runtime = get(spec)
        with HostBuffer.attach_shm(name, runtime=runtime) as buf:
            view = buf.as_tensor().numpy()
            digest = hashlib.sha256(view[: buf.nbytes - len(reply)].tobytes()).hexdigest()
            view[buf.nbytes - len(reply):] = memoryview(reply)
            alias = get_device_accessible_ptr(buf, 0)
            results.put(("ok", digest, buf.nbytes, alias.value != buf.cpu_address.value))
            del view
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}", 0, False))


#: A script for ``python -c``: an shm owner that dies by SIGKILL, so no finalizer runs; prints the file's path.
KILLED_OWNER = """
import os, signal
from kvtier.memory import HostBuffer
from kvtier.runtime import create

buf = HostBuffer.allocate(1 << 16, 'shm', runtime=create('emulated:split'))
print(buf.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

#: A script for ``python -c``: an shm owner forks a child that exits normally (its finalizers run); prints the path,
#: the child's exit code, whether the file survived the child, and whether it survived the owner's close().
FORKING_OWNER = """
import os, sys
from kvtier.memory import HostBuffer
from kvtier.runtime import create

buf = HostBuffer.allocate(1 << 16, 'shm', runtime=create('emulated:split'))
pid = os.fork()
if pid == 0:
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print(buf.path, os.waitstatus_to_exitcode(status), os.path.exists(buf.path), flush=True)
buf.close()
print(os.path.exists(buf.path))
"""

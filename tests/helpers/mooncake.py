"""A real Mooncake Store for the tests (never a fake): a ``mooncake_master`` with its HTTP metadata server, and a
``mooncake_client`` that lends the store its memory (a segment), all on loopback ports.

CI starts one (``scripts/mooncake_servers.sh``) and passes its spec in ``KVTIER_MOONCAKE_SPEC``; without it the
fixture starts its own. Tests that kill the master mid-run always get a private one. Without the Mooncake wheel
(``pip install mooncake-transfer-engine-non-cuda``) the Mooncake tests skip, unless ``KVTIER_REQUIRE_MOONCAKE=1``
(CI) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from helpers.storage import free_port

SEGMENT = "1 GB"
"""Memory the segment holder lends the store: the store's bound (it evicts past 90% of it)."""


def mooncake_binary(name: str) -> str | None:
    """``mooncake_master`` / ``mooncake_client`` from the wheel (its console script, or the file in the package)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / name
    return str(path) if path.exists() else None


def need_mooncake() -> None:
    """Skip (or, with ``KVTIER_REQUIRE_MOONCAKE=1``, fail) where the Mooncake wheel or its libraries are missing."""
    try:
        import mooncake.engine  # noqa: F401
        import mooncake.store  # noqa: F401
        missing = None if mooncake_binary("mooncake_master") else "mooncake_master is not installed"
    except ImportError as exc:
        missing = f"the Mooncake wheel does not import: {exc}"
    if missing:
        if os.environ.get("KVTIER_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"{missing} (KVTIER_REQUIRE_MOONCAKE=1)")
        pytest.skip(missing)


START_ATTEMPTS = 3
"""Starts on fresh ports before giving up: a port found free can be taken by another test process before the
server binds it, and the server then exits."""


class ServerExited(RuntimeError):
    """A server exited while starting (its port taken, most often): worth another try on other ports."""


def _wait_port(port: int, what: str, process: subprocess.Popen[bytes], log: str, seconds: float = 30) -> None:
    """Until ``port`` accepts; fails at once, with the tail of the server's ``log``, when ``process`` exits."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if process.poll() is not None:
                raise ServerExited(f"{what} exited with status {process.returncode} before it listened on port "
                                   f"{port}; the end of its log: {_tail(log)}") from None
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start on port {port} in {seconds:.0f} s; the end of its log: {_tail(log)}")


def _tail(path: str, nbytes: int = 600) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.path.getsize(path) - nbytes))
            return log.read().decode(errors="replace").strip() or "(empty)"
    except OSError:
        return "(no log)"


class MooncakeServers:
    """A master (RPC, HTTP metadata and admin ports) and a segment holder. ``stop_master()`` kills the master,
    ``start_master()`` brings it back on the same ports, empty (the segment holder mounts its memory again)."""

    def __init__(self, segment: str = SEGMENT) -> None:
        need_mooncake()
        self.segment = segment
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        for attempt in range(START_ATTEMPTS):
            self.dir = tempfile.mkdtemp(prefix="kvtier-mooncake-")
            self.rpc_port, self.http_port, self.admin_port, self.client_port = (free_port() for _ in range(4))
            try:
                self.start_master()
                self.start_holder()
                return
            except ServerExited:
                self.close()
                if attempt == START_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.close()
                raise

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def spec(self) -> str:
        return f"mooncake://{self.master_address}?metadata={self.metadata}&admin={self.admin}"

    def _log(self, name: str):
        return open(os.path.join(self.dir, name), "ab")

    def start_master(self) -> None:
        binary = mooncake_binary("mooncake_master")
        assert binary is not None
        with self._log("master.log") as log:
            self.master = master = subprocess.Popen(
                [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
                 f"--http_metadata_server_port={self.http_port}", "--http_metadata_server_host=127.0.0.1",
                 f"--metrics_port={self.admin_port}", "--metrics_host=127.0.0.1", "--client_ttl=5"],
                stdout=log, stderr=log, cwd=self.dir)
        for port, what in ((self.rpc_port, "mooncake_master"), (self.http_port, "its metadata server"),
                           (self.admin_port, "its admin server")):
            _wait_port(port, what, master, os.path.join(self.dir, "master.log"))

    def start_holder(self) -> None:
        binary = mooncake_binary("mooncake_client")
        assert binary is not None
        with self._log("holder.log") as log:
            self.holder = holder = subprocess.Popen(
                [binary, f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata}",
                 f"--global_segment_size={self.segment}", "--host=127.0.0.1", f"--port={self.client_port}",
                 "--protocol=tcp"], stdout=log, stderr=log, cwd=self.dir)
        _wait_port(self.client_port, "mooncake_client (the segment holder)", holder,
                   os.path.join(self.dir, "holder.log"))
        self.wait_segment()

    def wait_segment(self, seconds: float = 30) -> None:
        """Until the master lists the holder's segment (after a start, or after the master came back)."""
        import urllib.request

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.admin}/get_all_segments", timeout=1) as reply:
                    if reply.read().strip():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the Mooncake segment holder did not mount its segment")

    @staticmethod
    def _kill(process: subprocess.Popen[bytes] | None) -> None:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def stop_master(self) -> None:
        self._kill(self.master)
        self.master = None

    def close(self) -> None:
        self._kill(self.holder)
        self.stop_master()
        shutil.rmtree(self.dir, ignore_errors=True)

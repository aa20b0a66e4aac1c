"""``kvtier shm``: look after kvtier's shared-memory files.

``kvtier shm sweep`` removes the files of owners that died without cleaning up (SIGKILL, OOM killer, a crash before
the finalizer ran), which otherwise hold their memory until reboot. It is safe while buffers are in use: a live
owner's file is locked, and the sweep only removes unlocked ones (see :mod:`kvtier.memory.shm`).
"""

from __future__ import annotations

import argparse

from kvtier.memory.shm import shm_dir, sweep_shm
from kvtier.runtime import Runtime


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``shm`` and its actions on the top-level ``commands``."""
    parser = commands.add_parser("shm", help="manage kvtier's shared-memory files")
    actions = parser.add_subparsers(dest="shm_command", metavar="ACTION", required=True)
    sweep = actions.add_parser("sweep", help="remove shm files whose creating process is gone")
    sweep.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    sweep.set_defaults(run=sweep_command)


def sweep_command(runtime: Runtime | None, args: argparse.Namespace) -> int:
    """One line per file, so the output greps and pipes. No runtime is started: a dead owner's file needs none."""
    removed = sweep_shm(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    if not removed:
        print(f"no dead owners' shm files in {shm_dir()}")
    return 0

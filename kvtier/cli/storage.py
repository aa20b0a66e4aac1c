"""``kvtier storage``: what a storage tier holds, for operators.

``ls`` lists namespaces (model, geometry, dtype, tenant as their writers recorded them) with their page counts and
bytes, or one namespace's pages; ``stats`` totals the store; ``clear`` removes one namespace's pages (or all, with
``--all``). No runtime is started and no namespace is needed: the store is opened for operators only.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import defaultdict
from typing import Any, Callable

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.runtime import Runtime
from kvtier.storage import SPEC_HELP, MooncakeStore, RedisStore, StorageBackend, StorageError, open_store
from kvtier.storage.redis_url import shown


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("storage", help="list, total and clear what a storage tier holds")
    actions = parser.add_subparsers(dest="storage_command", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="namespaces with their pages and bytes (or one namespace's pages)")
    ls.add_argument("spec", help=SPEC_HELP)
    ls.add_argument("--namespace", metavar="ID", help="list this namespace's pages (16 hex digits, from ls)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=ls_command)
    stats = actions.add_parser("stats", help="totals: namespaces, pages, bytes (and the server's memory)")
    stats.add_argument("spec", help=SPEC_HELP)
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=stats_command)
    clear = actions.add_parser("clear", help="remove a namespace's pages (or every namespace's with --all)")
    clear.add_argument("spec", help=SPEC_HELP)
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="ID", help="the namespace to clear (16 hex digits, from ls)")
    which.add_argument("--all", action="store_true", help="every namespace in the store")
    clear.set_defaults(run=clear_command)


def _open(spec: str) -> StorageBackend:
    if spec.startswith("memory:"):
        raise InvalidArgument("memory: lives inside one process; there is nothing to inspect from the command line")
    return open_store(spec, None)


def _operator(command: Callable[[Runtime | None, argparse.Namespace], int]) -> Callable[..., int]:
    """An operator's call that cannot reach its store says so in one line (exit 2), not with a traceback."""

    @functools.wraps(command)
    def run(runtime: Runtime | None, args: argparse.Namespace) -> int:
        try:
            return command(runtime, args)
        except KvtierError:
            raise
        except Exception as exc:  # noqa: BLE001 - redis / OS errors of the operator's store, reported plainly
            raise StorageError(f"{shown(args.spec)}: {type(exc).__name__}: {exc}") from exc

    return run


def summary(store: StorageBackend) -> list[dict[str, Any]]:
    """One row per namespace: id, its recorded description, pages, bytes."""
    pages: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for entry in store.entries():
        pages[entry.namespace] += 1
        nbytes[entry.namespace] += entry.nbytes
    described = store.namespaces()
    rows = []
    for namespace in sorted(set(described) | set(pages)):
        record = described.get(namespace) or {}
        geometry = record.get("geometry") or {}
        rows.append({"namespace": namespace, "model": record.get("model"), "dtype": record.get("dtype"),
                     "kind": geometry.get("kind"), "layers": geometry.get("layers"),
                     "page_size": geometry.get("page_size"), "tp": f"{record.get('tp_rank')}/{record.get('tp_size')}"
                     if record else None, "adapter": record.get("adapter"), "tenant": record.get("tenant"),
                     "pages": pages.get(namespace, 0), "bytes": nbytes.get(namespace, 0)})
    return rows


@_operator
def ls_command(runtime: Runtime | None, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    with _open(args.spec) as store:
        if args.namespace:
            entries = [e for e in store.entries() if e.namespace == args.namespace]
            if args.json:
                print(json.dumps([{"key": e.key, "bytes": e.nbytes} for e in entries], indent=1))
            else:
                for entry in entries:
                    print(f"{entry.key} {entry.nbytes}")
            return 0
        rows = summary(store)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"kvtier storage — {shown(args.spec)}")
    for column in ("namespace", "model", "geometry", "dtype", "tp", "adapter/tenant", "pages", "size"):
        table.add_column(column, no_wrap=column == "namespace", justify="right" if column in ("pages", "size")
                         else "left")
    for row in rows:
        geometry = f"{row['kind']} {row['layers']}L p{row['page_size']}" if row["kind"] else ""
        owner = " / ".join(str(row[k]) for k in ("adapter", "tenant") if row[k]) or ""
        table.add_row(row["namespace"], row["model"] or "(no record)", geometry, row["dtype"] or "", row["tp"] or "",
                      owner, f"{row['pages']:,}", _size(row["bytes"]))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)                 # a pipe or a log: do not squeeze the table to 80 columns
    console.print(table if rows else f"{shown(args.spec)}: no kvtier pages")
    return 0


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{nbytes:,} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


@_operator
def stats_command(runtime: Runtime | None, args: argparse.Namespace) -> int:
    with _open(args.spec) as store:
        rows = summary(store)
        report: dict[str, Any] = {"store": store.kind, "namespaces": len(rows),
                                  "pages": sum(r["pages"] for r in rows), "bytes": sum(r["bytes"] for r in rows)}
        if isinstance(store, RedisStore):
            info = store.client().info("memory") if not store.cluster else {}
            report["used_memory"] = info.get("used_memory")
            report["maxmemory"] = info.get("maxmemory")
            report["maxmemory_policy"] = info.get("maxmemory_policy")
        if isinstance(store, MooncakeStore):
            report.update(store.usage())
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for key, value in report.items():
            print(f"{key:>17}: {value:,}" if isinstance(value, int) else f"{key:>17}: {value}")
    return 0


@_operator
def clear_command(runtime: Runtime | None, args: argparse.Namespace) -> int:
    with _open(args.spec) as store:
        removed = store.clear(args.namespace, every_namespace=args.all)
    print(f"removed {removed:,} pages from {shown(args.spec)}")
    return 0

"""The ``kvtier`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from kvtier.errors import KvtierError
from kvtier.runtime import ENV_VAR
from kvtier.runtime import get as get_runtime

INTERRUPTED = 130
"""Exit code after Ctrl-C, as a shell reports a command SIGINT ended (128 + 2)."""
DEBUG = "KVTIER_DEBUG"
"""Set to see the traceback of an unexpected error instead of its one line."""


class HelpWithDefaults(argparse.HelpFormatter):
    """Shows every option's default after its help, unless the help already says it (or there is none to show:
    a switch, or a default of None the help explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)) \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli import demo, doctor, shm, storage

    runtime_help = (f"cuda | hip | emulated:split | emulated:unified (default: ${ENV_VAR}, else cuda when an "
                    "NVIDIA GPU is usable, hip when an AMD GPU is, else emulated:split)")
    parser = argparse.ArgumentParser(prog="kvtier", description="hierarchical KV cache for LLM serving")
    parser.add_argument("--runtime", help=runtime_help)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser("doctor", help="report devices, host memory kinds, aliases and copy speed",
                                        formatter_class=HelpWithDefaults)
    doctor_parser.add_argument("--runtime", default=argparse.SUPPRESS, help=runtime_help)
    doctor.add_arguments(doctor_parser)
    doctor_parser.set_defaults(run=doctor.command, needs_runtime=True)
    demo_parser = commands.add_parser("demo", help="multi-turn chat through the cache: hits per tier, prefill saved, "
                                                   "bytes moved", formatter_class=HelpWithDefaults)
    demo_parser.add_argument("--runtime", default=argparse.SUPPRESS, help=runtime_help)
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.command, needs_runtime=True)
    shm.add_parser(commands)
    storage.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: this program's arguments); returns its exit code."""
    args = build_parser().parse_args(argv)
    code = run(args)
    if code == INTERRUPTED and argv is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not break the exit with a traceback
    return code


def run(args: argparse.Namespace) -> int:
    try:
        runtime = get_runtime(args.runtime) if getattr(args, "needs_runtime", False) else None
        return int(args.run(runtime, args))
    except KvtierError as exc:
        if interrupted(exc):                 # cleaning up after Ctrl-C failed: the Ctrl-C is what to report
            print(f"kvtier {args.command}: interrupted", file=sys.stderr)
            return INTERRUPTED
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except OSError as exc:                   # the machine said no (a full disk under --save, a closed pipe)
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get(DEBUG):
            raise
        print(f"kvtier {args.command}: unexpected {type(exc).__name__}: {exc} (a kvtier bug: {DEBUG}=1 shows the "
              f"traceback; please report it)", file=sys.stderr)
        return 1


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled (a Ctrl-C inside an emulated kernel
    poisons the device, and closing the pools then fails)."""
    seen: BaseException | None = exc
    for _ in range(32):                      # a chain of contexts, bounded (they can loop)
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())

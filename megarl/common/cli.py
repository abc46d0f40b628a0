"""Top-level error handling shared by every megarl console script.

Contract (docs/reliability.md): bad input ends in ONE line ``<prog>: <message>`` on stderr and a
non-zero exit status, never a traceback; ``--debug`` (accepted anywhere on the command line)
lets the exception propagate so Python prints the traceback. Argument errors are one line too
(argparse's usage block is replaced by a pointer to ``--help``).

    def main(argv=None):
        argv, debug = pop_debug(sys.argv[1:] if argv is None else argv)
        return run_main("megarl-x", lambda: _main(argv), debug, expected=(MyError,), code=2)

Importing this module is cheap (standard library only): entry points use it before torch.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

DEBUG_FLAG = "--debug"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: message (see --help)``, exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help="print the full traceback of an error instead of one line")


def pop_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug``, and whether it was there (for entries without argparse)."""
    argv = list(argv)
    return [a for a in argv if a != DEBUG_FLAG], DEBUG_FLAG in argv


def one_line(prog: str, e: BaseException, expected: bool) -> str:
    """``prog: message`` cut to its first line; unexpected errors also name their type."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    text = str(msg).strip() or type(e).__name__
    if not expected:
        text = f"{type(e).__name__}: {text} (rerun with {DEBUG_FLAG} for the traceback)"
    return f"{prog}: {text}".splitlines()[0]


def run_main(prog: str, fn: Callable[[], int], debug: bool,
             expected: tuple[type[BaseException], ...] = (), code: int = 1) -> int:
    """Runs ``fn``; an ``expected`` error (bad input) exits ``code``, any other error exits 1,
    both as one line on stderr. With ``debug`` every error propagates (full traceback)."""
    try:
        return fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the entry point's last line of defence
        if debug:
            raise
        known = isinstance(e, expected)
        print(one_line(prog, e, known), file=sys.stderr, flush=True)
        return code if known else 1


def config_args(prog: str, doc: str, argv: list[str]) -> tuple[str, list[str]]:
    """``CONFIG.yaml [a.b=c ...]`` of an entry that takes a run config (megarl-train, megarl-eval):
    ``-h`` prints ``doc``; no config is the usage line and exit 2."""
    if argv and argv[0] in ("-h", "--help"):
        print(doc)
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):
        print(f"{prog}: usage: {prog} CONFIG.yaml [a.b=c ...] [--debug] (see --help)", file=sys.stderr)
        raise SystemExit(2)
    return argv[0], argv[1:]

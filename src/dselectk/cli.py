"""Command line: ``dselectk demo | bench [ARGS]``, plus the commands of installed add-ons.

The CLI parses arguments and calls modules; it holds no logic of its own. ``dselectk demo``
trains the library's demo (:mod:`dselectk.demo`). Other packages add commands through the entry
point group ``dselectk.commands``: each entry point names a function ``register(subparsers)``
that adds its sub-parser and sets the default ``handler`` (a function ``args -> int``). The
research part of the repository (``pip install -e research``) adds ``dselectk reproduce`` and
``dselectk report`` this way; without it those two commands say how to install it.
``dselectk bench`` runs ``python -m benchmarks`` in a subprocess from the source checkout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from dselectk import demo
from dselectk.runtime import tune_allocator

__all__ = ["COMMAND_GROUP", "main", "source_root"]

#: the entry point group through which other packages add subcommands
COMMAND_GROUP = "dselectk.commands"

#: commands the research part provides, and the line that says how to get them
_RESEARCH_COMMANDS = {
    "reproduce": "reproduce an experiment of the paper (needs the research part)",
    "report": "rebuild report and plots of a results folder (needs the research part)",
}
_RESEARCH_HINT = (
    "`dselectk {command}` comes with the research part of the repository: from a clone, "
    "run `pip install -e research` (or `make reproduce`)"
)


def _missing(command: str) -> int:
    print(f"dselectk: error: {_RESEARCH_HINT.format(command=command)}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dselectk", description="DSelect-k gates for mixture-of-experts models."
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a small multi-gate MoE with DSelect-k on generated data")
    demo.add_arguments(d)
    d.set_defaults(handler=demo.run)

    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    for command, text in _RESEARCH_COMMANDS.items():
        if command not in sub.choices:
            missing = sub.add_parser(command, help=text, add_help=False)
            missing.add_argument("rest", nargs=argparse.REMAINDER)
            missing.set_defaults(handler=lambda args, c=command: _missing(c))

    bench = sub.add_parser("bench", help="run the benchmark suite (same as python -m benchmarks)")
    bench.epilog = "Other arguments go to the suite; see `dselectk bench --help-suite`."
    bench.add_argument("--help-suite", action="store_true", help="show the suite's options")
    return parser


def source_root() -> Path | None:
    """The source checkout holding this package (src layout), if it has ``benchmarks/``."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks" / "__main__.py").is_file() else None


def _bench(help_suite: bool, extra: Sequence[str]) -> int:
    root = source_root()
    if root is None:
        print("dselectk bench needs a source checkout (benchmarks/ is not installed)")
        return 2
    suite_args = ["--help"] if help_suite else [a for a in extra if a != "--"]
    cmd = [sys.executable, "-m", "benchmarks", *suite_args]
    return subprocess.run(cmd, cwd=root, check=False).returncode


#: errors that a user's input causes (bad values, files, folders): one line and exit code 2
USER_ERRORS = (ValueError, TypeError, OSError)


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed (CPU or GPU), not another runtime error."""
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line.split("DefaultCPUAllocator: ")[-1][:200]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dselectk`` command.

    A user error (a bad value, a missing or corrupt file, an unwritable folder, sizes that do
    not fit in memory) prints one line ``dselectk: error: ...`` and returns 2; ``--debug`` shows
    the traceback instead.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    tune_allocator()
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _dispatch(args, extra)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"dselectk: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if args.debug or not _out_of_memory(e):
            raise
        # finished runs are saved (records are written atomically when a run ends)
        print(
            f"dselectk: error: out of memory ({_first_line(e)}): the sizes the flags ask for do "
            "not fit this machine; lower them (repetitions, experts, tasks, examples, batch)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        # records are written atomically when a run ends: nothing finished is lost
        print(
            "\ndselectk: interrupted; finished runs are saved: run the same command again to "
            "resume (or `dselectk report DIR` to rebuild the report from the records)",
            file=sys.stderr,
        )
        return 130


def _dispatch(args: argparse.Namespace, extra: Sequence[str]) -> int:
    if args.command == "bench":
        return _bench(args.help_suite, extra)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

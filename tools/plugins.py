"""`--plugin MODULE` for the command-line tools: a plug-in's rows (a family, above all) are there
before a tool reads a table, as the run config's `plugins:` are for a run.

    argv = import_plugin_args(sys.argv[1:])   # imports each --plugin module; exits 2 naming a bad one
    add_plugin_argument(parser)               # so that --help lists it and the parser accepts it
"""
from __future__ import annotations

import argparse
import sys

from gspo_tables import TableError, import_plugins


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="a plug-in module to import first: its rows (a model family, ...) join the tables "
                             "(repeatable; docs/extending.md)")


def import_plugin_args(argv: list[str] | None) -> list[str] | None:
    """Import the modules `--plugin MODULE` names in `argv` (sys.argv[1:] when None), before a parser
    whose choices come from the tables is built; a module that does not import exits 2 in one line."""
    pre = argparse.ArgumentParser(add_help=False)
    add_plugin_argument(pre)
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        import_plugins(known.plugin, "--plugin")
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return argv

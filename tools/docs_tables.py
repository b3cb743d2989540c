"""The docs' tables of the extension points, written from the rows themselves.

    python tools/docs_tables.py           # rewrite every generated table in docs/
    python tools/docs_tables.py --check   # exit 1 naming the docs whose tables are stale (a test runs it)

`<!-- tables -->` ... `<!-- end tables -->` holds one line per table (what, the field that names a
row, its rows). A generated table sits between `<!-- table: WHAT -->` and `<!-- end table -->`, WHAT a
table's `what` (gspo_tables.TABLES: "loss", "advantage estimator", "reward", ...). Its columns:
the row's name, its description, its own settings (the fields of `settings`, where any row has
some), and the peers' names for it (where any row has some). Nothing in those tables is written by
hand: a row added to a table (a plug-in's included, when its module is imported first) appears in
every doc that shows the table.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gspo_tables import TABLES, Table, settings_fields  # noqa: E402

TABLE_MODULES = ("gspo_megatron.algorithms.registry", "gspo_megatron.algorithms.terms",
                 "gspo_megatron.algorithms.advantage.table", "gspo_megatron.sync.transports",
                 "rollout.rewards.registry", "rollout.envs", "rollout.prompts.formats", "model_specs.families")
"""The modules that make the project's tables (importing them fills gspo_tables.TABLES)."""
BLOCK = re.compile(r"(<!-- table: (?P<what>[^>]+?) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)
SUMMARY = re.compile(r"(<!-- tables -->\n)(.*?)(<!-- end tables -->)", re.S)
PEERS = {"verl": "verl", "roll": "ROLL", "slime": "slime"}


def all_tables() -> dict[str, Table]:
    for module in TABLE_MODULES:
        importlib.import_module(module)
    return dict(TABLES)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(table: Table) -> str:
    """The markdown table of `table`'s rows (module docstring)."""
    rows = {name: table[name] for name in table.choices(references=False)}
    settings = {name: settings_fields(row) for name, row in rows.items()}
    peers = {name: getattr(row, "peers", None) or {} for name, row in rows.items()}
    head = ["name", "what"] + (["its own settings"] if any(settings.values()) else []) + \
        (["the peers' names"] if any(peers.values()) else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, description in table.choices(references=False).items():
        cells = [f"`{name}`", _cell(description)]
        if len(head) > 2 and head[2] == "its own settings":
            cells.append(", ".join(f"`{f}`" for f in settings[name]) or "")
        if head[-1] == "the peers' names":
            cells.append("; ".join(f"{PEERS.get(p, p)} " + ", ".join(f"`{n}`" for n in names)
                                   for p, names in peers[name].items() if names))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_summary(tables: dict[str, Table]) -> str:
    """One line per table: what its rows are, the config field that names one, the rows."""
    lines = ["| table | named by | rows |", "|---|---|---|"]
    for what, table in sorted(tables.items()):
        lines.append(f"| {what} | `{table.field}` | {', '.join(f'`{n}`' for n in table.choices(references=False))} |")
    return "\n".join(lines) + "\n"


def rewrite(text: str, tables: dict[str, Table], where: str) -> str:
    def block(match: re.Match) -> str:
        what = match.group("what").strip()
        if what not in tables:
            raise SystemExit(f"{where}: <!-- table: {what} --> names no table (tables: {', '.join(tables)})")
        return match.group(1) + render(tables[what]) + match.group(4)
    text = SUMMARY.sub(lambda m: m.group(1) + render_summary(tables) + m.group(3), text)
    return BLOCK.sub(block, text)


def docs() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated table is stale; write nothing")
    args = p.parse_args(argv)
    tables, stale = all_tables(), []
    for doc in docs():
        text = doc.read_text()
        new = rewrite(text, tables, str(doc.relative_to(ROOT)))
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python tools/docs_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

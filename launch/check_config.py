"""Check a run config and its --set overrides before anything is allocated (the launchers call this).

    python launch/check_config.py CONFIG.yaml --world-size 16 [--reserved checkpoint.dir=GSPO_CHECKPOINT_DIR]
                                  [--set parallel.tensor=2 ...]

Prints nothing and exits 0 when the inputs are usable; otherwise prints one line per problem and exits
2. Checked: the file is readable YAML holding a mapping; every override is `dotted.key=value`; no
override sets a key the launcher owns (`--reserved KEY=ENV_VAR` names the variable to use instead);
and the trainer world size fits the layout the config and overrides ask for. The world-size rules are
ParallelLayout.validate's (gspo_megatron/parallel/layout.py); the model-dependent ones (layers, heads,
experts) stay with the trainer, which knows the model. Only PyYAML is imported: this runs on a login
node in a fraction of a second.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _lookup(tree: object, dotted: str) -> object:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def check(config: Path, world_size: int, overrides: list[str], reserved: dict[str, str]) -> list[str]:
    problems: list[str] = []
    try:
        tree = yaml.safe_load(config.read_text())
    except OSError as e:
        return [f"config {config}: cannot read it ({e.strerror})"]
    except yaml.YAMLError as e:
        return [f"config {config}: not valid YAML ({' '.join(str(e).split())})"]
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        return [f"config {config}: expected a YAML mapping at the top, got {type(tree).__name__}"]

    effective: dict[str, object] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not KEY.match(key):
            problems.append(f"override {item!r}: expected --set dotted.key=value")
            continue
        if key in reserved:
            problems.append(f"override {key}: the launcher sets it; use {reserved[key]} instead")
            continue
        try:
            effective[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            effective[key] = value

    def layout_value(name: str, default: int) -> int:
        key = f"parallel.{name}"
        value = effective[key] if key in effective else _lookup(tree, key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key} must be an integer >= 1, got {value!r}")
            return default
        return value

    tp = layout_value("tensor", 1)
    pp = layout_value("pipeline", 1)
    ep = layout_value("expert", 1)
    etp = layout_value("expert_tensor", 0) or tp  # unset (or refused): expert-TP = TP
    if world_size % (tp * pp):
        problems.append(f"trainer world size {world_size} (trainer nodes x ranks per node) is not "
                        f"divisible by parallel.tensor x parallel.pipeline = {tp} x {pp} = {tp * pp}")
    elif world_size % (etp * ep * pp):
        problems.append(f"trainer world size {world_size} is not divisible by parallel.expert_tensor x "
                        f"parallel.expert x parallel.pipeline = {etp} x {ep} x {pp} = {etp * ep * pp}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--reserved", action="append", default=[], metavar="KEY=ENV_VAR")
    args = parser.parse_args(argv)
    reserved = dict(r.split("=", 1) for r in args.reserved)
    problems = check(args.config, args.world_size, args.overrides, reserved)
    for p in problems:
        print(p)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

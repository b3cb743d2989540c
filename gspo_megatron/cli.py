"""The `gspo-megatron` command.

    gspo-megatron train examples/tiny_moe_larger_digit.yaml [--set a.b=c ...]
    torchrun --nproc-per-node 2 $(which gspo-megatron) train CONFIG --set parallel.tensor=2
    gspo-megatron config [CONFIG] [--plugin M]  # every config field, its docstring, default and choices
    gspo-megatron plan CONFIG --gpus 64 --model Qwen3-235B-A22B   # layouts that fit (planner/)
    gspo-megatron migrate --from roll|verl|slime FILE > run.yaml   # a peer's config in ours (config/peers/)

Known failures (bad config, missing file, unreachable server, impossible layout, unusable
checkpoint: every GspoError, gspo_errors/__init__.py) print one line `gspo-megatron: error: ...` on stderr
and exit with the error's code: 2 for the inputs, 3 for a run that stopped on a runtime failure
after its checks passed, 75 when no SGLang (or teacher) server is left, which a Slurm requeue
retries; anything else is a bug and keeps its traceback. A signal exits with 128 + its number
after saving (trainer.train). The config, the layout against the model and the world size, and
the prompt set are checked before torch and megatron-core are imported (run/preflight.py), so
those errors cost a fraction of a second.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo_errors import GspoError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gspo-megatron", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run GSPO training (resumes from checkpoint.dir/latest)")
    t.add_argument("config", help="YAML run config (see `gspo-megatron config`)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set parallel.tensor=2 (repeatable)")
    c = sub.add_parser("config", help="print every config field with its default and docstring, and each "
                       "table's rows (a run config's plug-ins, or --plugin's, included)")
    c.add_argument("config", nargs="?", help="a run config whose `plugins:` to import first")
    c.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="a plug-in module to import first (repeatable)")
    m = sub.add_parser("migrate", help="a ROLL, verl or slime config in this project's YAML (stdout); what "
                       "was carried or not, and why, on stderr")
    m.add_argument("--from", dest="peer", required=True, choices=("roll", "verl", "slime"),
                   help="roll: ROLL's pipeline YAML; verl: its YAML or Hydra key=value lines; slime: its flags")
    m.add_argument("file", help="the peer's config file")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set one of our fields in the output, e.g. --set model.hf_path=/models/x (repeatable)")
    from gspo_megatron.planner.arguments import add_arguments
    add_arguments(sub.add_parser("plan", help="layouts that fit a model on N GPUs: memory per GPU, "
                                 "largest token budget, estimated step time (--check runs one)"))
    return p


def _error(e: "GspoError") -> int:
    """One line on stderr, `gspo-megatron: error: MESSAGE`; returns the error's exit code."""
    where = f" (rank {os.environ.get('RANK', '0')})" if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    message = " ".join(str(e).split()) if "\n" not in str(e) else str(e).strip()
    from gspo_megatron.parallel.layout import LayoutError
    if isinstance(e, LayoutError) and not message.startswith("parallel."):
        message = f"parallel: {message}"  # the config section whose sizes do not fit
    print(f"gspo-megatron: error{where}: {message}", file=sys.stderr)
    return e.exit_code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from gspo_megatron.config import describe_fields, load_config
    from gspo_errors import GspoError
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    try:
        if args.command == "config":
            from gspo_megatron.config.parsing import build, read_yaml_mapping
            from gspo_megatron.config.schema import RunConfig
            from gspo_tables import import_plugins
            import_plugins(args.plugins, "--plugin")
            if args.config:  # its plug-ins, and the rows its fields name as package.module:Name
                data = read_yaml_mapping(args.config)
                import_plugins(data.get("plugins") or [], "plugins")
                build(RunConfig, data)
            print(describe_fields())
            return 0
        if args.command == "migrate":
            from gspo_megatron.config.peers import migrate
            migration = migrate(args.peer, args.file, args.overrides)
            print(migration.report(), file=sys.stderr)
            print(migration.yaml(), end="")
            return 0
        if args.command == "plan":
            quiet_expected_warnings()
            from gspo_megatron.planner.command import run
            return run(args)
        cfg = load_config(args.config, args.overrides)
        from gspo_megatron.run.preflight import check_before_torch
        check_before_torch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        quiet_expected_warnings()
        from gspo_megatron.trainer import train
        return train(cfg)  # a signal's exit code (128 + signum) comes back from train
    except GspoError as e:
        return _error(e)


if __name__ == "__main__":
    sys.exit(main())

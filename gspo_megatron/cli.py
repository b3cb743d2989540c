"""The `gspo-megatron` command.

    gspo-megatron train examples/tiny_moe_larger_digit.yaml [--set a.b=c ...]
    torchrun --nproc-per-node 2 $(which gspo-megatron) train CONFIG --set parallel.tensor=2
    gspo-megatron config                      # every config field with its docstring and default
    gspo-megatron plan CONFIG --gpus 64 --model Qwen3-235B-A22B   # layouts that fit (planner/)

Known failures (bad config, missing file, unreachable server, impossible layout, unusable
checkpoint) print one line `gspo-megatron: error: ...` on stderr and exit with code 2; anything
else is a bug and keeps its traceback. The config, the layout against the model and the world
size, and the prompt file are checked before torch and megatron-core are imported
(early_checks.py), so those errors cost a fraction of a second.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings


def known_errors() -> tuple[type[BaseException], ...]:
    from gspo_megatron.checkpoint.hf_files import DamagedFileError
    from gspo_megatron.checkpoint.manager import CheckpointError
    from gspo_megatron.checkpoint.model_io import CheckpointMismatchError
    from gspo_megatron.checkpoint.output_dirs import OutputDirError
    from gspo_megatron.checkpoint.run_lock import RunLockedError
    from gspo_megatron.config import ConfigError
    from gspo_megatron.driver import DriverError
    from gspo_megatron.parallel.layout import LayoutError
    from gspo_megatron.sync.weight_sync import WeightSyncError
    from model_specs import HFConfigError
    from rollout.client import SGLangError
    from rollout.dataset import PromptFileError
    from rollout.envs import EnvironmentSpecError
    from rollout.rewards import RewardErrorBudgetExceeded, RewardSpecError, RewardWorkerError
    from rollout.rewards.http_service import RewardServiceError
    from rollout.rewards.sandbox import SandboxUnavailable
    from rollout.server import ServerStartError
    return (ConfigError, HFConfigError, LayoutError, FileNotFoundError, PromptFileError,
            ServerStartError, SGLangError, CheckpointError, CheckpointMismatchError,
            WeightSyncError, RewardErrorBudgetExceeded, DriverError, DamagedFileError,
            EnvironmentSpecError, OutputDirError, RunLockedError, RewardSpecError, RewardWorkerError,
            RewardServiceError, SandboxUnavailable)


def quiet_expected_warnings() -> None:
    """Warnings a run prints that say nothing the user can act on, silenced:
    - megatron-core says at import, a dozen lines, that Transformer Engine and Apex are missing, and
      torch that there is no CUDA runtime: on a CPU that is expected (the run prints the compute
      settings it resolved instead);
    - torch's deprecations that megatron-core 0.16.1's own checkpoint code hits at every load
      (`load_state_dict` -> `load` in dist_checkpointing/strategies/torch.py:799, ShardedTensor ->
      DTensor): megatron's to change, not the user's (README, "What the main job prints")."""
    warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed",
                            category=UserWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gspo-megatron", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run GSPO training (resumes from checkpoint.dir/latest)")
    t.add_argument("config", help="YAML run config (see `gspo-megatron config`)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set parallel.tensor=2 (repeatable)")
    sub.add_parser("config", help="print every config field with its default and docstring")
    from gspo_megatron.planner.arguments import add_arguments
    add_arguments(sub.add_parser("plan", help="layouts that fit a model on N GPUs: memory per GPU, "
                                 "largest token budget, estimated step time (--check runs one)"))
    return p


def _error(e: BaseException) -> int:
    where = f" (rank {os.environ.get('RANK', '0')})" if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    message = " ".join(str(e).split()) if "\n" not in str(e) else str(e).strip()
    from gspo_megatron.parallel.layout import LayoutError
    if isinstance(e, LayoutError) and not message.startswith("parallel."):
        message = f"parallel: {message}"  # the config section whose sizes do not fit
    print(f"gspo-megatron: error{where}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from gspo_megatron.config import ConfigError, describe_fields, load_config
    if args.command == "config":
        print(describe_fields())
        return 0
    if args.command == "plan":
        quiet_expected_warnings()
        from gspo_megatron.planner.command import run
        from gspo_megatron.planner.plan import PlanError
        try:
            return run(args)
        except (ConfigError, PlanError, FileNotFoundError) as e:
            return _error(e)
        except Exception as e:  # noqa: BLE001 - layout and model errors are known; others are bugs
            from gspo_megatron.parallel.layout import LayoutError
            from model_specs.hf_config import HFConfigError
            if isinstance(e, (LayoutError, HFConfigError)):
                return _error(e)
            raise
    from gspo_megatron.checkpoint.run_lock import RunLockedError
    from gspo_megatron.early_checks import early_checks
    from gspo_megatron.parallel.layout import LayoutError
    from model_specs.hf_config import HFConfigError
    from rollout.dataset import PromptFileError
    try:
        cfg = load_config(args.config, args.overrides)
        early_checks(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, LayoutError, HFConfigError, PromptFileError, FileNotFoundError, RunLockedError) as e:
        return _error(e)
    quiet_expected_warnings()
    errors = known_errors()
    from gspo_megatron.stop import SignalExit
    from gspo_megatron.trainer import ServersLost, train
    from rollout.health import EXIT_NO_SERVER
    try:
        return train(cfg)
    except SignalExit as e:
        saved = f"saved a checkpoint of {e.saved} in {cfg.checkpoint.dir}; " if e.saved else ""
        print(f"gspo-megatron: {e.args[0].split(':')[0]} (rank {os.environ.get('RANK', '0')}): {saved}"
              f"exiting with {e.exit_code} (the same command resumes)", file=sys.stderr, flush=True)
        return e.exit_code
    except ServersLost as e:
        _error(e)
        return EXIT_NO_SERVER
    except KeyboardInterrupt:
        print(f"gspo-megatron: interrupted (rank {os.environ.get('RANK', '0')})", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - filtered just below
        if not isinstance(e, errors):
            raise
        return _error(e)


if __name__ == "__main__":
    sys.exit(main())

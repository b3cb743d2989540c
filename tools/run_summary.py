"""The closing lines of a run (scripts/main_job.sh prints them): the reward curve's ends, the
held-out accuracy at both ends, where the final policy is (or that the config exports none), and
the TensorBoard command, every path as the config names it (relative ones stay relative).

    python tools/run_summary.py examples/tiny_moe_larger_digit.yaml [--set KEY=VALUE ...]

The folders are the config's, with the same --set overrides the run took (gspo-megatron train's).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def summary(config: str, overrides: list[str]) -> list[str]:
    """The lines, each `[main_job] ...`."""
    from gspo_megatron.config import load_config
    from gspo_megatron.run.metrics import read_scalars
    cfg = load_config(config, overrides)
    tb, export = cfg.logging.tensorboard_dir, cfg.checkpoint.export_hf
    lines = []
    scalars = read_scalars(tb) if tb and Path(tb).is_dir() else {}
    rewards = scalars.get("rollout/reward_mean", [])
    if rewards:
        (s0, r0), (s1, r1) = rewards[0], rewards[-1]
        last = [r for _, r in rewards[-10:]]
        lines.append(f"reward: step {s0} {r0:.3f} -> step {s1} {r1:.3f} (best {max(r for _, r in rewards):.3f}, "
                     f"last {len(last)} steps' mean {sum(last) / len(last):.3f})")
    held_out = scalars.get("eval/accuracy", [])
    if len(held_out) > 1:  # what the policy learned, on phrasings training never showed
        (s0, a0), (s1, a1) = held_out[0], held_out[-1]
        lines.append(f"held-out accuracy (greedy): step {s0} {a0:.3f} -> step {s1} {a1:.3f}")
    if export and (Path(export) / "config.json").is_file():
        lines.append(f"final policy (HF format): {export}")
    elif export:
        lines.append(f"no final policy at {export} (checkpoint.export_hf): the run did not finish")
    else:
        lines.append(f"no HF export: checkpoint.export_hf is not set in {config} (--set checkpoint.export_hf=DIR "
                     "for one; tools/convert_megatron_to_hf.py converts a checkpoint)")
    if tb:
        lines.append(f"watch it: .venv/bin/tensorboard --logdir {tb}")
    return [f"[main_job] {line}" for line in lines]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args, _ = p.parse_known_args(argv)  # main_job.sh hands over what it gave gspo-megatron train
    print("\n".join(summary(args.config, args.overrides)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`gspo-megatron migrate`: a ROLL, verl or slime configuration in this project's YAML.

    gspo-megatron migrate --from roll rlvr_config.yaml > run.yaml        # ROLL's pipeline YAML
    gspo-megatron migrate --from verl ppo_trainer.yaml                   # nested YAML, or Hydra
    gspo-megatron migrate --from verl overrides.txt                      #   key=value lines
    gspo-megatron migrate --from slime flags.txt --set model.hf_path=M   # slime's command-line flags

Our YAML goes to stdout; every key of the input is named on stderr, carried (to which field, by
which formula) or not carried (and why), with notes where a peer's default differs from ours.
Nothing is dropped silently. The printed config passes the trainer's checks (given model.hf_path
and rollout.prompts, which `--set` can supply). The vocabularies: roll.py, verl.py, slime.py; the
peer key -> ours table with formulas: docs/algorithm.md "Coming from ROLL, verl or slime".

May import: gspo_megatron.config (the schema and its checks), the torch-free tables of algorithms.
"""
from __future__ import annotations

from pathlib import Path

from gspo_megatron.config.peers.migration import Migration

PEERS = ("roll", "verl", "slime")


def migrate(peer: str, path: str | Path, overrides: list[str] | None = None) -> Migration:
    """Read `path` in `peer`'s format and translate it (Migration.yaml(), Migration.report())."""
    import importlib
    if peer not in PEERS:
        raise ValueError(f"--from {peer!r}: expected one of {', '.join(PEERS)}")
    module = importlib.import_module(f"gspo_megatron.config.peers.{peer}")
    m = module.read(Path(path))
    module.translate(m)
    m.finish(overrides or [])
    return m

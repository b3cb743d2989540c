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

from gspo_megatron.config.parsing import ConfigError
from gspo_megatron.config.peers.migration import Migration

PEERS = ("roll", "verl", "slime")


def _translated(peer: str, path: Path, overrides: list[str]) -> Migration:
    import importlib
    module = importlib.import_module(f"gspo_megatron.config.peers.{peer}")
    m = module.read(path)
    m.overrides = list(overrides)
    module.translate(m)
    return m


def _reads_as(path: Path, but_not: str) -> str:
    """`; it reads as a ROLL file: --from roll` when another peer's migration carries some of the
    file's keys (the one that carries most), else ""."""
    best, most = "", 0
    for other in PEERS:
        if other == but_not:
            continue
        try:
            carried = len(_translated(other, path, []).carried_keys)
        except Exception:  # noqa: BLE001 - not that peer's format at all
            continue
        if carried > most:
            best, most = other, carried
    if not best:
        return ""
    return f"; it reads as a {Migration(best, '', {}).peer_name} file ({most} keys carried): --from {best}"


def migrate(peer: str, path: str | Path, overrides: list[str] | None = None) -> Migration:
    """Read `path` in `peer`'s format and translate it (Migration.yaml(), Migration.report()). A
    file none of whose keys this peer's migration carries is refused, naming the peer it reads as."""
    if peer not in PEERS:
        raise ValueError(f"--from {peer!r}: expected one of {', '.join(PEERS)}")
    path = Path(path)
    try:
        m = _translated(peer, path, overrides or [])
    except ConfigError as e:  # not this peer's format at all, perhaps another's
        guess = _reads_as(path, peer) if path.is_file() else ""
        if not guess:
            raise
        raise ConfigError(f"{e}{guess}") from None
    if not m.carried_keys:
        raise ConfigError(f"migrate --from {peer}: {str(path)!r}: none of its {len(m.keys)} keys is a "
                          f"{m.peer_name} key this migration carries{_reads_as(path, peer)}")
    m.finish(overrides or [])
    return m

"""The RL loop's own state, beside the model/optimizer checkpoint: what a resume needs to continue
exactly where the interrupted run stopped.

    driver.json        (rank 0) step, data cursor, partial-rollout buffer, scheduler, weight version
    rng/rank_{r}.pt    (every rank) torch CPU/CUDA, python `random`, numpy and megatron's
                       model-parallel RNG tracker states

All of it is plain data (JSON) except the RNG states (torch.save). Files are written then fsynced;
the manager makes the whole step directory visible atomically.
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo_megatron.checkpoint.durable import fsync_file, write_json
from gspo_errors import MissingInputError

DRIVER_FILE = "driver.json"
RNG_DIR = "rng"


@dataclasses.dataclass
class LoopState:
    step: int = 0
    """RL steps completed (the next step to run is `step`)."""
    data_cursor: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Where the prompt stream is (e.g. {"epoch": 0, "index": 17}): rank 0's PromptStream.state()."""
    rollout_buffer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """RolloutManager.to_state(): unfinished (partial) groups and counters."""
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)
    """megatron OptimizerParamScheduler.state_dict()."""
    weight_version: int = 0
    """Version of the weights the SGLang servers were last given."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Anything else the trainer wants back (e.g. {"warm_start_done": true})."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoopState":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"loop state has unknown fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**d)


def save_driver_state(ckpt_dir: Path, state: LoopState) -> None:
    try:
        write_json(ckpt_dir / DRIVER_FILE, state.to_dict())
    except TypeError as e:
        raise TypeError(f"loop state is not JSON-serialisable ({e}); prompt records and the "
                        f"rollout buffer must be plain data") from None


def load_driver_state(ckpt_dir: Path) -> LoopState:
    path = ckpt_dir / DRIVER_FILE
    if not path.is_file():
        raise MissingInputError(f"checkpoint {ckpt_dir} has no {DRIVER_FILE}")
    return LoopState.from_dict(json.loads(path.read_text()))


# --- RNG ---------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG this rank uses: python, numpy, torch CPU (+ CUDA), megatron's tracker."""
    from megatron.core import tensor_parallel
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_rng(ckpt_dir: Path, rank: int) -> None:
    d = ckpt_dir / RNG_DIR
    d.mkdir(exist_ok=True)
    path = d / f"rank_{rank}.pt"
    torch.save(rng_state(), path)
    fsync_file(path)


def load_rng(ckpt_dir: Path, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for this rank (a resume
    with a different world size: the RNG then stays as seeded)."""
    path = ckpt_dir / RNG_DIR / f"rank_{rank}.pt"
    if not path.is_file():
        return False
    set_rng_state(torch.load(path, weights_only=False))
    return True

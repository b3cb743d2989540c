"""Warnings a run prints that say nothing the user can act on, silenced in one place (the command
line calls this before torch and megatron-core are imported); any other warning is printed.

    quiet_expected_warnings()
"""
from __future__ import annotations

import logging
import warnings


def quiet_expected_warnings() -> None:
    """Warnings a run prints that say nothing the user can act on, silenced:
    - megatron-core says at import, a dozen lines, that Transformer Engine and Apex are missing, and
      torch that there is no CUDA runtime: on a CPU that is expected (the run prints the compute
      settings it resolved instead);
    - torch's deprecations that megatron-core 0.16.1's own checkpoint code hits at every load
      (`load_state_dict` -> `load` in dist_checkpointing/strategies/torch.py
      TorchDistLoadShardedStrategy.load, which 0.19 calls `load`; ShardedTensor -> DTensor):
      megatron's to change, not the user's (README, "What the main job prints")."""
    warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed",
                            category=UserWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor",
                            category=FutureWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

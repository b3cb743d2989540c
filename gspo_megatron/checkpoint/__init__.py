"""Checkpoints: the model's weights under any parallel layout, and HF <-> megatron conversion.

    from gspo_megatron.checkpoint import save_model, load_model
    save_model(model_chunks, ckpt_dir, hf_dir=hf_dir)   # collective
    load_model(model_chunks, ckpt_dir)                  # any TP/PP/EP/VPP layout

Offline conversion: gspo_megatron.checkpoint.convert (tools/convert_hf_to_megatron.py) and
gspo_megatron.checkpoint.export (tools/convert_megatron_to_hf.py). Also the light pieces the run's
start-up checks use before torch: output folders (output_dirs.py), the run lock (run_lock.py),
fingerprints, durable writes.

May import: parallel, model_specs; never config, run, driver, actor, sync, trainer or cli.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["CheckpointMismatchError", "check_layout_fits", "checkpoint_hf_config", "load_model",
           "model_sharded_state_dict", "save_model"]


if TYPE_CHECKING:  # the names as the checker sees them; at run time __getattr__ imports them
    from gspo_megatron.checkpoint.model_io import (CheckpointMismatchError, check_layout_fits, checkpoint_hf_config,
                                                   load_model, model_sharded_state_dict, save_model)
else:
    def __getattr__(name: str) -> Any:
        """The model I/O names load megatron-core on first use (PEP 562), so that the package's light
        modules (run_lock, output_dirs, durable) serve start-up checks that come before torch: a second
        run on a locked folder stops in about a second, not after megatron's imports."""
        if name in __all__:
            return getattr(importlib.import_module("gspo_megatron.checkpoint.model_io"), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Checkpoints: the model's weights under any parallel layout, and HF <-> megatron conversion.

    from gspo_megatron.checkpoint import save_model, load_model
    save_model(model_chunks, ckpt_dir, hf_dir=hf_dir)   # collective
    load_model(model_chunks, ckpt_dir)                  # any TP/PP/EP/VPP layout

Offline conversion: gspo_megatron.checkpoint.convert (tools/convert_hf_to_megatron.py) and
gspo_megatron.checkpoint.export (tools/convert_megatron_to_hf.py).
"""
from gspo_megatron.checkpoint.model_io import (CheckpointMismatchError, check_layout_fits,
                                               checkpoint_hf_config, load_model,
                                               model_sharded_state_dict, save_model)

__all__ = ["CheckpointMismatchError", "check_layout_fits", "checkpoint_hf_config", "load_model",
           "model_sharded_state_dict", "save_model"]

"""The policy model on megatron-core: build for a layout, log-probs on the last pipeline stage,
old log-probs (forward only) and GSPO train steps through megatron's pipeline schedule.

    from gspo_megatron.actor import Actor, TrainBatch, OptimizerSettings, LossSettings
"""
from gspo_megatron.actor.actor import Actor
from gspo_megatron.actor.batch import MicroBatch, TrainBatch, balanced_sizes, micro_batches
from gspo_megatron.actor.build import OptimizerSettings, build_model_chunks, build_optimizer, check_layout
from gspo_megatron.actor.forward import LogProbSettings
from gspo_megatron.actor.train import LossSettings, compute_old_log_probs, train_step
from gspo_megatron.actor.weights import full_state_dict, load_full_state_dict

__all__ = [
    "Actor", "TrainBatch", "MicroBatch", "balanced_sizes", "micro_batches", "OptimizerSettings",
    "build_model_chunks", "build_optimizer", "check_layout", "LogProbSettings", "LossSettings",
    "compute_old_log_probs", "train_step", "full_state_dict", "load_full_state_dict",
]

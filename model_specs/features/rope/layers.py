"""The TransformerConfig that carries YaRN's fields to megatron-core's GPTModel (the mapping:
features/rope/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """TransformerConfig + the yarn_* attributes GPTModel reads with getattr when
    position_embedding_type="yarn" (megatron-core gpt_model.GPTModel.__init__; 0.16.1 and 0.19.2
    declare them on no config class of the GPT path)."""

    yarn_rotary_scaling_factor: float = 1.0
    """HF rope_scaling.factor: the context extension factor (interpolation divides by it)."""
    yarn_original_max_position_embeddings: int = 4096
    """HF rope_scaling.original_max_position_embeddings: the pretraining context length."""
    yarn_beta_fast: float = 32.0
    """HF rope_scaling.beta_fast: rotations above which a dimension is extrapolated."""
    yarn_beta_slow: float = 1.0
    """HF rope_scaling.beta_slow: rotations below which a dimension is interpolated."""
    yarn_mscale: float = 1.0
    """Kept at 1 together with yarn_mscale_all_dim (megatron's concentration factor = 1); the
    attention factor is applied through softmax_scale (features/rope/__init__.py)."""
    yarn_mscale_all_dim: float = 1.0
    """See yarn_mscale."""
    yarn_correction_range_round_to_int: bool = True
    """HF rope_scaling.truncate: round the ramp's bounds to integers."""

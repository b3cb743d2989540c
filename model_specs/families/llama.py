"""Llama (LlamaForCausalLM)."""
from __future__ import annotations

from model_specs.families import Family
from model_specs.features.attention import GQA
from model_specs.features.rope import Rope

FAMILIES = (
    # Dense: GQA, no biases (mlp_bias=true is refused by the decoder), RoPE without scaling.
    Family("llama", ("llama",), (GQA(), Rope())),
)

"""The tensor shapes an HF config implies, for checking a model folder without loading it.

    problem = shape_mismatch(hf, {"model.embed_tokens.weight": [151936, 1024], ...})
    # "model.embed_tokens.weight has shape (151936, 1024), config.json implies (152064, 1024)
    #  (vocab_size, hidden_size)", or None

Torch-free and family-independent: it knows the Llama-style names most decoder families share
(Llama, Qwen2/3 and their MoE, GLM-4.5, DeepSeek-V3's embedding, norms and experts), and checks
only the tensors whose shape the config fixes without a family table: a model of a family this
project does not train (a distillation teacher may be any model SGLang serves) is checked as far
as its names go. What it catches is what SGLang's weight loader would refuse after loading for a
minute: a vocab_size, hidden_size, head count or layer count that the weights do not have.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _dims(hf: Mapping[str, Any]) -> dict[str, int | None]:
    """The config's dimensions by name (None where the config has none)."""
    get = lambda key: int(hf[key]) if hf.get(key) is not None else None  # noqa: E731
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
    return {"vocab_size": get("vocab_size"), "hidden_size": hidden, "num_attention_heads": heads,
            "head_dim": head_dim, "num_key_value_heads": get("num_key_value_heads") or heads,
            "intermediate_size": get("intermediate_size"),
            "moe_intermediate_size": get("moe_intermediate_size"), "num_experts": experts, "two": 2}


def _rules(hf: Mapping[str, Any]) -> list[tuple[re.Pattern, tuple[str, ...]]]:
    """(name pattern, the dimensions of its shape, by config field) for what the config fixes."""
    mla = hf.get("kv_lora_rank") is not None  # DeepSeek-V3's attention has other projections
    # Qwen3-Next: q_proj also holds each head's output gate
    gated = bool(hf.get("attn_output_gate")) or hf.get("model_type") == "qwen3_next"
    rules = [
        (r"model\.embed_tokens\.weight", ("vocab_size", "hidden_size")),
        (r"lm_head\.weight", ("vocab_size", "hidden_size")),
        (r"model\.norm\.weight", ("hidden_size",)),
        (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", ("hidden_size",)),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", ("intermediate_size", "hidden_size")),
        (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ("hidden_size", "intermediate_size")),
        (r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up)_proj\.weight",
         ("moe_intermediate_size", "hidden_size")),
        (r"model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj\.weight",
         ("hidden_size", "moe_intermediate_size")),
        (r"model\.layers\.\d+\.mlp\.gate\.weight", ("num_experts", "hidden_size")),
    ]
    if not mla:
        rules += [(r"model\.layers\.\d+\.self_attn\.q_proj\.weight",
                   ("two*num_attention_heads*head_dim" if gated else "num_attention_heads*head_dim",
                    "hidden_size"))]
        rules += [
            (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", ("num_key_value_heads*head_dim", "hidden_size")),
            (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ("hidden_size", "num_attention_heads*head_dim")),
            (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", ("head_dim",)),
        ]
    return [(re.compile(f"^{p}$"), dims) for p, dims in rules]


def _size(dims: Mapping[str, int | None], expr: str) -> int | None:
    out = 1
    for name in expr.split("*"):
        if dims[name] is None:
            return None
        out *= dims[name]  # type: ignore[operator]
    return out


def shape_mismatch(hf: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The first tensor (name -> shape, from the safetensors headers; leave out integer tensors:
    packed quantized weights have other shapes) whose shape is not the one `hf` (a normalised
    config.json) implies, or a layer count the weights do not have; None when every checked tensor
    agrees."""
    text = hf.get("text_config") or hf
    dims = _dims(text)
    rules = _rules(text)
    for name, shape in shapes.items():
        for pattern, exprs in rules:
            if pattern.match(name):
                want = tuple(_size(dims, e) for e in exprs)
                if None not in want and tuple(shape) != want:
                    fields = ", ".join(exprs)
                    return (f"{name} has shape {tuple(shape)}, config.json implies {want} ({fields})")
                break
    layers = text.get("num_hidden_layers")
    found = {int(m.group(1)) for m in map(_LAYER.match, shapes) if m}
    if layers is not None and found:
        extra = int(text.get("num_nextn_predict_layers") or 0)  # GLM-4.5's MTP layers follow the model's
        missing = sorted(set(range(int(layers))) - found)
        beyond = sorted(i for i in found if i >= int(layers) + extra)
        if missing:
            return f"config.json has num_hidden_layers={layers}, the weights have no layer {missing[0]}"
        if beyond:
            return f"config.json has num_hidden_layers={layers}, the weights have a layer {beyond[0]}"
    return None

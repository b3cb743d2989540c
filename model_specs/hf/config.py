"""Reading Hugging Face config.json files: the one place that knows HF's field names.

    hf = load_hf_config("/models/Qwen3-30B-A3B")     # dict, field names normalised
    pattern = moe_layer_pattern(hf, hf["num_hidden_layers"])   # 1 = MoE layer, 0 = dense

Every model_specs module reads HF configs through here; an HF config this project cannot map
raises `HFConfigError` naming the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from gspo_errors import InputError, MissingInputError


class HFConfigError(InputError, ValueError):
    """An HF config.json that this project cannot map; the message names the field."""


def normalize_hf_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """An HF config dict with the field names model_specs reads.

    transformers >= 5 writes `num_local_experts` (attribute_map of num_experts) and nests
    `rope_theta` under `rope_parameters`; older configs have `num_experts` and `rope_theta`. Without
    this, a transformers-5 Qwen3 config (rope_theta 1e6) would silently get RoPE base 10000.
    GLM-4.5 names its routed experts `n_routed_experts`; transformers 5 also moves
    `partial_rotary_factor` into `rope_parameters`. Legacy `rope_scaling` dicts spell the type
    `type`; it is copied to `rope_type`."""
    out = dict(hf)
    for alias in ("num_local_experts", "n_routed_experts"):
        if out.get("num_experts") is None and out.get(alias) is not None:
            out["num_experts"] = out[alias]
    rope = out.get("rope_parameters") or {}
    # transformers (modeling_rope_utils.py, standardize_rope_params): rope_parameters' values win
    # over the top-level fields (setdefault into rope_parameters)
    for key in ("rope_theta", "partial_rotary_factor"):
        if rope.get(key) is not None:
            out[key] = rope[key]
    if rope.get("rope_type", "default") != "default" and not out.get("rope_scaling"):
        out["rope_scaling"] = rope  # features/rope/ maps YaRN, rejects the other types
    scaling = out.get("rope_scaling")
    if isinstance(scaling, Mapping) and "rope_type" not in scaling and "type" in scaling:
        out["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
    return out


def load_hf_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A normalised config dict from a dict, a config.json path, or an HF model directory."""
    if isinstance(source, Mapping):
        return normalize_hf_config(dict(source))
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MissingInputError(f"no HF config.json at {path}")
    try:
        return normalize_hf_config(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise HFConfigError(f"{path} is not UTF-8 text ({e.reason} at byte offset {e.start})") from None


def require(hf: Mapping[str, Any], key: str, family: str) -> Any:
    """hf[key], or HFConfigError naming the family and the missing field."""
    if key not in hf or hf[key] is None:
        raise HFConfigError(f"{family} config.json lacks required field '{key}'")
    return hf[key]


def moe_layer_pattern(hf: Mapping[str, Any], num_layers: int) -> list[int]:
    """1 = MoE layer, 0 = dense. GLM-4.5 (`first_k_dense_replace`): the first k layers are dense.
    Qwen2/3-MoE: layer i is sparse unless listed in mlp_only_layers or off the sparse step."""
    if hf.get("first_k_dense_replace") is not None:
        k = int(hf["first_k_dense_replace"])
        return [0 if i < k else 1 for i in range(num_layers)]
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers)]


def left_out_layers_note(hf: Mapping[str, Any]) -> str | None:
    """The line a run prints at its start when the HF checkpoint holds layers that the model leaves
    out: the multi-token-prediction layers of GLM-4.5 and DeepSeek-V3 (`num_nextn_predict_layers`,
    after the model's own); None when there are none."""
    extra = int(hf.get("num_nextn_predict_layers") or 0)
    if not extra:
        return None
    first = int(hf.get("num_hidden_layers") or 0)
    return (f"the checkpoint's {extra} multi-token-prediction layer(s) (num_nextn_predict_layers, "
            f"model.layers.{first}.*) are left out, as transformers leaves them out: they are "
            "neither trained nor exported, so SGLang cannot draft with them (speculative decoding, "
            "NEXTN) for the trained policy")


def model_dims(hf: Mapping[str, Any], family: str, moe: bool) -> dict[str, Any]:
    """The dimensions a parallel layout must divide: num_layers, num_attention_heads,
    num_query_groups, vocab_size, num_experts (None for a dense model), and for Qwen3-Next
    linear_num_key_heads (its Gated DeltaNet's)."""
    heads = int(require(hf, "num_attention_heads", family))
    linear = hf.get("linear_num_key_heads")
    return dict(num_layers=int(require(hf, "num_hidden_layers", family)), num_attention_heads=heads,
                num_query_groups=int(hf.get("num_key_value_heads") or heads),
                vocab_size=int(require(hf, "vocab_size", family)),
                num_experts=int(require(hf, "num_experts", family)) if moe else None,
                **({"linear_num_key_heads": int(linear)} if linear is not None else {}))

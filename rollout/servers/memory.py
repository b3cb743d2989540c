"""SGLang's --mem-fraction-static for a CPU server, derived from what the run asks of it.

    fraction = cpu_mem_fraction_static("/models/tiny", max_total_tokens=16384, dtype="float32")

On CPU, SGLang sizes its KV cache from the machine's free memory, measured twice in the
scheduler: B before the model loads, A after. It refuses to start when

    A - B * (1 - mem_fraction_static) <= 0
    (sglang 0.5.23, srt/mem_cache/kv_cache_configurator.py KVCacheConfigurator._profile_available_bytes,
    "Loaded weights leave no GPU memory for the KV cache"),

and the KV cache gets what is left of that, at most --max-total-tokens tokens (its
_apply_token_constraints). With A = B - W - D (W: the weights it loaded, D: whatever else took
memory between the two measurements: the scheduler's own buffers, and on a shared machine other
processes, e.g. a second server starting beside it), a KV cache of K bytes for max_total_tokens
fits when

    mem_fraction_static * B >= W + K + D.

A constant fraction (0.05) holds that on an idle machine with plenty of memory and fails when D
grows (a busy CI machine: a trainer and another server loading at the same time) or when B is
small. Here D is bounded by HEADROOM_BYTES, B is the free memory now, and the fraction is
(W + K + HEADROOM_BYTES) / B, between FLOOR and CEILING. A larger fraction costs nothing on CPU:
the pool is capped by --max-total-tokens, so it never allocates more than K.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

HEADROOM_BYTES = 4 << 30
"""What other processes may take between SGLang's two measurements (D above): measured 0.2 GiB
for one tiny server alone on an idle machine; a few GiB when a trainer and a second server start
beside it."""
FLOOR, CEILING = 0.05, 0.9

_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "F32": 4, "BF16": 2,
          "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}


def free_memory_bytes() -> int:
    """Free memory as SGLang reads it on CPU (srt/utils/common.py get_free_cpu_memory and
    get_available_gpu_memory): psutil's available, at most the cgroup's limit less its use, per
    NUMA node."""
    import psutil
    free = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit.isdigit() and used.isdigit():
            free = min(free, max(0, int(limit) - int(used)))
    except OSError:
        pass
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    return free // nodes


def weight_elements(model_dir: str | Path) -> int:
    """Elements of every tensor in the model's safetensors files (their headers only)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    total = 0
    for name in files:
        with open(model_dir / name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes of one token: keys and values of every layer (MHA/GQA), or the compressed
    latent and its RoPE part (MLA: DeepSeek-V3, Kimi-K2)."""
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    if text.get("kv_lora_rank"):  # MLA keeps one latent per token and layer
        return layers * (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))) * dtype_bytes
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def cpu_mem_fraction_static(model_dir: str | Path, max_total_tokens: int | None,
                            dtype: str | None = None, free_bytes: int | None = None) -> float:
    """The fraction of the module docstring for a CPU server of `model_dir` serving in `dtype`
    (None: float32, the CPU default) with a KV cache of `max_total_tokens` tokens (None: no cap,
    the floor: SGLang would fill whatever the fraction leaves). free_bytes: None, measured now."""
    if max_total_tokens is None:
        return FLOOR
    model_dir = Path(model_dir)
    dtype_bytes = _BYTES.get(dtype or "float32", 4)
    config = json.loads((model_dir / "config.json").read_text())
    weights = weight_elements(model_dir) * dtype_bytes
    kv = max_total_tokens * kv_bytes_per_token(config, dtype_bytes)
    free = free_memory_bytes() if free_bytes is None else free_bytes
    fraction = (weights + kv + HEADROOM_BYTES) / max(free, 1)
    return round(min(CEILING, max(FLOOR, fraction)), 4)

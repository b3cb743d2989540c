"""tools/gpu_check.py's references for the Actor's log-probs: transformers on the same device in the
row's dtype (the tolerance is held against it), and transformers in float64, which says which
side is off when the two disagree.

    ref = hf_log_probs(hf_dir, batch, torch.float32, "cuda")
    exact, why = fp64_log_probs(hf_dir, batch, "cuda")      # None and why where float64 cannot run
    vs = against_fp64(ours, ref, exact, mask, tol)          # each side's distance, the outlier
    vs["ok"]                                                # ours within tol of float64
    ours_flipped(hf_dir, mcore, batch, exact, mask, dtype)   # where ours is the outlier

Why float64: on an H200 (docs/results.md) gpt-oss's fp32 log-probs were 8.9e-4 from transformers' where
Qwen3-MoE's and DeepSeek-V3's were 1.4e-6. On CPU both sides are within 5e-7 of transformers in
float64, for the tiny gpt-oss and for it without each of its features in turn (sinks, the sliding
window, the SwiGLU clamp, the router's bias, YaRN), so the difference comes from a path that only
runs on CUDA, on one side or the other: transformers' (its grouped-GEMM experts, its eager
attention with sinks) or ours (Transformer Engine's fused RoPE and MoE permutation, which the
local spec takes wherever TE imports; megatron's fused bias-dropout-add; the router's GEMM, which
megatron hands to TE, in TF32: ROUTER_FP64). Float64 on the same device names the side; where it
is ours, the row also runs ours with each of those paths off (flips()).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Flips of ours, each a set of TransformerConfig fields over the machine's defaults.
ROPE_AND_PERMUTE = "without TE's fused RoPE and MoE permutation"
EVERY_FUSION = "every fusion off (the CPU's flags)"
ROUTER_FP64 = "the router's GEMM by torch in float64"
"""megatron hands an fp32 router GEMM to TE's GEMM wherever TE imports, which computes it in TF32
(moe_utils.RouterGatingLinearFunction, megatron-core 0.16 and 0.19); float64 takes torch's path.
On CPU, that GEMM's inputs rounded to TF32 give qwen3_moe and deepseek_v3 1.2-1.4e-6 from float64
(the H200's 1.43e-6, against 6.6e-7 in fp32) and gpt-oss without its router bias 2.5e-2, a top-k
choice flipped (benchmarks/fp64_reference.py)."""


def hf_log_probs(hf_dir: Path, batch: Any, dtype: torch.dtype, device: str,
                 experts: str | None = None) -> torch.Tensor:
    """Target-aligned log-probs [b, s] of the transformers model (column t: log p(token t)), in
    float64 on the host; `experts`: transformers' experts_implementation (None: its default,
    grouped_mm, which takes no float64)."""
    import transformers
    kwargs = {"experts_implementation": experts} if experts else {}
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, **kwargs)
    model = model.to(device).eval()
    with torch.no_grad():
        logits = model(batch.tokens.to(device)).logits.double()  # [b, s, v]
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None].to(device))[..., 0]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1).cpu()


def fp64_log_probs(hf_dir: Path, batch: Any, device: str) -> tuple[torch.Tensor | None, str]:
    """transformers in float64 with its eager experts, or None and why (a kernel with no float64:
    Qwen3-Next's delta rule where flash-linear-attention is installed)."""
    try:
        return hf_log_probs(hf_dir, batch, torch.float64, device, experts="eager"), ""
    except Exception as e:  # noqa: BLE001 - the row then holds ours to transformers alone
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:160]


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| on the masked positions, in float64."""
    return float((a.double() - b.double()).abs()[mask].max())


def against_fp64(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor | None, mask: torch.Tensor,
                 tol: float, why: str = "") -> dict[str, Any]:
    """Each side's max |log-prob - float64| on the masked positions and the outlier: the side
    beyond `tol` of float64 while the other is within ("ours", "transformers"), "both", or "none".
    ok: ours within tol of float64 (no float64: None, and the row keeps its comparison with
    transformers)."""
    if exact is None:
        return dict(ours=None, transformers=None, outlier=None, ok=None, why=why)
    e_ours, e_theirs = masked_max_diff(ours, exact, mask), masked_max_diff(theirs, exact, mask)
    off = [side for side, e in (("ours", e_ours), ("transformers", e_theirs)) if e > tol]
    outlier = off[0] if len(off) == 1 else ("both" if off else "none")
    return dict(ours=e_ours, transformers=e_theirs, outlier=outlier, ok=e_ours <= tol, why="")


def fp64_cell(vs: dict[str, Any] | None) -> str:
    """'; fp64: ours E, transformers E (outlier: SIDE)' or '; fp64: - (why)'."""
    if not vs:
        return ""
    if vs["ours"] is None:
        return f"; fp64: - ({vs['why']})" if vs["why"] else ""
    flips = "".join(f"; ours {k}: {v:.2e}" if isinstance(v, float) else f"; ours {k}: {v}"
                    for k, v in vs.get("flips", {}).items())
    eager = vs.get("transformers_eager_experts")
    theirs = f"transformers {vs['transformers']:.2e}" + (f" (eager experts {eager:.2e})" if eager is not None else "")
    return f"; fp64: ours {vs['ours']:.2e}, {theirs}, outlier {vs['outlier']}{flips}"


def flips() -> dict[str, dict[str, Any]]:
    """The flips of ours that ours_flipped runs (module docstring): the paths that only CUDA takes."""
    from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
    return {ROPE_AND_PERMUTE: dict(apply_rope_fusion=False, moe_permute_fusion=False),
            EVERY_FUSION: {k: False for k, v in cpu_config_overrides().items()
                           if v is False and (k.endswith("fusion") or k == "persist_layer_norm")},
            ROUTER_FP64: dict(moe_router_dtype="fp64")}


def ours_flipped(hf_dir: Path, mcore: Path, batch: Any, exact: torch.Tensor, mask: torch.Tensor,
                 dtype: torch.dtype) -> dict[str, float | str]:
    """Ours (local spec) with each of flips(): its max |log-prob - float64|."""
    from gspo_megatron.actor import Actor, LossSettings
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.actor.settings import ComputeSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    out: dict[str, float | str] = {}
    for name, fields in flips().items():
        try:
            spec = spec_for_layout(hf_dir, ParallelLayout(), params_dtype=dtype, overrides=fields,
                                   compute=ComputeSettings(transformer_engine=False))
            with Actor(spec, ParallelLayout(), loss=LossSettings(name="gspo"), micro_batch_size=2) as actor:
                actor.load_weights(mcore)
                lp, _ = actor.compute_old_log_probs(actor.shard(batch))
            if lp is None:  # one process is the last pipeline stage: its log-probs are there
                raise RuntimeError("no log-probs on the last stage")
            out[name] = masked_max_diff(lp, exact, mask)
        except Exception as e:  # noqa: BLE001 - a diagnostic: its failure is its cell
            out[name] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return out


def tf32_envelope(hf_dir: Path, mcore: Path, batch: Any, mask: torch.Tensor, device: str,
                  build: Any, tol: float) -> dict[str, Any]:
    """The local spec in fp32 with torch's TF32 matmuls on: how far TF32 alone moves the tiny
    model's log-probs from transformers' (fp32, TF32 off) on this GPU. `build(hf_dir, spec,
    dtype)`: gpu_check's Actor."""
    ref = hf_log_probs(hf_dir, batch, torch.float32, device)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with build(hf_dir, "local", torch.float32) as actor:
            actor.load_weights(mcore)
            lp, _ = actor.compute_old_log_probs(actor.shard(batch))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    diff = (lp - ref).abs()[mask]
    return dict(spec="local+tf32", dtype="fp32", lp_max=float(diff.max()), lp_mean=float(diff.mean()),
                tol=tol, ok=float(diff.max()) <= tol)

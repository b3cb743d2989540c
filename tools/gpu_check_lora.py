"""LoRA's GPU-only paths against the local spec on the same GPU, as one table: the Transformer Engine
spec's fused norm-linear layers (an adapter there multiplies the layer's own norm of its input,
recomputed in torch: gspo_megatron/lora/attach.py _normed_input) and its grouped-GEMM experts (one
ExpertLora called on every expert's rows: _grouped_hook).

    python tools/gpu_check_lora.py                     # on a GPU (scripts/gpu_acceptance.sh row 1.9)
    python tools/gpu_check_lora.py --cpu-smoke         # the local spec alone, on CPU: the tool's own path

Rows, in fp32 on one GPU, the tiny Qwen3-MoE (tools/make_tiny_model.py), rank-8 adapters on every
linear layer and expert with a random B: the TE actor's log-probs with B at zero equal its base's
bit for bit; its adapted log-probs equal the local spec's (TE computes fp32 GEMMs in TF32:
gpu_check.py TF32_TOL), and its dense policy with the adapters merged in (lora/merge.py
merged_in_place); after one GSPO step the adapters' gradients equal the local spec's (relative
to their size, TF32_TOL). Exits 1 if a row fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpu_check import TF32_TOL  # noqa: E402 - after the path

RANK = 8


def _actor(hf_dir: Path, spec: str):
    import torch

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import ComputeSettings, MicroBatchSettings
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    return Actor(str(hf_dir), ParallelLayout(), optimizer=OptimizerSettings(lr=1e-3, clip_grad=0.0),
                 loss=LossSettings(name="gspo", eps_low=0.5, eps_high=0.5),
                 batching=MicroBatchSettings(micro_batch_size=2, pack_sequences=False),
                 params_dtype=torch.float32, lora=LoraSettings(rank=RANK, alpha=2 * RANK),
                 compute=ComputeSettings(transformer_engine=spec == "te"))


def _batch():
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([24, 20, 17, 24])
    t = torch.arange(24)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, 500, (4, 24), generator=g), 0)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=(t >= 6) & (t < lengths[:, None]),
                      advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _run(hf_dir: Path, ckpt: Path, spec: str, adapters: dict | None) -> dict:
    """One spec: zero-B identity, then the given adapters' log-probs, merged log-probs, gradients."""
    from gspo_megatron.lora.attach import adapters_off
    from gspo_megatron.lora.merge import merged_in_place
    out: dict = {}
    with _actor(hf_dir, spec) as actor:
        actor.load_weights(ckpt)
        batch = _batch()
        zero, _ = actor.compute_old_log_probs(batch)
        with adapters_off(actor.models):
            base, _ = actor.compute_old_log_probs(batch)
        out["zero_b"] = bool((zero == base).all())
        if adapters is None:
            import torch
            g = torch.Generator().manual_seed(1)
            adapters = {k: v if not k.endswith(("b", "_b")) else 0.05 * torch.randn(v.shape, generator=g)
                        for k, v in actor.full_adapter_state_dict().items()}
        actor.load_full_adapter_state_dict(adapters)
        out["adapters"] = adapters
        out["log_probs"], _ = actor.compute_old_log_probs(batch)
        with merged_in_place(actor.models):
            out["merged"], _ = actor.compute_old_log_probs(batch)
        batch.old_log_probs = out["log_probs"]
        actor.train_step(batch)
        out["grads"] = actor.full_adapter_state_dict(grads=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the local spec alone, on CPU")
    p.add_argument("--out", help="a folder for the tiny model and its checkpoint (default: a temporary one)")
    args = p.parse_args(argv)
    import torch
    if not args.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or --cpu-smoke")
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from tools.make_tiny_model import make_tiny_model
    work = Path(args.out or tempfile.mkdtemp(prefix="gspo-gpu-lora-"))
    hf_dir = make_tiny_model("qwen3_moe", work / "hf", seed=0)
    ckpt = convert_hf_to_megatron(hf_dir, work / "mcore")
    rows = []
    local = _run(hf_dir, ckpt, "local", None)
    rows.append(("local", "B = 0 is the base, bit for bit", 0.0, local["zero_b"]))
    d = float((local["log_probs"] - local["merged"]).nan_to_num().abs().max())
    rows.append(("local", "adapters = merged dense policy (log-probs)", d, d <= 1e-5))
    if not args.cpu_smoke:
        te = _run(hf_dir, ckpt, "te", local["adapters"])
        rows.append(("te", "B = 0 is the base, bit for bit", 0.0, te["zero_b"]))
        for name, a, b in (("adapters = local spec's (log-probs)", te["log_probs"], local["log_probs"]),
                           ("adapters = merged dense policy (log-probs)", te["log_probs"], te["merged"])):
            d = float((a - b).nan_to_num().abs().max())
            rows.append(("te", name, d, d <= TF32_TOL))
        d = max(float((te["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                for k, g in local["grads"].items())
        rows.append(("te", "adapter gradients = local spec's (relative)", d, d <= TF32_TOL))
    print("\n| spec | check | max diff | result |\n|---|---|---|---|")
    for spec, what, diff, ok in rows:
        print(f"| {spec} | {what} | {diff:.3g} | {'PASS' if ok else 'FAIL'} |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

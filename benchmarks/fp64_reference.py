"""Which side is off where the Actor's log-probs and transformers' disagree: both against
transformers in float64 on CPU, for the tiny MoE families of the GPU check, gpt-oss also without each
of its features in turn, and ours with TF32 rounding emulated where a GPU would apply it.

    .venv/bin/python benchmarks/fp64_reference.py                       # qwen3_moe, deepseek_v3, gpt_oss
    .venv/bin/python benchmarks/fp64_reference.py --archs gpt_oss

Columns (max |log-prob difference| over the loss-masked positions of tools/gpu_check.py's batch,
fp32 unless named): transformers - float64; ours - float64; ours with the router's GEMM in TF32
(megatron hands it to Transformer Engine's GEMM wherever TE imports, TE rounds fp32 GEMM inputs to
TF32: moe_utils.RouterGatingLinearFunction, megatron-core 0.16 and 0.19) - float64; ours with every
matmul's inputs in TF32 (torch's allow_tf32) - transformers fp32, the local+tf32 envelope the GPU
check prints. TF32 is emulated by rounding each fp32 input to 10 mantissa bits before the fp32
product. On an H200 (2026-12-04, docs/results.md) the local spec gave 1.43e-6 for qwen3_moe and
deepseek_v3, 8.94e-4 for gpt_oss, and the local+tf32 envelope 2.26e-4 for qwen3_moe.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

GPT_OSS_FLIPS = ("no sinks", "no router bias", "no sliding window", "no SwiGLU clamp", "no YaRN")


def _variant(base: Path, name: str) -> Path:
    """A copy of the tiny gpt-oss without one feature: sinks at -1e4 (no weight), the router's bias
    zero, every layer full attention, a clamp no activation reaches, plain RoPE."""
    import torch
    from safetensors.torch import load_file, save_file
    out = base.parent / name.replace(" ", "_")
    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if name == "no sinks":
        tensors = {k: torch.full_like(t, -1e4) if k.endswith("sinks") else t for k, t in tensors.items()}
    elif name == "no router bias":
        tensors = {k: torch.zeros_like(t) if k.endswith("router.bias") else t for k, t in tensors.items()}
    elif name == "no sliding window":
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    elif name == "no SwiGLU clamp":
        config["swiglu_limit"] = 1e9
    elif name == "no YaRN":
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
        config.update(rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": theta})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tf32(x: Any) -> Any:
    import torch
    if not torch.is_tensor(x) or x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view_as(x)


def _tf32_matmuls() -> Any:
    """A TorchFunctionMode rounding the fp32 inputs of every matmul to TF32."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    two = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm,
           torch.Tensor.bmm, F.linear}
    added = {torch.baddbmm, torch.addmm, torch.Tensor.baddbmm, torch.Tensor.addmm}

    class Tf32(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in two:
                args = (_tf32(args[0]), _tf32(args[1]), *args[2:])
            elif func in added:
                args = (args[0], _tf32(args[1]), _tf32(args[2]), *args[3:])
            return func(*args, **(kwargs or {}))
    return Tf32()


def _ours(hf_dir: Path, mcore: Path, batch: Any, router_tf32: bool = False, tf32: bool = False) -> Any:
    import torch
    from megatron.core.transformer.moe import moe_utils

    from tools.gpu_check import _actor
    actor = _actor(hf_dir, "local", torch.float32)
    actor.load_weights(mcore)
    saved = moe_utils.te_general_gemm
    if router_tf32:  # what TE's GEMM does with the router's fp32 inputs (module docstring)
        def gemm(weight, inp, dtype, layout="TN", bias=None):
            out = _tf32(inp.to(dtype)) @ _tf32(weight.to(dtype)).t()
            return (out if bias is None else out + bias,)
        moe_utils.te_general_gemm = gemm
    try:
        with _tf32_matmuls() if tf32 else contextlib.nullcontext():
            lp, _ = actor.compute_old_log_probs(actor.shard(batch))
    finally:
        moe_utils.te_general_gemm = saved
        actor.close()
    return lp.double()


def _rows(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[tuple[str, list[float]]]:
    import torch

    from tools.gpu_check import _batch
    from tools.gpu_check_reference import fp64_log_probs, hf_log_probs, masked_max_diff
    out = []
    for name, hf_dir, mcore in cases:
        hf, config = Path(hf_dir), json.loads((Path(hf_dir) / "config.json").read_text())
        batch = _batch(int(config["vocab_size"]), seq=min(48, int(config["max_position_embeddings"])))
        exact, why = fp64_log_probs(hf, batch, "cpu")
        assert exact is not None, why
        theirs = hf_log_probs(hf, batch, torch.float32, "cpu")
        mask = batch.loss_mask
        out.append((name, [masked_max_diff(theirs, exact, mask),
                           masked_max_diff(_ours(hf, Path(mcore), batch), exact, mask),
                           masked_max_diff(_ours(hf, Path(mcore), batch, router_tf32=True), exact, mask),
                           masked_max_diff(_ours(hf, Path(mcore), batch, tf32=True), theirs, mask)]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", default=["qwen3_moe", "deepseek_v3", "gpt_oss"])
    args = p.parse_args()
    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from tools.make_tiny_model import make_tiny_model
    work = Path(tempfile.mkdtemp(prefix="gspo-fp64-"))
    try:
        cases = []
        for arch in args.archs:
            base = make_tiny_model(arch, work / arch / "hf", seed=0)  # tools/gpu_check.py's models
            dirs = [(arch, base)] + [(f"{arch}, {flip}", _variant(base, flip))
                                     for flip in (GPT_OSS_FLIPS if arch == "gpt_oss" else ())]
            for name, hf_dir in dirs:  # the converter runs outside torch.distributed
                mcore = convert_hf_to_megatron(hf_dir, hf_dir.parent / (hf_dir.name + "_mcore"))
                cases.append((name, str(hf_dir), str(mcore)))
        rows = run_distributed(_rows, 1, args=(cases,), timeout=3600,
                               env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| model | transformers - fp64 | ours - fp64 | ours, router GEMM in TF32 - fp64 | "
          "ours, every matmul in TF32 - transformers |\n|---|---|---|---|---|")
    for name, v in rows:
        print(f"| {name} | " + " | ".join(f"{x:.2e}" for x in v) + " |")


if __name__ == "__main__":
    main()

"""Policy-update throughput per configuration: GSPO step time, tokens/s, padding, MFU (CUDA), GSPO/CE.

    .venv/bin/python benchmarks/mfu.py                  # CPU: the tiny Qwen3-MoE, fp32
    python benchmarks/mfu.py --device cuda              # GPU: Qwen3-30B-A3B layer shapes, bf16

One process, one device. A batch of rows with uniform random lengths (GPU: 16 rows in [512, 2048];
CPU: 32 rows in [8, 128]) with old log-probs computed once; each configuration times the GSPO
train step (forward + backward + optimizer, megatron's schedule) over --reps repeats after a
warm-up, and reports the median. On CUDA one more step runs under torch.profiler: "GPU busy" is
its kernels' device time over its wall time (goal >= 85%), and the ten ops with the most GPU time
are printed for the last configuration.

Counting rule (MFU): FLOPs of the REAL tokens only (padding is waste, not work) over the step
time, against --peak-tflops (790: the bf16 dense peak measured on an H100). Per real token,
training costs 6 x N_active (N_active: parameters a token passes through: attention, the router,
top-k experts, norms, the output layer; not the embedding lookup), plus causal attention:
6 x layers x heads x head_dim x L per token of a row of length L (QK^T and AV, 2 FLOPs per
multiply-add, forward 1/3 and backward 2/3, half of the L^2 pairs by causality).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_30B_LAYERS: dict[str, Any] = dict(  # Qwen3-30B-A3B's layer shapes, 8 layers and 32 experts (1.98B parameters)
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, num_experts=32, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    attention_bias=False)


def active_params(hf: dict) -> int:
    """Parameters one token passes through (see the module docstring)."""
    h, layers, v = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    attn = h * (heads + 2 * kv) * hd + heads * hd * h + 2 * hd + 2 * h  # qkv, proj, qk-norm, 2 norms
    experts = hf["num_experts_per_tok"] * 3 * h * hf["moe_intermediate_size"] + h * hf["num_experts"]
    return layers * (attn + experts) + h + h * v  # final norm, output layer


def train_flops(hf: dict, lengths: list[int]) -> float:
    tokens = sum(lengths)
    attention = 6 * hf["num_hidden_layers"] * hf["num_attention_heads"] * hf["head_dim"] * \
        sum(L * L for L in lengths)  # per row: L tokens x L/2 pairs x 2 (QK, AV) x 2 FLOPs x 3
    return 6.0 * active_params(hf) * tokens + attention


def make_batch(rows: int, lo: int, hi: int, vocab: int, seed: int = 0):
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g)
    s = int(lengths.max())
    t = torch.arange(s)[None]
    return TrainBatch(tokens=torch.randint(0, vocab, (rows, s), generator=g), lengths=lengths,
                      loss_mask=(t >= 8) & (t < lengths[:, None]), advantages=torch.randn(rows, generator=g))


def configurations(device: str):
    """(name, ComputeSettings kwargs, MicroBatchSettings kwargs, LogProbSettings kwargs). Packing
    is said explicitly: left at null it is on wherever the TE spec runs on CUDA, which made every
    CUDA row packed (padding 0.0% throughout, "rows in order x4" included; docs/results.md)."""
    none = dict(moe_grouped_gemm=False, moe_permute_fusion=False, apply_rope_fusion=False,
                bias_activation_fusion=False, gradient_accumulation_fusion=False)
    # rows in rollout order, 4 per micro-batch, padded
    before = dict(micro_batch_size=4, longest_first=False, pack_sequences=False)
    if device == "cpu":
        return [("before: rows in order, 4 per micro-batch, chunk 1024", {}, before, dict(chunk_tokens=1024)),
                ("+ longest first", {}, dict(micro_batch_size=4), dict(chunk_tokens=1024)),
                ("+ chunk from the memory budget", {}, dict(micro_batch_size=4), {}),
                ("+ token budget 1024 (up to 64 rows)", {}, dict(micro_batch_size=64,
                                                                max_tokens_per_micro_batch=1024), {})]
    padded = dict(micro_batch_size=4, pack_sequences=False)
    budget = dict(micro_batch_size=64, max_tokens_per_micro_batch=16384, pack_sequences=False)
    # megatron recomputes these in backward instead of keeping their inputs (TE spec only:
    # layernorm and moe_act need TE and grouped GEMM)
    selective = dict(recompute="selective", recompute_modules=["core_attn", "moe_act", "layernorm"])
    return [("before: TE spec, one GEMM per expert, rows in order x4, chunk 1024", none, before,
             dict(chunk_tokens=1024)),
            ("+ grouped GEMM and TE fusions", {}, before, dict(chunk_tokens=1024)),
            ("+ longest first", {}, padded, dict(chunk_tokens=1024)),
            ("+ chunk from the memory budget", {}, padded, {}),
            ("+ token budget 16384, longest first", {}, budget, {}),
            ("+ packed sequences (THD)", {}, {**budget, "pack_sequences": True}, {}),
            # Memory headroom: 32k and 64k ran out of memory on an H100 with 32 rows (docs/results.md).
            ("+ packed, token budget 32768, selective recompute", selective,
             {**budget, "max_tokens_per_micro_batch": 32768, "pack_sequences": True}, {}),
            ("+ packed, token budget 65536, selective recompute", selective,
             {**budget, "max_tokens_per_micro_batch": 65536, "pack_sequences": True}, {})]


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def gpu_busy(fn) -> tuple[float, list[tuple[str, float]]]:
    """One profiled step: the share of its wall time the GPU spends in kernels (their device
    time summed: one stream at a time in this step), and the ten ops with the most device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    kernels = sum(device_us(e) for e in averages) / 1e6
    top = sorted(((e.key, device_us(e) / 1e6) for e in averages), key=lambda kv: -kv[1])[:10]
    return min(kernels / wall, 1.0), top


def measure(actor, batch, args, flops: float, real_tokens: int) -> dict:
    """Median GSPO and CE step times over --reps after a warm-up, and the step's metrics."""
    from gspo_megatron.actor import LossSettings
    shard = actor.shard(batch)
    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
    times: dict[str, list[float]] = {"gspo": [], "ce": []}
    metrics: dict[str, Any] = {}
    for rep in range(args.reps + 1):
        for loss in ("gspo", "ce"):
            actor.loss = LossSettings(name=loss)
            seconds, m = timed(lambda: actor.train_step(shard), args.device)
            if rep:  # the first repeat warms up
                times[loss].append(seconds)
            metrics = m if loss == "gspo" else metrics
    step = statistics.median(times["gspo"])
    actor.loss = LossSettings(name="gspo")
    busy, top = gpu_busy(lambda: actor.train_step(shard)) if args.device == "cuda" else (None, [])
    return dict(step=step, busy=busy, top=top, tokens_s=real_tokens / step, mfu=flops / step / (args.peak_tflops * 1e12),
                padding=metrics["padding_fraction"], mbs=metrics["num_microbatches"],
                packed=bool(actor.batching.pack_sequences), ratio=step / statistics.median(times["ce"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--only", type=int, nargs="*", help="indices of the configurations to run")
    p.add_argument("--rows", type=int, help="rows in the batch (GPU default 16, CPU 32)")
    args = p.parse_args()
    import torch
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from rollout.servers.ports import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import ComputeSettings, LogProbSettings, MicroBatchSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    if args.device == "cuda":
        hf, dtype = QWEN3_30B_LAYERS, torch.bfloat16
        batch = make_batch(args.rows or 16, 512, 2048, hf["vocab_size"])
    else:
        from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
        hf, dtype = tiny_hf_config(), torch.float32
        batch = make_batch(args.rows or 32, 8, 128, hf["vocab_size"])
    lengths = batch.lengths.tolist()
    flops = train_flops(hf, lengths)
    rows = []
    for k, (name, compute, batching, logprob) in enumerate(configurations(args.device)):
        if args.only and k not in args.only:
            continue
        try:
            # One process for every configuration: close() gives the memory back (Actor.close).
            with Actor(hf, ParallelLayout(), optimizer=OptimizerSettings(lr=1e-6),
                       loss=LossSettings(name="gspo"), logprob=LogProbSettings(**logprob),
                       batching=MicroBatchSettings(**batching), params_dtype=dtype,
                       compute=ComputeSettings(**compute)) as actor:
                rows.append(dict(name=name, **measure(actor, batch, args, flops, sum(lengths))))
        except torch.OutOfMemoryError as e:
            rows.append(dict(name=name, error=f"out of memory ({str(e).splitlines()[0][:60]})"))
        if args.device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows[-1]["peak_gib"] = peak
            torch.cuda.reset_peak_memory_stats()
    print(f"\n{args.device}: {len(lengths)} rows, {sum(lengths)} real tokens (lengths {min(lengths)}-"
          f"{max(lengths)}), {'Qwen3-30B-A3B layer shapes, 8 layers, 32 experts, bf16' if args.device == 'cuda' else 'tiny Qwen3-MoE, fp32'}; "
          f"median of {args.reps}")
    gpu = args.device == "cuda"
    head = " MFU | GPU busy |" if gpu else ""
    tail = " peak GiB |" if gpu else ""
    print(f"| configuration | GSPO step s | tokens/s |{head} packed | padding | micro-batches | GSPO/CE |{tail}")
    print("|---|---|---|" + ("---|---|" if gpu else "") + "---|---|---|---|" + ("---|" if gpu else ""))
    for r in rows:
        peak_cell = f" {r['peak_gib']:.1f} |" if gpu else ""
        if "error" in r:
            print(f"| {r['name']} | {r['error']} |" + " |" * (7 if gpu else 5) + peak_cell)
            continue
        mfu = f" {100 * r['mfu']:.1f}% | {100 * r['busy']:.0f}% |" if gpu else ""
        print(f"| {r['name']} | {r['step']:.3f} | {r['tokens_s']:,.0f} |{mfu} {'yes' if r['packed'] else 'no'} | "
              f"{100 * r['padding']:.1f}% | {r['mbs']:.0f} | {r['ratio']:.2f} |{peak_cell}")

    done = [r for r in rows if r.get("top")]
    if done:  # where the time goes in the last configuration that ran
        print(f"\nGPU time by op, one profiled GSPO step of \"{done[-1]['name']}\" (s):")
        for key, seconds in done[-1]["top"]:
            print(f"  {seconds:8.3f}  {key[:100]}")


if __name__ == "__main__":
    main()

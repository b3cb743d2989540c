"""LoRA against full fine-tuning: the bytes and seconds of one weight sync (the adapters alone,
against a full and a delta sync of the same model) on 2 trainer ranks (gloo, EP2) and a real bf16
CPU SGLang server; the gradient and optimizer memory the trainer holds with and without LoRA,
counted on the built models; then the planner's figures for Qwen3-30B-A3B and Qwen3-235B-A22B.

    python benchmarks/lora.py                       # Qwen3-MoE hidden 512, 4 layers, 8 experts, rank 32
    python benchmarks/lora.py --rank 8 --steps 3
    python benchmarks/lora.py --model DIR --url URL --full-url URL2   # servers already running

Rows of the sync table: "full" (every owner, every tensor whole), "delta, lr X" (every owner, the
elements that changed after a GSPO step at the full fine-tuning's learning rate), "adapters,
per_expert" (rank 0, the adapters after a GSPO step; sync/adapter_sync.py). Bytes are what reaches
the server, in its dtype (bf16 for the servers the benchmark starts). The memory table counts DDP's gradient buffers and the optimizer's state
(Adam's moments, fp32 main copies) of the built actors. The last line:
    lora: sync MB <full> -> <adapters>, optimizer+grad MB <full> -> <lora>, served = trainer <yes|no>
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.sync import _step  # noqa: E402  # one GSPO step on random rows, as the sync benchmark's

BF16_TOL = 0.1  # nats: two bf16 implementations of one model (tools/gpu_check.py BF16_TOL)
PLANNED: list[tuple[str, str, dict[str, Any], int]] = [("Qwen3-30B-A3B", "TP1xPP1xEP8 (8 GPUs)", dict(expert=8), 8),
           ("Qwen3-235B-A22B", "TP4xPP2xEP8 (32 GPUs)", dict(tensor=4, pipeline=2, expert=8, expert_tensor=1), 32)]


def _held_bytes(actor) -> int:
    """Gradient buffers and optimizer state this rank holds (bytes)."""
    import torch
    grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                for c in actor.chunks for b in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", []))
    state = 0
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for st in sub.optimizer.state.values():
            state += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim())
        for group in getattr(sub, "fp32_from_float16_groups", []):
            state += sum(p.numel() * p.element_size() for p in group)
    return grads + state


def _trainer_log_probs(actor, tokens: list[int], n_prompt: int):
    """The trainer's log-probs of tokens[n_prompt:] (last stage; None elsewhere)."""
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    batch = TrainBatch(tokens=torch.tensor([tokens]), lengths=torch.tensor([len(tokens)]),
                       loss_mask=torch.arange(len(tokens))[None] >= n_prompt, advantages=torch.zeros(1))
    log_probs, _ = actor.compute_old_log_probs(batch)
    return None if log_probs is None else log_probs[0, n_prompt:].float()


def _held(actor) -> int:
    """The fuller rank's gradient buffers and optimizer state (bytes; a collective)."""
    import torch
    held = [0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, _held_bytes(actor))
    return max(held)


def _body_full(rank, world, ckpt, url, lr, steps):
    """Full fine-tuning: a full sync, then a delta sync after each GSPO step."""
    import torch

    from gspo_megatron.actor import Actor, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import TensorTransport, WeightSync
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    with Actor(hf, ParallelLayout(expert=2), micro_batch_size=2, params_dtype=torch.bfloat16,
               optimizer=OptimizerSettings(lr=lr, clip_grad=0.0)) as actor:
        actor.load_weights(ckpt)
        sync = WeightSync(actor.chunks, hf, TensorTransport(pool) if pool is not None else None, pool, delta=True)
        out: dict[str, Any] = {"full": [sync.sync(version="full")]}
        reports = []
        for i in range(steps):
            _step(actor, seed=i + 1)
            reports.append(sync.sync(version=f"delta-{i}"))
        out[f"delta, lr {lr:g}"] = reports
        out["held"] = _held(actor)
    return out if rank == 0 else None


def _body_lora(rank, world, ckpt, url, rank_r, lr, steps):
    """LoRA: the adapters created, then synced after each GSPO step; the served policy checked."""
    import torch

    from gspo_megatron.actor import Actor, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.lora.serving import ADAPTER_NAME
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync.adapter_sync import AdapterSync
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    lora = LoraSettings(rank=rank_r, alpha=2 * rank_r, experts="per_expert")
    with Actor(hf, ParallelLayout(expert=2), micro_batch_size=2, params_dtype=torch.bfloat16, lora=lora,
               optimizer=OptimizerSettings(lr=lr, clip_grad=0.0)) as actor:
        actor.load_weights(ckpt)
        if pool is not None:
            pool.use_adapter(ADAPTER_NAME)
        sync = AdapterSync(actor.chunks, hf, pool, lora, name=ADAPTER_NAME)
        sync.sync("adapters-0")
        reports = []
        for i in range(steps):
            _step(actor, seed=i + 1)
            reports.append(sync.sync(version=f"adapters-{i + 1}"))
        adapters = actor.full_adapter_state_dict()
        if adapters is None:
            raise RuntimeError("full_adapter_state_dict(to_all_ranks=True) gave this rank nothing")
        out = {"adapters, per_expert": reports, "held": _held(actor),
               "adapter_params": sum(v.numel() for v in adapters.values())}
        prompt = [5, 77, 301, 12, 9]
        got: list[Any] = [None]
        if pool is not None:  # rank 0
            gen = pool.generate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True})
            got = [(gen.output_ids, gen.logprobs)]
        torch.distributed.broadcast_object_list(got, src=0)
        mine = _trainer_log_probs(actor, prompt + got[0][0], len(prompt))
        diffs: list[float | None] = [None] * world
        torch.distributed.all_gather_object(
            diffs, None if mine is None else float((mine - torch.tensor(got[0][1])).abs().max()))
        out["served_diff"] = max(d for d in diffs if d is not None)
    return out if rank == 0 else None


def _planned(rank: int) -> list[str]:
    """The planner's per-GPU memory (GiB) and sync GB, full fine-tuning and LoRA of rank `rank`."""
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.memory import GiB, MemorySettings, rank_memory
    from gspo_megatron.planner.plan import load_model
    from gspo_megatron.planner.sync_time import SyncSettings, sync_time
    from model_specs.shape import model_shape_for
    rows = []
    for name, lay, fields, world in PLANNED:
        shape = model_shape_for(load_model(name))
        layout = ParallelLayout(**fields)
        for label, lora in (("full", LoraSettings()), (f"LoRA r{rank}, per_expert", LoraSettings(rank=rank)),
                            (f"LoRA r{rank}, shared_outer", LoraSettings(rank=rank, experts="shared_outer"))):
            s = MemorySettings(use_distributed_optimizer=True, lora=lora)
            mem = rank_memory(shape, layout, world, s)
            sync = sync_time(shape, layout, world, SyncSettings(lora=lora))
            rows.append(f"| {name:<16} | {lay:<22} | {label:<23} | {mem.weights / GiB:>7.1f} | "
                        f"{mem.gradients / GiB:>6.1f} | {mem.optimizer / GiB:>9.1f} | {sync.total_bytes / 1e9:>7.2f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rank", type=int, default=32, help="the adapters' rank")
    p.add_argument("--steps", type=int, default=3, help="GSPO steps (and syncs) per row")
    p.add_argument("--lr", type=float, default=1e-6, help="full fine-tuning's learning rate (the delta row)")
    p.add_argument("--lora-lr", type=float, default=1e-5, help="the adapters' learning rate")
    p.add_argument("--model", help="an HF Qwen3-MoE folder instead of making one (--hidden ... ignored)")
    p.add_argument("--url", help="with --model: a bf16 server already serving it with --enable-lora of "
                                 "--rank (lora/serving.py server_args), for the LoRA rows")
    p.add_argument("--full-url", help="with --model: a plain server already serving it, for the full "
                                      "model's rows (its weights are replaced)")
    p.add_argument("--plan-only", action="store_true", help="print the planner's table only")
    args = p.parse_args(argv)
    if (args.url or args.full_url) and not args.model:
        p.error("--url and --full-url need --model (the model the servers serve)")
    plan_rows = _planned(32)
    if not args.plan_only:
        _measured(args)
    print("\nThe planner (gspo-megatron plan; bf16, the distributed optimizer, rank 32; GiB per GPU of "
          "the fullest stage, sync GB to each server):\n")
    print(f"| {'model':<16} | {'layout':<22} | {'training':<23} | {'weights':>7} | {'grads':>6} | "
          f"{'optimizer':>9} | {'sync GB':>7} |")
    print(f"|{'-' * 18}|{'-' * 24}|{'-' * 25}|{'-' * 9}|{'-' * 8}|{'-' * 11}|{'-' * 9}|")
    print("\n".join(plan_rows))


def _measured(args: argparse.Namespace) -> None:
    from distributed import run_distributed
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.lora.lora_settings import LoraSettings
    from gspo_megatron.lora.serving import server_args
    from model_specs import load_hf_config
    from model_specs.hf.config import normalize_hf_config
    from rollout.servers.launch import ServerConfig, ServerGroup
    from tools.make_tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="gspo-bench-lora-"))
    h = args.hidden
    model_dir = Path(args.model) if args.model else make_tiny_model(
        "qwen3_moe", work / "hf", seed=0, hidden_size=h, intermediate_size=2 * h,
        moe_intermediate_size=h // 2, num_hidden_layers=args.layers, num_experts=args.experts,
        num_attention_heads=8, num_key_value_heads=4, head_dim=h // 8)
    hf = normalize_hf_config(load_hf_config(model_dir))
    ckpt = convert_hf_to_megatron(model_dir, work / "mcore")
    # two servers in turn: one a LoRA run uses, and a plain one for the full model's syncs (a
    # LoRA-enabled server wraps its layers, so the loader's placement probe cannot write deltas there)
    with (ServerGroup.attach([args.full_url]) if args.full_url else
          ServerGroup.launch(ServerConfig(model_path=str(model_dir), device="cpu", dtype="bfloat16",
                                          startup_timeout_s=600))) as group:
        got = run_distributed(_body_full, 2, (str(ckpt), group.server_urls[0], args.lr, args.steps),
                              timeout=3600)[0]
    flags = server_args(LoraSettings(rank=args.rank, experts="per_expert"), cuda=False)
    with (ServerGroup.attach([args.url]) if args.url else
          ServerGroup.launch(ServerConfig(model_path=str(model_dir), device="cpu", dtype="bfloat16",
                                          extra_args=flags, startup_timeout_s=600))) as group:
        lora = run_distributed(_body_lora, 2, (str(ckpt), group.server_urls[0], args.rank, args.lora_lr,
                                               args.steps), timeout=3600)[0]
    shutil.rmtree(work, ignore_errors=True)
    held_full, held_lora = got.pop("held"), lora.pop("held")
    adapter_params, served = lora.pop("adapter_params"), lora.pop("served_diff")
    got.update(lora)

    def med(name, key):
        return statistics.median(r[key] for r in got[name])
    print(f"\nQwen3-MoE hidden {hf['hidden_size']}, {hf['num_hidden_layers']} layers, {hf['num_experts']} "
          f"experts; LoRA rank {args.rank} on every linear layer and expert: {adapter_params / 1e6:.2f} M "
          f"adapter parameters; EP2 on 2 gloo ranks, bf16; CPU SGLang servers, bytes in their dtype "
          f"(bf16 unless --full-url / --url say otherwise); medians\n")
    print(f"| {'sync':<22} | {'senders':>7} | {'MB':>8} | {'changed':>7} | {'seconds':>7} |")
    print(f"|{'-' * 24}|{'-' * 9}|{'-' * 10}|{'-' * 9}|{'-' * 9}|")
    for name in got:
        print(f"| {name:<22} | {med(name, 'senders'):>7.0f} | {med(name, 'bytes') / 1e6:>8.2f} | "
              f"{med(name, 'changed_fraction'):>7.4f} | {med(name, 'seconds'):>7.3f} |")
    print(f"\nHeld per rank (the fuller one): gradient buffers + optimizer state, full fine-tuning "
          f"{held_full / 1e6:.1f} MB, LoRA {held_lora / 1e6:.2f} MB ({held_lora / held_full:.4f} of it)")
    print(f"lora: sync MB {med('full', 'bytes') / 1e6:.2f} -> {med('adapters, per_expert', 'bytes') / 1e6:.2f}, "
          f"optimizer+grad MB {held_full / 1e6:.1f} -> {held_lora / 1e6:.2f}, served = trainer "
          f"{'yes' if served <= BF16_TOL else 'no'} (max |log-prob| difference {served:.2g} in bf16, "
          f"within {BF16_TOL:g})")


if __name__ == "__main__":
    main()

"""The GPU acceptance run: the HF -> megatron -> train -> checkpoint -> HF path on one GPU, for the
local and the Transformer Engine layer spec, as one table.

    bash scripts/gpu_check.sh                  # on a GPU machine (megatron-core, TE if installed)
    python tools/gpu_check.py --cpu-smoke      # the same steps on CPU: local spec, fp32 (CI)
    bash scripts/gpu_check.sh --arch deepseek_v3   # another family's tiny model (tools/make_tiny_model.py)
    bash scripts/gpu_check.sh --arch gpt_oss       # the local spec only (attention sinks)
    bash scripts/gpu_check.sh --arch qwen3_next    # Gated DeltaNet: needs flash-linear-attention
    bash scripts/gpu_check.sh --rows local --no-bench  # some rows only (scripts/gpu_acceptance.sh)

Steps, per spec (TE only where it imports) and dtype:
1. a tiny HF Qwen3-MoE (tools/make_tiny_model.py; --arch for another family), 2. converted to megatron (spec-independent),
3. the actor built on the device in fp32 and bf16 and loaded from it, 4. its log-probs against
transformers on the same device (fp32: max |diff| <= 1e-4, TE's fp32 <= TF32_TOL: TE computes fp32
GEMMs in TF32, and a local-spec row with torch's TF32 on shows that envelope; bf16: <= BF16_TOL,
the figure two bf16 implementations of the same model differ by), and both against transformers in
float64 on the device, which names the side that is off where they differ (a row passes within
tol of either; gpu_check_reference.py; where ours is off, ours again without each CUDA-only path);
TE: packed THD micro-batches against padded rows,
before and after one SGD step, same tolerance, with a one-segment control (_packed_vs_padded),
5. one GSPO step, a checkpoint (model + optimizer) saved and loaded into a fresh actor of EACH
spec (bit-exact), 6. the checkpoint exported to HF and compared bit-exactly with the trained
weights, and the untrained conversion exported and compared with the original HF file,
7. (TE, 2+ GPUs) context parallelism: CP2 against CP1 in bf16, log-probs and one GSPO step
(tools/gpu_check_cp.py; a SKIP row with one GPU), 8. (GPU) megatron's optimizer offload against
the optimizer on the GPU, two bf16 GSPO steps (tools/gpu_check_offload.py), 9. the fused log-prob
benchmark in bf16 (GPU only). Then, every Actor closed, the device memory still allocated by what
holds it and what the closes freed (gpu_check_memory.py). A family the run's start checks would
refuse on this machine (Qwen3-Next on Hopper with a Triton that breaks its DeltaNet's backward)
prints one SKIP row with that line instead.
Prints the tables last; exits 1 if any row fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpu_check_memory import memory_cell, memory_key, memory_row  # noqa: E402 - after the path
from tools.gpu_check_reference import (against_fp64, fp64_cell, fp64_log_probs, hf_log_probs,  # noqa: E402
                                       masked_max_diff, ours_flipped, tf32_envelope)
from tools.make_tiny_model import archs  # noqa: E402 - after the path
from tools.plugins import add_plugin_argument, import_plugin_args  # noqa: E402 - after the path

FP32_TOL = 1e-4
# Transformer Engine runs every pure-fp32 GEMM in TF32, with no switch to turn it off
# (transformer_engine/common/gemm/cublaslt_gemm.cu, cublas_gemm: "Use TF32 only for pure FP32
# GEMM" -> CUBLAS_COMPUTE_32F_FAST_TF32, the same in TE 2.2-2.20; torch's allow_tf32 is not read).
# TF32 keeps 10 mantissa bits: a unit roundoff of 2^-11 ~ 4.9e-4 on every GEMM input. So the TE
# spec's fp32 log-probs are TF32 log-probs: 1.45e-4 from transformers on an H100 (docs/results.md),
# where the local spec (torch matmuls, TF32 off) gives 1.4e-6. The TE fp32 rows are held to
# 2^-10 ~ 1e-3 nats, twice TF32's roundoff, and the table prints the envelope that says whether
# that is TF32 alone: the local spec with torch's TF32 turned on ("local+tf32" row).
TF32_TOL = 2.0 ** -10
BF16_TOL = 0.1  # nats: max |log p| difference between two bf16 implementations of the tiny model
PACK_MULTIPLE = 8  # packs padded as under TP8 + sequence parallelism (TP1 alone never pads a pack)
BUILT: list = []  # every Actor of the check: the memory row adds up what their closes freed


def _versions(device: str) -> str:
    import megatron.core
    import torch
    parts = [f"torch {torch.__version__}", f"megatron-core {megatron.core.__version__}"]
    try:
        import transformer_engine
        parts.append(f"TE {transformer_engine.__version__}")
    except Exception:  # noqa: BLE001 - TE is optional
        parts.append("TE not importable")
    if device == "cuda":
        parts.insert(0, torch.cuda.get_device_name(0))
    return ", ".join(parts)


def _batch(vocab: int, rows: int = 4, seq: int = 48, prompt: int = 8):
    import torch

    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (rows, seq), generator=g)
    lengths = torch.tensor([seq, seq - 5, seq - 11, seq - 2])[:rows]
    t = torch.arange(seq)[None]
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=(t >= prompt) & (t < lengths[:, None]),
                      advantages=torch.tensor([1.0, -0.5, 0.5, 0.25])[:rows])


def _actor(hf_dir: Path, spec: str, dtype, pack: bool = False, sgd: bool = False):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.settings import ComputeSettings, MicroBatchSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from tools.gpu_check_cp import LR
    optimizer = OptimizerSettings(optimizer="sgd", lr=LR, clip_grad=0.0) if sgd else OptimizerSettings(lr=1e-3)
    actor = Actor(str(hf_dir), ParallelLayout(), optimizer=optimizer,
                  loss=LossSettings(name="gspo", eps_low=0.5, eps_high=0.5),
                  batching=MicroBatchSettings(micro_batch_size=2, pack_sequences=pack),
                  params_dtype=dtype, compute=ComputeSettings(transformer_engine=spec == "te"))
    BUILT.append(actor)
    return actor


def _one_segment(packed):
    """`packed` with the row boundaries removed: one segment, so attention and RoPE run across the
    whole pack. The packed check's control: it must move the log-probs (fp32: beyond tol)."""
    import dataclasses
    total = int(packed.cu_seqlens[-1])
    return dataclasses.replace(packed, cu_seqlens=packed.cu_seqlens.new_tensor([0, total]), max_seqlen=total)


def _packed_vs_padded(hf_dir: Path, mcore: Path, batch, dtype, name: str, tol: float) -> dict:
    """TE only: packed THD micro-batches against padded rows, each with one on-policy SGD step
    (so the backward through THD attention and rows_from_pack runs too), compared as the CP row
    compares (tools/gpu_check_cp.py: log-probs before and after within tol, loss and counts equal,
    grad norm within 5%). The packed actor pads each pack to a multiple of PACK_MULTIPLE, as under
    TP8 with sequence parallelism, so the padding segment is exercised at TP1. Control: the same
    pack as one segment (rows attend to each other) must differ by more than tol in fp32."""
    from unittest import mock

    from gspo_megatron.actor import steps
    from gspo_megatron.actor.batching import packing
    from tools.gpu_check_cp import compare, on_policy_step
    seq_params = packing.PackedInputs.seq_params
    runs, leak = {}, None
    for pack in (False, True):
        actor = _actor(hf_dir, "te", dtype, pack=pack, sgd=True)
        actor.load_weights(mcore)
        with mock.patch.object(steps, "seq_multiple", lambda: PACK_MULTIPLE if pack else 1):
            if pack:
                assert actor.batching.pack_sequences, "the packed actor did not pack"
                with mock.patch.object(packing.PackedInputs, "seq_params", lambda p: seq_params(_one_segment(p))):
                    leak, _ = actor.compute_old_log_probs(actor.shard(batch))
            runs[pack] = on_policy_step(actor, batch, layout="packed THD" if pack else "padded")
        actor.close()
    row = compare(runs[False], runs[True], batch.loss_mask, tol=tol, spec="te", dtype=name)
    row["leak"] = float((leak - runs[True]["lp"]).abs()[batch.loss_mask].max())
    if name == "fp32":
        row["ok"] &= row["leak"] > tol
    return row


def _packed_cell(p: dict) -> str:
    if "error" in p:
        return f"FAIL: {p['error']}"
    return (f"{p['lp_max']:.1e}, after step {p['after_max']:.1e}, grad norm {p['grad_norm'][1]:.4g} vs "
            f"{p['grad_norm'][0]:.4g}; one-segment control {p['leak']:.2g}")


def wgrad_fusion(actor) -> str:
    """Where the weight-gradient accumulation is fused: Transformer Engine's layers (their own
    fuse_wgrad_accumulation) and megatron's own linears (apex's extension; actor/build.py)."""
    from megatron.core import tensor_parallel
    te, native = [], []
    for name, m in actor.models[0].named_modules():
        if hasattr(m, "fuse_wgrad_accumulation"):
            te.append(bool(m.fuse_wgrad_accumulation))
        elif isinstance(m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)):
            native.append((name, bool(m.gradient_accumulation_fusion)))
    fused = [n for n, f in native if f]
    names = ", ".join(n for n, _ in native) if len(native) <= 2 else f"{len(native)} layers"
    out = f"TE {sum(te)}/{len(te)} fused; " if te else ""
    return out + f"megatron's own ({names}) {len(fused)}/{len(native)} fused"


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def _export(ckpt: Path, dst: Path, plugins: Sequence[str] = ()) -> Path:
    """The converter runs in a process of its own (it needs no process group, this one has one),
    with the plug-ins this one imported (a family of their own)."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_megatron_to_hf.py"), "--megatron",
                    str(ckpt), "--out", str(dst), *(f"--plugin={m}" for m in plugins)], check=True, capture_output=True)
    return dst


def check(out: Path, specs: list[str], dtypes: list[str], device: str,
          arch: str = "qwen3_moe", targets: list[str] | None = None, offload: bool = True,
          plugins: Sequence[str] = ()) -> list[dict]:
    """The rows of `specs` (each trained, its checkpoint loaded into every spec of `targets`,
    default `specs`), then the conversion, memory, CP and optimizer-offload rows (CUDA; offload
    only if `offload`)."""
    import torch
    from safetensors.torch import load_file

    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager
    from model_specs.weights.maps import weight_map_for
    from tools.make_tiny_model import make_tiny_model

    hf_dir = make_tiny_model(arch, out / "hf", seed=0)
    mcore = convert_hf_to_megatron(hf_dir, out / "mcore")
    back = convert_megatron_to_hf(mcore, out / "mcore_back")
    original = load_file(str(hf_dir / "model.safetensors"))
    untrained_export = _max_diff(original, load_file(str(back / "model.safetensors")))
    hf_config = json.loads((hf_dir / "config.json").read_text())
    # DeepSeek-V3's tiny model has 32 positions (YaRN x4 over 8 original ones): rows of 32 still
    # reach beyond the original context
    batch = _batch(int(hf_config["vocab_size"]), seq=min(48, int(hf_config["max_position_embeddings"])))
    mask = batch.loss_mask
    wmap = weight_map_for(hf_config)
    rows = []
    allocated_before = torch.cuda.memory_allocated() if device == "cuda" else 0
    exact, why = fp64_log_probs(hf_dir, batch, device)  # which side is off, where the two differ
    for spec in specs:
        for name in dtypes:
            dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[name])
            actor = _actor(hf_dir, spec, dtype)
            tol = (TF32_TOL if spec == "te" else FP32_TOL) if name == "fp32" else BF16_TOL
            row: dict[str, Any] = dict(spec=spec, dtype=name, tol=tol, wgrad=wgrad_fusion(actor))
            actor.load_weights(mcore)
            lp, _ = actor.compute_old_log_probs(actor.shard(batch))
            ref = hf_log_probs(hf_dir, batch, dtype, device)
            diff = (lp - ref).abs()[mask]
            row.update(lp_max=float(diff.max()), lp_mean=float(diff.mean()))
            row["fp64"] = vs = against_fp64(lp, ref, exact, mask, row["tol"], why)
            row["ok"] = row["lp_max"] <= row["tol"] or vs["ok"] is True  # transformers the one off
            if exact is None:  # no float64 here: the row holds ours to transformers alone
                pass
            elif vs["outlier"] == "ours" and spec == "local" and device == "cuda":
                vs["flips"] = ours_flipped(hf_dir, mcore, batch, exact, mask, dtype)
            elif vs["outlier"] == "transformers":
                vs["transformers_eager_experts"] = masked_max_diff(
                    hf_log_probs(hf_dir, batch, dtype, device, experts="eager"), exact, mask)
            if spec == "te":  # packed (THD) micro-batches against padded rows
                try:
                    row["packed"] = _packed_vs_padded(hf_dir, mcore, batch, dtype, name, row["tol"])
                except Exception as e:  # noqa: BLE001 - a FAIL cell, and the rest of the table still runs
                    import traceback
                    traceback.print_exc()
                    row["packed"] = dict(error=f"{type(e).__name__}: {e}".splitlines()[0][:200], ok=False)
                row["ok"] &= row["packed"]["ok"]
            shard = actor.shard(batch)
            shard.old_log_probs = lp
            metrics = actor.train_step(shard)
            row["loss"] = metrics["loss"]
            row["ok"] &= bool(torch.isfinite(torch.tensor(metrics["loss"])))
            trained = actor.full_state_dict()
            ckpt = CheckpointManager(out / f"ckpt_{spec}_{name}", hf_dir=str(hf_dir))
            path = ckpt.save(1, actor, LoopState(step=1))
            for target in targets or specs:  # the checkpoint loads into either spec, model and optimizer
                with _actor(hf_dir, target, dtype) as other:
                    ckpt.load(path, other)
                    row[f"load_{target}"] = _max_diff(trained, other.full_state_dict())
                row["ok"] &= row[f"load_{target}"] == 0.0
            actor.close()
            exported = load_file(str(_export(path / "model", out / f"hf_{spec}_{name}", plugins) / "model.safetensors"))
            expected = dict(wmap.hf_tensors([(m, trained[m.megatron]) for m in wmap.mappings()]))
            row["export"] = _max_diff(expected, exported)
            row["ok"] &= row["export"] == 0.0
            rows.append(row)
    if device == "cuda" and "te" in specs:  # the TF32 envelope of the TE spec's fp32 rows (TF32_TOL)
        rows.append(tf32_envelope(hf_dir, mcore, batch, mask, device, _actor, TF32_TOL))
    rows.append(dict(spec="conversion", dtype="fp32", untrained_export=untrained_export,
                     ok=untrained_export == 0.0))
    if device == "cuda":  # every Actor above was closed: its memory is back (Actor.close)
        rows.append(memory_row(allocated_before, [a.released for a in BUILT]))
    if "te" in specs and device == "cuda":
        from tools.gpu_check_cp import cp_row
        rows.append(cp_row(out, hf_dir, mcore, batch))
    if device == "cuda" and offload:  # megatron's optimizer offload: CUDA streams, no CPU path
        from tools.gpu_check_offload import offload_row
        rows.append(offload_row(hf_dir, mcore, batch))
    return rows


def refusal(arch: str, available) -> str | None:
    """The line the run's start checks would refuse `arch` with on this machine (Qwen3-Next's
    DeltaNet on Hopper with a Triton that breaks its backward: model_specs/features/gated_delta_net/
    kernels.py), else None. `available`: actor.settings.Available, detected or a test's profile."""
    from model_specs.families import FAMILIES
    from model_specs.features.gated_delta_net import GatedDeltaNet
    from model_specs.features.gated_delta_net.kernels import DeltaRuleKernelError
    if not any(isinstance(f, GatedDeltaNet) for f in FAMILIES[arch].all_features):
        return None
    try:
        available.check_gated_delta_net()
    except DeltaRuleKernelError as e:
        return str(e)
    return None


def table(rows: list[dict]) -> str:
    lines = ["| spec | dtype | log-prob max / mean abs diff vs transformers (tol) | packed vs padded | "
             "GSPO step loss | checkpoint -> local / te (max diff) | export vs trained (max diff) | "
             "wgrad accumulation fusion | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        result = "PASS" if r["ok"] else "FAIL"
        if "skip" in r:
            lines.append(f"| {r['spec']} | {r['dtype']} | - | - | - | - | - | - | SKIP: {r['skip']} |")
            continue
        if r["spec"] in ("te CP2", "offload"):  # their own lines (gpu_check_cp.table, gpu_check_offload)
            continue
        if r["spec"] == "conversion":
            lines.append(f"| HF -> megatron -> HF | fp32 | - | - | - | - | {r['untrained_export']:.1e} | - | {result} |")
            continue
        if r["spec"] == "local+tf32":
            lines.append(f"| local, torch TF32 on (TE's fp32 envelope) | fp32 | {r['lp_max']:.2e} / "
                         f"{r['lp_mean']:.2e} ({r['tol']:.1e}) | - | - | - | - | - | {result} |")
            continue
        if r["spec"] == "memory":
            lines.append(f"| every Actor closed | - | {memory_cell(r)} | - | - | - | - | - | {result} |")
            continue
        loads = " / ".join(f"{r[k]:.1e}" if k in r else "-" for k in ("load_local", "load_te"))
        packed = _packed_cell(r["packed"]) if "packed" in r else "-"
        lines.append(f"| {r['spec']} | {r['dtype']} | {r['lp_max']:.2e} / {r['lp_mean']:.2e} "
                     f"({r['tol']:g}){fp64_cell(r.get('fp64'))} | {packed} | {r['loss']:.4f} | {loads} | "
                     f"{r['export']:.1e} | "
                     f"{r['wgrad']} | {result} |")
    return "\n".join(lines)


def main() -> int:
    import_plugin_args(None)  # a plug-in's family, before --arch's choices are read
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plugin_argument(p)
    p.add_argument("--cpu-smoke", action="store_true", help="local spec, fp32, on the CPU")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--no-bench", action="store_true", help="skip the fused log-prob benchmark")
    p.add_argument("--arch", default="qwen3_moe", choices=archs(), help="the tiny model's family")
    p.add_argument("--rows", nargs="+", choices=["local", "te", "offload"],
                   help="only these rows (default: every one the machine has); a spec's checkpoint still "
                        "loads into every spec the machine has")
    args = p.parse_args()
    import torch
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from rollout.servers.ports import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke for the CPU steps)", file=sys.stderr)
        return 2
    from model_specs.families import FAMILIES
    from model_specs.norms import HAVE_TE
    # a feature may build the local spec only (gpt-oss's attention sinks: model_specs/features/sinks/)
    local_only = any(f.local_spec_only for f in FAMILIES[args.arch].all_features)
    have = ["local"] + (["te"] if HAVE_TE and device == "cuda" and not local_only else [])
    wanted = args.rows or [*have, *(["offload"] if device == "cuda" else [])]
    if "te" in wanted and "te" not in have or "offload" in wanted and device != "cuda":
        here = ", ".join(have + (["offload"] if device == "cuda" else []))
        print(f"gpu_check: --rows {' '.join(wanted)}: {args.arch} on this machine has the rows {here} "
              f"(TE {'imports' if HAVE_TE else 'does not import'}, device {device})", file=sys.stderr)
        return 2
    specs = [s for s in have if s in wanted]
    dtypes = ["fp32"] if args.cpu_smoke else ["fp32", "bf16"]
    from gspo_megatron.actor.settings import Available
    line = refusal(args.arch, Available.detect())
    if line is not None:  # what the run's start would refuse: a SKIP naming why, not a failure
        print(f"\n{_versions(device)}; {args.arch}; specs checked: none")
        print(table([dict(spec=s, dtype="fp32, bf16", skip=line, ok=True) for s in specs]))
        return 0
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gspo-gpu-check-"))
    rows = check(out, specs, dtypes, device, args.arch, targets=have, offload="offload" in wanted,
                 plugins=args.plugin)
    print(f"\n{_versions(device)}; {args.arch}; specs checked: {', '.join(specs)}")
    print(table(rows))
    for r in rows:
        if r["spec"] == "memory":
            print(f"memory after close: {memory_key(r)}")
    for r in rows:
        if r["spec"] == "te CP2":
            from tools.gpu_check_cp import table as cp_table
            print("\ncontext parallelism (TE spec):\n" + cp_table(r))
        if r["spec"] == "offload":
            from tools.gpu_check_offload import describe
            print("\n" + describe(r))
    if device == "cuda" and not args.no_bench:
        print("\nfused log-prob benchmark (bf16):", flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "logprobs_memory.py"), "--device", "cuda",
                        "--dtype", "bf16", "--tokens", "2048", "8192", "--vocab", "151936",
                        "--chunk-tokens", "8192"], check=False)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

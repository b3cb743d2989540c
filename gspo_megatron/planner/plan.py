"""`gspo-megatron plan`: the layouts that fit a model on a cluster, ranked by estimated tokens/s.

    gspo-megatron plan examples/qwen3_235b_a22b.yaml --model Qwen3-235B-A22B --gpus 64

Every TP x PP (x VPP) x EP layout of the world is checked by the project's own validation
(ParallelLayout.validate; a layer count the stages do not divide gets megatron's uneven split);
each valid one gets the per-GPU memory of memory.py at the configured token budget, the largest
budget that fits, and a step-time estimate:

    compute   = FLOPs / (GPU peak x GEMM_EFFICIENCY), FLOPs = 8 x N_active x tokens + attention
                (6 N per trained token, 2 N for the old-log-prob pass), over the world
    bubble    = compute x (PP - 1) / (VPP x micro-batches)              1F1B / interleaved
    TP        = 8 collectives per layer and micro-batch (SP all-gather + reduce-scatter, attention
                and MLP, forward and backward) of tokens x h bytes x (TP - 1) / TP, over NVLink
    EP        = 4 all-to-alls per MoE layer and micro-batch (dispatch + combine, both passes) of
                tokens / TP x top-k x h bytes x (EP - 1) / EP, NVLink inside a node, else the network
    DP        = gradient all-reduce 2 (DP - 1) / DP x gradient bytes, over the network when DP
                spans nodes
    offload   = with train.optimizer_cpu_offload, the larger of the gradients down and weights
                up over PCIe (8 B per offloaded parameter at PCIE_GBS) and the host's Adam over the
                node's offloaded parameters (28 B each read or written at HOST_GBS): megatron
                overlaps the copies with the CPU steps
and step = compute + bubble + TP + EP + DP + offload (no other overlap assumed). The offloaded
state must fit the node's host memory (--host-memory). The weight sync's senders and seconds
(full, delta, through rank 0) are sync_time.py's.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout
from gspo_megatron.planner.memory import GiB, MemorySettings, RankMemory, head_width, rank_memory, with_tokens
from gspo_megatron.planner.sync_time import SyncEstimate, SyncSettings, sync_time
from gspo_errors import InputError


class PlanError(InputError, ValueError):
    """Bad planner input (one line)."""


@dataclass(frozen=True)
class Gpu:
    memory: int
    peak_tflops: float      # bf16 dense
    nvlink_gbs: float       # per GPU, one direction
    network_gbs: float      # per GPU, between nodes


GPUS = {"h100": Gpu(80 * GiB, 989.0, 450.0, 50.0), "h200": Gpu(141 * 10**9, 989.0, 450.0, 50.0),
        "a100": Gpu(80 * GiB, 312.0, 300.0, 25.0)}
# Optimizer offload (estimates, not measured here): a GPU's PCIe Gen5 x16 link moves about 25 GB/s
# each way end to end from pinned memory (half of its 64 GB/s); the host's Adam is bound by memory
# bandwidth, about 200 GB/s of a two-socket node's 300-600 GB/s peak with 8 processes sharing it.
PCIE_GBS = 25.0
HOST_GBS = 200.0
HOST_MEMORY = 2 * 10**12  # an 8-GPU H100 node (DGX H100: 2 TB)
# The share of the peak the GEMMs of an MoE step reach (a calibration constant: a hand-tuned H100
# run reached 22.8% MFU end to end, docs/results.md; megatron reports ~47% for Mixtral-scale MoE).
GEMM_EFFICIENCY = 0.45


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|TiB|TB)\s*", text)
    if not m:
        raise PlanError(f"{flag} {text!r}: expected a size such as 80GiB, 141GB or 81920MiB")
    unit = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6, "TiB": 2**40, "TB": 10**12}[m.group(2)]
    return int(float(m.group(1)) * unit)


def load_model(name_or_path: str, given_as: str | None = None) -> dict[str, Any]:
    """The HF config of a published model, the tiny test model, or a config.json / model folder;
    `given_as` says where the name came from in errors (default: `--model 'NAME'`)."""
    from model_specs.families import FAMILIES, family_for
    from model_specs.hf.config import load_hf_config
    from model_specs.hf.published import BY_NAME
    if name_or_path in BY_NAME:
        return dict(BY_NAME[name_or_path])
    if name_or_path == "tiny-qwen3-moe":  # the tests' and the main job's model (make_tiny_model.py)
        from model_specs.hf.tiny import qwen3_moe
        return qwen3_moe()
    given_as = given_as or f"--model {name_or_path!r}"
    if not Path(name_or_path).exists():
        family = next((f for pattern, f in UNSUPPORTED if pattern.search(name_or_path)), None)
        if family is not None:
            raise PlanError(f"{given_as}: the {family} family is not supported yet "
                            f"(supported: {', '.join(sorted(FAMILIES))}; published: "
                            f"{', '.join(BY_NAME)})")
        published = Path(name_or_path).name
        hint = (f"; give --model {published} for its published config" if published in BY_NAME
                else "" if given_as.startswith("--model") else "; give --model NAME or a model folder")
        raise PlanError(f"{given_as}: not a published model ({', '.join(BY_NAME)}, "
                        f"tiny-qwen3-moe) and no such config.json or model folder{hint}")
    hf = load_hf_config(name_or_path)
    family_for(hf)  # an unsupported family: one line naming it and the supported ones
    return hf


# Models asked for by name whose family model_specs does not map: named as unsupported, not as a
# missing file (a config.json of any family is refused by its model_type, model_specs/families/).
UNSUPPORTED = tuple((re.compile(p, re.IGNORECASE), f) for p, f in (
    (r"mixtral", "mixtral"), (r"llama-?4", "llama4"), (r"dbrx", "dbrx"), (r"grok", "grok"),
    (r"minimax", "minimax"), (r"ernie", "ernie4_5_moe"), (r"phi-?3\.5-?moe|phimoe", "phimoe"),
))


def pipeline_splits(num_layers: int, pp: int, vpp: int) -> list[dict]:
    """The layer splits to try for PP x VPP: even when it divides, else megatron's uneven split
    with the first and last stages lighter (they hold the embedding and the output layer), else
    the last stage alone."""
    if pp == 1:
        return [{}] if vpp == 1 else []
    if num_layers % (pp * vpp) == 0:
        return [{}]
    out = []
    for ends in (("first_stage_layers", "last_stage_layers"), ("last_stage_layers",), ("first_stage_layers",)):
        middle_stages = pp - len(ends)
        if middle_stages < 1:
            continue
        for x in range(num_layers // pp, 0, -1):  # as close to an even share as allowed
            rest = num_layers - len(ends) * x
            if x % vpp == 0 and rest > 0 and rest % (middle_stages * vpp) == 0 and x <= rest // middle_stages:
                out.append({e: x for e in ends})
                break
        if out:
            break
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Row:
    layout: ParallelLayout
    name: str
    memory: RankMemory
    max_tokens: int = 0
    step_s: float = 0.0
    tokens_s: float = 0.0
    verdict: str = ""
    fits: bool = False
    sync: SyncEstimate | None = None


def candidate_layouts(dims: dict, world: int, gpus_per_node: int, fixed: dict,
                      ) -> tuple[list[ParallelLayout], dict[str, list]]:
    """Valid layouts of `world` ranks, and the refused ones by reason: {reason with the numbers
    as N: [count, the first message]}."""
    experts = dims.get("num_experts") or 1
    refused: dict[str, list] = {}
    out = []
    for tp in (d for d in divisors(gpus_per_node) if d <= 8):
        for pp in divisors(world):
            if pp > dims["num_layers"]:
                continue
            for vpp in (1, 2):
                for ep in (d for d in divisors(experts) if world % (d * pp) == 0):
                    if experts == 1 and ep > 1:
                        continue
                    for split in pipeline_splits(dims["num_layers"], pp, vpp):
                        kwargs = dict(tensor=tp, pipeline=pp, virtual_pipeline=vpp if vpp > 1 else None,
                                      expert=ep, expert_tensor=1 if experts > 1 else None, **split)
                        kwargs.update(fixed)
                        layout = ParallelLayout(**kwargs)
                        try:
                            layout.validate(world, **dims)
                        except LayoutError as e:
                            key = re.sub(r"\d+", "N", str(e))[:90]
                            refused.setdefault(key, [0, str(e)])[0] += 1
                            continue
                        if layout not in out:
                            out.append(layout)
    return out, refused


def step_time(spec, layout: ParallelLayout, world: int, s: MemorySettings, gpu: Gpu, gpus_per_node: int,
              step_tokens: int, mean_len: float, mem: RankMemory) -> float:
    """Seconds of one optimizer step's train + log-prob passes (module docstring)."""
    from model_specs.param_count import param_count
    c = spec.config
    active = param_count(spec).active
    flops = 8 * active * step_tokens + 8 * c.num_layers * c.num_attention_heads * head_width(c) * mean_len * step_tokens
    compute = flops / world / (gpu.peak_tflops * 1e12 * GEMM_EFFICIENCY)
    dp = layout.data_parallel(world)
    mbs = max(1, -(-step_tokens // (dp * s.max_tokens)))
    bubble = compute * (layout.pipeline - 1) / (layout.vpp * mbs)
    b = s.param_bytes
    tokens_mb = s.max_tokens / layout.context
    layers = c.num_layers / layout.pipeline
    link = gpu.nvlink_gbs * 1e9
    tp = 0.0
    if layout.tensor > 1:
        tp = 1.5 * layers * mbs * 8 * tokens_mb * c.hidden_size * b * (layout.tensor - 1) / layout.tensor / link
    ep = 0.0
    if layout.expert > 1 and c.num_moe_experts:
        bw = link if layout.expert <= gpus_per_node else gpu.network_gbs * 1e9
        vol = tokens_mb / layout.tensor * c.moe_router_topk * c.hidden_size * b * (layout.expert - 1) / layout.expert
        ep = 1.5 * layers * mbs * 4 * vol / bw
    dp_s = 0.0
    if dp > 1:
        bw = link if world <= gpus_per_node else gpu.network_gbs * 1e9
        dp_s = 2 * (dp - 1) / dp * mem.gradients / bw
    return compute + bubble + tp + ep + dp_s + offload_time(mem, gpus_per_node)


def offload_time(mem: RankMemory, gpus_per_node: int) -> float:
    """Seconds the optimizer offload adds to a step (module docstring), 0 without."""
    return max(mem.offloaded_params * 8 / (PCIE_GBS * 1e9),
               mem.offloaded_params * gpus_per_node * 28 / (HOST_GBS * 1e9))


def plan(hf: dict, world: int, gpu: Gpu, capacity: int, gpus_per_node: int, s: MemorySettings,
         step_tokens: int, mean_len: float, fixed: dict | None = None, sync: SyncSettings | None = None,
         host_memory: int = HOST_MEMORY) -> tuple[list[Row], dict[str, list]]:
    """Every valid layout with its memory, largest budget, estimated step time, weight-sync time
    and verdict; fitting ones first, by estimated tokens/s."""
    from model_specs.shape import model_dims_for, model_shape_for
    dims = model_dims_for(hf)
    # The shape (torch-free) is all the estimates read; the layout's own fields are the layout's.
    spec = model_shape_for(hf)
    layouts, refused = candidate_layouts(dims, world, gpus_per_node, fixed or {})
    rows = []
    for layout in layouts:
        name = layout.describe(world)
        dp = layout.data_parallel(world)
        settings = dataclasses.replace(s, num_microbatches=max(1, -(-step_tokens // (dp * s.max_tokens))))
        mem = rank_memory(spec, layout, world, settings)
        row = Row(layout, name, mem, max_tokens=mem.max_tokens_that_fit(capacity),
                  sync=sync_time(spec, layout, world, sync or SyncSettings()))
        static = mem.static() + mem.overhead
        host = mem.host * min(gpus_per_node, world)
        if host > host_memory:
            row.verdict = (f"the offloaded optimizer needs {host / GiB:.0f} GiB of host memory per node "
                           f"> {host_memory / GiB:.0f} GiB")
        elif static > capacity:
            row.verdict = (f"cannot hold the weights, gradients and optimizer state: "
                           f"{mem.static() / GiB:.1f} GiB + {mem.overhead / GiB:.1f} GiB overhead > {capacity / GiB:.1f} GiB")
        elif mem.total() > capacity:
            row.verdict = (f"needs {mem.total() / GiB:.1f} GiB at {s.max_tokens} tokens; fits at <= {row.max_tokens}"
                           if row.max_tokens else f"needs {mem.total() / GiB:.1f} GiB; no token budget fits")
        else:
            row.fits, row.verdict = True, "fits"
        budget = s.max_tokens if row.fits else row.max_tokens
        if budget:
            fitted = dataclasses.replace(settings, max_tokens=budget)
            row.step_s = step_time(spec, layout, world, fitted, gpu, gpus_per_node, step_tokens, mean_len,
                                   rank_memory(spec, layout, world, fitted))
            row.tokens_s = step_tokens / row.step_s
        rows.append(row)
    rows.sort(key=lambda r: (not r.fits, r.max_tokens == 0, -r.tokens_s))
    return rows, refused


def table(rows: list[Row], capacity: int, s: MemorySettings, show_all: bool, top: int,
          gpus_per_node: int = 8) -> str:
    shown = [r for r in rows if r.fits][:top] + ([r for r in rows if not r.fits] if show_all else [])
    offload = s.optimizer_offload_fraction > 0
    head = ("| layout | stage | weights | grads | optimizer | activations | log-probs | overhead | total GiB "
            "| left GiB (SGLang KV, colocated) | max tokens | est. step s | est. tokens/s "
            "| senders | sync s | delta s | rank0 s |" + (" host GiB per node |" if offload else "") + " verdict |")
    lines = [head, "|" + "---|" * (19 if offload else 18)]
    for r in shown:
        m = r.memory
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        left = g(max(capacity - m.total(), 0))
        est = (f"{r.step_s:.2f} | {r.tokens_s:,.0f}") if r.tokens_s else "- | -"
        y = r.sync
        sync = f"{y.senders} | {y.sync_s:.2f} | {y.delta_s:.3f} | {y.rank0_s:.1f}" if y else "- | - | - | -"
        lines.append(f"| {r.name} | {m.stage} | {g(m.weights)} | {g(m.gradients)} | {g(m.optimizer)} | "
                     f"{g(m.activations)} | {g(m.log_probs)} | {g(m.overhead)} | {g(m.total())} | {left} | "
                     f"{r.max_tokens} | {est} | {sync} |"
                     + (f" {m.host * gpus_per_node / GiB:.0f} |" if offload else "") + f" {r.verdict} |")
    return "\n".join(lines)


__all__ = ["GPUS", "Gpu", "PlanError", "SyncSettings", "parse_memory", "load_model", "plan", "table",
           "with_tokens"]

"""MoE routing in the actor: force each router to given experts (routing replay, "R3"), and count
how often top-k expert sets differ (routing drift, and SGLang vs megatron).

megatron-core's TopKRouter hands its top-k selection to `router.router_replay.get_replay_topk(
scores, topk, num_groups, group_topk, default_compute_topk)` whenever `router_replay` is set
(megatron-core 0.16 and 0.19 moe_utils.topk_routing_with_score_function.compute_topk). We set
it to a `RouterControl` of our own on every router instead of megatron's RouterReplay, which keeps
a process-global list of instances (RouterReplay.global_router_replay_instances) and one replay
tensor per layer for the whole pass: ours takes the engine's experts per micro-batch, token by
token, from the batch.

What a control does on each call (one call per MoE layer per micro-batch forward):
1. computes the router's own top-k (`natural`): megatron's function, unchanged;
2. replay: where the batch has the engine's experts for a token, uses those indices instead, with
   gating weights gathered from the CURRENT router's scores (`scores.gather(1, idx)`, as
   megatron's REPLAY_FORWARD and slime/verl do): the gradient still reaches the router, only the
   choice of experts is the engine's. Tokens without engine routing (the final token, environment
   tokens after the last turn, padding) keep the natural choice;
3. observers see the natural top-k with the token coordinates: the old pass records it (drift
   baseline) and compares it with the engine's; the drift pass compares it with the record.
   Compared are the positions that predict a trained token (position p's output is the log-prob
   of token p + 1): the last prompt token and every response position but the final one, which
   is also exactly where SGLang reports routing (it never feeds its last sampled token).

Token order. The router sees `[s, b, h]` hidden states flattened s-major (router.py: logits.view(
-1, E)), under sequence parallelism only this TP rank's contiguous slice of s (scattered evenly by
the embedding), and a packed micro-batch as one row of T tokens. `_token_coords` maps each of the
router's tokens to (row of the micro-batch, position), so every comparison and every replayed index
is per (row, position) whatever the layout. Counts are summed over the world: TP ranks hold
distinct sequence slices (an MoE model with TP > 1 runs sequence parallel, layout.py), pipeline
stages distinct layers, DP/EP ranks distinct rows.

Not supported (refused with an error): the fused router kernel (moe_router_fusion, bypasses
router_replay), and recomputing the router in backward (recompute=full, or selective with the
"moe"/"mlp" modules): the replayed indices are per forward call.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

from gspo_megatron.actor.batching.batch import TrainBatch, largest_expert_id
from gspo_megatron.actor.batching.micro_batch import MicroBatch
from gspo_megatron.algorithms.routing_drift import drift_counts
from gspo_megatron.parallel.comm import comm_device
from gspo_megatron.parallel.model_chunks import unwrap


class RouterControl:
    """Stands in for megatron's RouterReplay on one router (see the module docstring)."""

    def __init__(self, router: TopKRouter, owner: "Routing") -> None:
        self.router = router
        self.owner = owner
        self.layer_number: int | None = None  # megatron 0.19 sets it on router_replay as well
        self.target: torch.Tensor | None = None  # [n, k] long, -1 = keep the router's choice

    @property
    def layer(self) -> int:
        """0-based global layer index (the engine's layer axis)."""
        return int(self.router.layer_number) - 1

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.owner.observe(self, idx)
        if self.target is None:
            return probs, idx
        target = self.target.to(scores.device)
        if target.shape != idx.shape:
            raise RuntimeError(f"layer {self.layer}: replay indices of shape {tuple(target.shape)} for "
                               f"a router call on {tuple(idx.shape)} tokens x top-k")
        idx = torch.where(target >= 0, target, idx)
        self.owner.observe(self, idx, used=True)
        return scores.gather(1, idx), idx


def _token_coords(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(row in the micro-batch, position) of each token this rank's routers see, in their order;
    -1 for padding of a packed sequence."""
    device = mb.tokens.device
    if mb.packed is None:
        m, s = mb.tokens.shape
        rows = torch.arange(m, device=device)[None, :].expand(s, m)
        pos = torch.arange(s, device=device)[:, None].expand(s, m)
    else:
        lengths = mb.packed.lengths.to(device)
        total = mb.packed.tokens.shape[1]
        rows = torch.full((total,), -1, dtype=torch.long, device=device)
        pos = torch.full((total,), -1, dtype=torch.long, device=device)
        real = mb.packed.real  # a host int: int(lengths.sum()) would wait for the device
        rows[:real] = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        pos[:real] = torch.arange(real, device=device) - torch.repeat_interleave(starts, lengths)
        rows, pos = rows[:, None], pos[:, None]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:  # sequence parallel: this rank's contiguous slice of the sequence axis
        n = rows.shape[0] // tp
        start = ps.get_tensor_model_parallel_rank() * n
        rows, pos = rows[start:start + n], pos[start:start + n]
    return rows.reshape(-1), pos.reshape(-1)


def check_routed_experts(batch: TrainBatch, config) -> None:
    """ValueError unless the batch's routes fit the model: (layers, top-k) per token, the layers it
    names inside the model, expert ids below its expert count."""
    layers = config.num_layers if batch.route_layers is None else len(batch.route_layers)
    want = (layers, config.moe_router_topk)
    if batch.route_shape != want:
        raise ValueError(f"routed_experts have {batch.route_shape} (layers, top-k) per token, "
                         f"expected {want}")
    if batch.route_layers is not None and any(not 0 <= x < config.num_layers for x in batch.route_layers):
        raise ValueError(f"route_layers {batch.route_layers}: the model has {config.num_layers} layers")
    routes = batch.routed_experts
    if routes is None:
        raise ValueError("the batch carries no routed_experts to replay or compare")
    hi = largest_expert_id(routes)
    if routes.numel() and hi >= (config.num_moe_experts or 0):
        raise ValueError(f"routed_experts name expert {hi}, the model has {config.num_moe_experts}")


class Routing:
    """The controls of one Actor's routers, and what one pass over a batch does with them."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, topk: int) -> None:
        self.num_layers, self.topk = num_layers, topk
        self.controls: dict[int, list[RouterControl]] = {}
        for chunk in chunks:
            found = []
            for module in unwrap(chunk).modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = RouterControl(module, self)
                    found.append(module.router_replay)
            self.controls[id(chunk)] = found
        self._pass: dict[str, Any] | None = None
        self.table: dict[int, torch.Tensor] = {}  # layer -> [T + 1, k] int16: the old pass's choice per
        # real token of the rank's batch, row after row (packed; entry T: a sink)
        self.recorded_shape: tuple[int, int, int] | None = None  # the same on every rank (no table
        # on a stage without MoE layers), so every rank takes the same collectives

    @property
    def layers(self) -> list[int]:
        """The global MoE layers this rank's chunks route (its pipeline stage's)."""
        return sorted(c.layer for found in self.controls.values() for c in found)

    def check_supported(self, config, *, replay: bool) -> None:
        """ValueError if the model cannot run the routing tools. Recomputation matters to replay
        only: drift and the engine comparison record in forward-only passes, which recompute
        nothing."""
        if config.moe_router_fusion:
            raise ValueError("routing replay / routing drift need moe_router_fusion=False: the fused "
                             "router kernel does not call router_replay (megatron moe_utils.py)")
        modules = set(config.recompute_modules or []) if config.recompute_granularity == "selective" else set()
        if replay and (config.recompute_granularity == "full" or modules & {"moe", "mlp"}):
            raise ValueError("routing replay cannot run with the router recomputed in backward "
                             "(compute.recompute=full, or selective with 'moe'/'mlp'): use "
                             "recompute=none or selective without those modules")

    # --- one pass ---------------------------------------------------------------------------------
    def begin(self, *, replay: bool, record: bool, compare_old: bool, compare_engine: bool,
              batch_shape: tuple[int, int], route_layers: list[int] | None = None,
              offsets: torch.Tensor | None = None) -> None:
        """Start a pass over a rank's batch of `batch_shape` (rows, longest row). route_layers:
        the global layers of the batch's routed_experts axis (a pipeline stage receives its own
        only); None: all of them. offsets: [rows + 1], where each row's real tokens start in the
        batch's packed order (TrainBatch.offsets), for the recorded choices of routing drift."""
        axis = {layer: layer for layer in range(self.num_layers)} if route_layers is None else \
            {layer: i for i, layer in enumerate(route_layers)}
        own = self.layers
        if (replay or compare_engine) and any(layer not in axis for layer in own):
            raise ValueError(f"routed_experts hold layers {sorted(axis)}, this rank's routers are "
                             f"layers {own}")
        if offsets is None:
            offsets = torch.arange(batch_shape[0] + 1) * batch_shape[1]
        total = int(offsets[-1])
        if record:
            self.table, self.recorded_shape = {}, (*batch_shape, total)
        elif compare_old and self.recorded_shape != (*batch_shape, total):
            raise RuntimeError(f"routing drift: no recorded pass over this batch (recorded "
                               f"{self.recorded_shape}, batch {batch_shape}); run the old-log-prob "
                               "pass with routing drift on first")
        self._pass = dict(replay=replay, record=record, compare_old=compare_old,
                          compare_engine=compare_engine, shape=batch_shape, mb=None, counts={},
                          axis=axis, offsets=offsets, total=total)

    def before_forward(self, model: torch.nn.Module, mb: MicroBatch) -> None:
        """Called in forward_step with the micro-batch (on its device) the chunk is about to run."""
        p = self._pass
        controls = self.controls.get(id(model), [])
        if p is None or not controls:
            return
        rows, pos = _token_coords(mb)
        real = rows >= 0
        r, q = rows.clamp(min=0), pos.clamp(min=0)
        # Compared positions: those whose output is a trained token's log-prob (position p
        # predicts token p + 1), i.e. the last prompt token and the response but its final token.
        predicts = torch.zeros_like(mb.loss_mask)
        predicts[:, :-1] = mb.loss_mask[:, 1:]
        p["mb"] = dict(rows=r, pos=q, real=real, mask=predicts[r, q] & real,
                       batch_rows=mb.rows[r], routed=mb.routed_experts)
        if p["record"] or p["compare_old"]:  # each token's place in the recorded table
            p["offsets"] = p["offsets"].to(r.device)  # (once: a no-op after the first micro-batch)
            batch_rows = p["mb"]["batch_rows"]
            inside = real & (batch_rows >= 0) & (q < mb.row_lengths()[r])  # a real token of a real row
            p["mb"].update(inside=inside, place=torch.where(
                inside, p["offsets"][batch_rows.clamp(min=0)] + q, p["total"]))
        for control in controls:
            control.target = None
            if p["replay"] and mb.routed_experts is not None:
                target = mb.routed_experts[r, q, p["axis"][control.layer]].long()
                control.target = torch.where(real[:, None], target, -1)

    def observe(self, control: RouterControl, natural: torch.Tensor, used: bool = False) -> None:
        """The router's own top-k of this call (used=False), or the indices it used after replay."""
        p = self._pass
        if p is None or p["mb"] is None:
            return
        t, layer = p["mb"], control.layer
        natural = natural.detach()
        if used:  # a self-check: every replayed set is the engine's (routing_replay_mismatch = 0)
            if p["compare_engine"]:
                engine = t["routed"][t["rows"], t["pos"], p["axis"][layer]].long().to(natural.device)
                self._count(p, "replay", layer, engine, natural, t["mask"])
            return
        if p["record"]:
            if layer not in self.table:  # entry T: a sink for tokens not kept (see below)
                self.table[layer] = torch.full((p["total"] + 1, natural.shape[1]), -1, dtype=torch.int16,
                                               device=natural.device)
            # Writes of tokens not kept go to the sink: boolean indexing (table[place[inside]])
            # would wait for the device to learn how many tokens are kept, per layer.
            self.table[layer][t["place"]] = natural.to(torch.int16)
        if p["compare_old"] and layer in self.table:
            old = self.table[layer].to(natural.device)
            self._count(p, "drift", layer, old[t["place"]].long(), natural, t["mask"] & t["inside"])
        if p["compare_engine"] and t["routed"] is not None:
            engine = t["routed"][t["rows"], t["pos"], p["axis"][layer]].long().to(natural.device)
            self._count(p, "engine", layer, engine, natural, t["mask"])

    def _count(self, p: dict[str, Any], kind: str, layer: int, a: torch.Tensor, b: torch.Tensor,
               mask: torch.Tensor) -> None:
        counts = p["counts"]
        if kind not in counts:
            counts[kind] = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=b.device)
        changed, compared = drift_counts(a, b, mask)
        counts[kind][layer, 0] += changed
        counts[kind][layer, 1] += compared

    def end(self) -> dict[str, float]:
        """Finish the pass (collective over the world when it counted anything): metrics
        `routing_drift` / `routing_engine_mismatch` (changed / compared (token, layer) top-k sets
        over all layers) and per layer `..._layer/<i>` (layers with compared tokens only)."""
        p, self._pass = self._pass, None
        if p is None:
            return {}
        for controls in self.controls.values():
            for control in controls:
                control.target = None
        out: dict[str, float] = {}
        wanted = {"drift": p["compare_old"], "engine": p["compare_engine"],
                  "replay": p["compare_engine"] and p["replay"]}
        for kind, name in (("drift", "routing_drift"), ("engine", "routing_engine_mismatch"),
                           ("replay", "routing_replay_mismatch")):
            if not wanted[kind]:
                continue
            counts = p["counts"].get(kind, torch.zeros(self.num_layers, 2, dtype=torch.float64))
            counts = counts.to(comm_device())
            dist.all_reduce(counts)
            counts = counts.cpu()
            total = counts.sum(0)
            out[name] = float(total[0] / total[1]) if total[1] > 0 else 0.0
            out[f"{name}_sets"] = float(total[1])
            for layer in range(self.num_layers if kind != "replay" else 0):
                if counts[layer, 1] > 0:
                    out[f"{name}_layer/{layer}"] = float(counts[layer, 0] / counts[layer, 1])
        return out

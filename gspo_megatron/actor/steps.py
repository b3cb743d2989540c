"""Log-probs (forward only) and the train step (forward-backward + optimizer step).

Both run megatron-core's pipeline schedule over this rank's micro-batches; per-token log-probs
exist only on the last pipeline stage, where they are returned (old / reference log-probs) or
reduced to the loss. Only scalar totals leave the last stage (metrics below).

How the loss is scaled (megatron-core 0.16.1; docs/algorithm.md "Aggregation")
------------------------------------------------------------------------------
The objective is a mean over the N valid sequences of the whole (mini-)batch, over all DP ranks:
`L = (1/N) sum_i l_i` (l_i = the row's -J_i term under loss.loss_agg_mode; for "ce" and for
token-mean a token, and N = trained tokens).
Before the schedule, N is all-reduced over the DP group (`_global_count`). Each micro-batch's
loss_func on the last stage returns, in the schedule's 2-tuple contract,

    loss_mb = (sum of l_i over the micro-batch's rows) * num_microbatches * dp_size / N

with dp_size the data-parallel size WITHOUT context parallelism. Under context parallelism (CP)
every CP rank of a DP rank holds the same rows (each its zig-zag chunks of them, forward.py) and
returns this same full-row value: the loss sums each row over the CP group before the exp
(algorithms/rows.py; "ce" is a plain token sum, each rank its own tokens).

1. pipeline_parallel/schedules.py forward_step_calc_loss (its 2-tuple branch): the schedule
   multiplies by cp_size (cp_group_size) and divides by num_microbatches before backward.
2. CP: the loss's all-reduce passes the gradient through unchanged (rows.cp_sum), so CP rank r's
   backward gives d/dtheta of sum_{t on r} g_t logp_t, g_t = d loss_mb / d logp_t of the
   full rows (TE's attention returns the key/value gradients to the ranks owning those positions).
   Summed over the CP ranks that is the full rows' gradient once, and with step 1 and the sum
   over the rank's micro-batches (DDP grad buffers accumulate): cp_size * (sum over the DP rank's
   rows) * dp_size / N. Without CP, cp_size = 1 and the same holds.
3. DistributedDataParallel.__init__ (average_in_collective=False, set in
   build.py): the grad buffers are scaled by 1 / dp_cp_group.size() = 1 / (dp_size * cp_size),
   then all-reduced (or reduce-scattered) with SUM over the DP x CP group (intra_dp_cp_group;
   expert parameters: the same factor, summed over the expert-DP group, which spans the
   CP ranks too and holds the same tokens' contributions) -> (sum over ALL rows) / N = dL/dtheta.
(The same in megatron-core 0.16 and 0.19.)
The factors num_microbatches, dp_size and cp_size cancel exactly whatever the split: uneven row
counts per rank and micro-batches of unequal size included (filler rows count 0 everywhere). With
calculate_per_token_loss=True the schedule and DDP would skip the divisions; build.py and forward.py
refuse it. tests/actor/test_actor_layouts.py checks the resulting parameters against one process with
an optimizer that is linear in the gradient (Adam's usual first step, ~lr*sign(g), would hide a
wrong scale), and that a deliberately wrong scale fails that check; tests/parallel/test_context.py
checks step 2's loss and per-token gradients on split rows against one process (gloo); the model
side of CP (TE attention) is tools/gpu_check.py's CP row.

Metrics: under CP, token totals are each rank's own positions and add up over the CP group; row
totals (num_sequences, loss_sum, seq_ratio_sum, ...) are reported by CP rank 0 only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel

from gspo_megatron.actor.batching import token_budget
from gspo_megatron.actor.batching.batch import TrainBatch, positions_in_rows
from gspo_megatron.actor.batching.micro_batch import MicroBatch, from_input_positions
from gspo_megatron.actor.finite_step import refuse_non_finite
from gspo_megatron.actor.forward import BeforeForward, is_last_stage_rank, run_schedule, seq_multiple
from gspo_megatron.actor.settings import LogProbSettings, MicroBatchSettings
from gspo_megatron.algorithms.loss_metrics import finalize_metrics
from gspo_megatron.algorithms.mismatch import mismatch_correction
from gspo_megatron.algorithms.registry import LossSettings
from gspo_megatron.algorithms.rows import counts_rows, cp_sum
from gspo_megatron.parallel import context
from gspo_megatron.parallel.comm import comm_device


# Totals the last stage reports per micro-batch, beyond the loss functions' own (METRIC_REDUCTIONS).
_EXTRA_SUMS = ("loss_sum", "entropy_sum", "log_prob_sum", "rollout_abs_diff_sum", "rollout_k3_sum",
               "rollout_tokens")
# Totals of the mismatch corrections (algorithms/mismatch.py), reported when any is on.
_MISMATCH_SUMS = ("mismatch_abs_sum", "mismatch_k3_sum", "mismatch_tokens", "mismatch_sequences")


def _correction_sums(loss: LossSettings) -> list[str]:
    """The corrections' own counts: the ones of the corrections that are on."""
    out = ["tis_truncated_tokens"] if loss.tis_cap is not None else []
    out += ["seq_is_truncated_sequences"] if loss.seq_is_cap is not None else []
    if loss.mis_cap is not None:
        out.append("mis_masked_sequences" if loss.mis_level == "sequence" else "mis_masked_tokens")
    return out


def _global_count(local: int) -> int:
    """Sum of a per-DP-rank count over the DP group (all TP/PP ranks of a replica hold the same)."""
    group = ps.get_data_parallel_group()
    t = torch.tensor([local], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return int(t.item())


def _cp_group():
    """The context-parallel group, or None without context parallelism."""
    return ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None


def _token_totals(mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor) -> dict:
    mask = mb.loss_mask
    lp = log_probs.detach()
    out = {"entropy_sum": torch.where(mask, entropy, 0).sum(),
           "log_prob_sum": torch.where(mask, lp, 0).sum(),
           "num_tokens": mask.sum().to(lp.dtype)}
    if mb.rollout_log_probs is not None:
        d = (lp.float() - mb.rollout_log_probs.float()).clamp(-20.0, 20.0)  # log pi_train - log pi_eng
        out["rollout_abs_diff_sum"] = torch.where(mask, d.abs(), 0).sum()
        # k3 estimate of KL(pi_eng || pi_train) from the engine's samples (mismatch.py)
        out["rollout_k3_sum"] = torch.where(mask, torch.exp(d) - 1 - d, 0).sum()
        out["rollout_tokens"] = out["num_tokens"]
    return out


def reduce_to_all_ranks(reports: list[dict], keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """Combine per-micro-batch totals over micro-batches and over the world.

    Only the last pipeline stage's TP-rank-0 ranks contribute (their TP peers hold copies, other
    stages hold nothing; CP ranks hold distinct positions, see the module docstring); `keys` maps
    every metric name to "sum", "min" or "max" and must be the same on every rank. Every rank
    returns the result (rank 0 is the driver).
    """
    contributes = is_last_stage_rank() and ps.get_tensor_model_parallel_rank() == 0
    device = comm_device()
    sums, extremes = [], []  # max-reduced; a min is reduced as the max of its negation
    none = torch.full((), float("-inf"), dtype=torch.float64, device=device)
    for key, op in keys.items():
        values = [r[key].double().to(device) for r in reports if key in r] if contributes else []
        if op == "sum":
            sums.append(torch.stack(values).sum() if values else
                        torch.zeros((), dtype=torch.float64, device=device))
        else:  # on the device: a per-micro-batch .item() would wait for it N times
            sign = -1.0 if op == "min" else 1.0
            extremes.append((sign * torch.stack(values)).max() if values else none)
    sum_t = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    ext_t = torch.stack(extremes) if extremes else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(sum_t)
    dist.all_reduce(ext_t, op=dist.ReduceOp.MAX)
    # The step's one wait for the device: both totals in one copy to the host.
    host = torch.cat([sum_t, ext_t]).cpu()
    out: dict[str, torch.Tensor] = {}
    i_sum, i_ext = 0, len(sums)
    for key, op in keys.items():
        if op == "sum":
            out[key] = host[i_sum]
            i_sum += 1
        else:
            out[key] = -host[i_ext] if op == "min" else host[i_ext]
            i_ext += 1
    return out


def _metric_keys(loss: LossSettings, with_rollout: bool) -> dict[str, str]:
    """{key: reduction} of everything the last stage reports per micro-batch for `loss`."""
    keys = loss.spec.reported_keys(with_kl=loss.kl_coef > 0)
    keys.update({k: "sum" for k in _EXTRA_SUMS if with_rollout or not k.startswith("rollout")})
    if loss.corrects_mismatch:
        keys.update({k: "sum" for k in (*_MISMATCH_SUMS, *_correction_sums(loss))})
    return keys


def _mismatch_metrics(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fractions and means of the mismatch corrections' totals (mismatch.py)."""
    tokens = max(float(totals["mismatch_tokens"]), 1.0)
    seqs = max(float(totals["mismatch_sequences"]), 1.0)
    out = {"mismatch_abs_mean": totals["mismatch_abs_sum"] / tokens,
           "mismatch_k3": totals["mismatch_k3_sum"] / tokens}
    for key, denom in (("tis_truncated_tokens", tokens), ("seq_is_truncated_sequences", seqs),
                       ("mis_masked_tokens", tokens), ("mis_masked_sequences", seqs)):
        if key in totals:
            out[key.replace("_tokens", "_fraction").replace("_sequences", "_fraction")] = totals[key] / denom
    return out


def _finish(totals: dict[str, torch.Tensor], name: str | None, per_token: bool = False) -> dict[str, float]:
    """per_token: the loss is a mean over trained tokens (ce, token-mean), else over sequences."""
    n_tok = max(totals["num_tokens"].item(), 1.0)
    out = dict(totals)
    if name is not None and name != "ce":
        out = finalize_metrics(totals)
    if name is not None:
        denom = n_tok if name == "ce" or per_token else max(totals["num_sequences"].item(), 1.0)
        out["loss"] = totals["loss_sum"] / denom
    out["entropy_mean"] = totals["entropy_sum"] / n_tok
    out["log_prob_mean"] = totals["log_prob_sum"] / n_tok
    if "rollout_abs_diff_sum" in totals:
        n_roll = max(totals["rollout_tokens"].item(), 1.0)
        out["logprob_abs_diff_vs_rollout"] = totals["rollout_abs_diff_sum"] / n_roll
        out["logprob_k3_vs_rollout"] = totals["rollout_k3_sum"] / n_roll
    if "mismatch_tokens" in totals:
        out.update(_mismatch_metrics(totals))
    out["tokens"] = totals["num_tokens"]
    return {k: float(v) for k, v in out.items()}


def plan(batch: TrainBatch, batching: MicroBatchSettings, *, forward_only: bool) -> list[MicroBatch]:
    """This rank's micro-batches (collective over DP: every rank gets the same count). Packed
    when batching.pack_sequences is True (the Actor resolves null against its layer spec)."""
    return token_budget.build(batch, max_rows=batching.micro_batch_size,
                              max_tokens=batching.max_tokens(forward_only), seq_multiple=seq_multiple(),
                              longest_first=batching.longest_first, packed=bool(batching.pack_sequences))


def _padding_metrics(mbs: list[MicroBatch]) -> dict[str, float]:
    """Real and computed (padding included) tokens of the step over every DP rank, and the largest
    micro-batch's computed tokens: the same on every rank."""
    group = ps.get_data_parallel_group()
    real, computed = token_budget.padding_stats(mbs)
    totals = torch.tensor([real, computed], dtype=torch.float64, device=comm_device(group))
    largest = torch.tensor([max(token_budget.model_tokens(mb) for mb in mbs)], dtype=torch.float64,
                           device=comm_device(group))
    dist.all_reduce(totals, group=group)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    real, computed = totals.tolist()
    return {"real_tokens": real, "computed_tokens": computed,
            "padding_fraction": 1.0 - real / max(computed, 1.0),
            "max_micro_batch_tokens": float(largest.item())}


def _token_places(batch: TrainBatch, mbs: list[MicroBatch]):
    """Where each micro-batch's real tokens are: per micro-batch, each token's row in it and its
    position in the row (host tensors), and for all of them in micro-batch order, the token's place
    in the batch's log-probs (its form: [T] packed, [b * s] padded). Planned on the host, before the
    schedule, in a constant number of conversions (no per-micro-batch one: test_host_syncs)."""
    starts = batch.offsets[:-1] if batch.is_packed else torch.arange(batch.num_rows) * batch.padded_shape[1]
    rows = torch.cat([mb.rows for mb in mbs])
    lengths = torch.cat([mb.row_lengths() for mb in mbs])
    local = torch.cat([torch.arange(mb.rows.numel()) for mb in mbs])
    mb_of = torch.cat([torch.full((mb.rows.numel(),), i) for i, mb in enumerate(mbs)])
    real = rows >= 0  # filler rows: -1
    rows, lengths, local, mb_of = rows[real], lengths[real], local[real], mb_of[real]
    within = positions_in_rows(lengths)
    dest = torch.repeat_interleave(starts[rows], lengths) + within
    per_mb = torch.zeros(len(mbs), dtype=torch.long).index_add_(0, mb_of, lengths).tolist()
    return (torch.repeat_interleave(local, lengths).split(per_mb), within.split(per_mb), dest)


@torch.no_grad()
def compute_log_probs(chunks: list[torch.nn.Module], batch: TrainBatch, *,
                      batching: MicroBatchSettings, logprob: LogProbSettings,
                      before_forward: BeforeForward | None = None,
                      ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Forward-only pass over this DP rank's shard: `(log_probs, metrics)`, the log-probs in the
    batch's form ([b, s] padded, [T] packed: TrainBatch).

    The log-probs exist on the last pipeline stage only (None elsewhere); the caller keeps them as
    the batch's old_log_probs or ref_log_probs. The metrics (mean log-prob, entropy and, with
    rollout log-probs, the |train - rollout| mismatch) are the same on every rank.
    """
    mbs = plan(batch, batching, forward_only=True)
    local, within, dest = _token_places(batch, mbs)
    kept: dict[int, torch.Tensor] = {}  # each micro-batch's real tokens' log-probs, on the device

    def keep(mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor):
        report, zero = _token_totals(mb, log_probs, entropy), log_probs.sum() * 0.0
        if mb.targets is not None:  # context parallel: this rank's chunks, at input positions
            log_probs = from_input_positions(context.all_gather(log_probs, _cp_group()))
        source = local[mb.index] * log_probs.shape[1] + within[mb.index]
        kept[mb.index] = log_probs.reshape(-1)[source.to(log_probs.device)].float()
        return zero, report

    reports = run_schedule(chunks, mbs, logprob, keep, forward_only=True, before_forward=before_forward)
    out = torch.zeros(batch.tokens.numel() if batch.is_packed else batch.padded_shape[0] * batch.padded_shape[1],
                      dtype=torch.float32)
    if kept:  # one copy to the host after the schedule, not one per micro-batch
        out[dest] = torch.cat([kept[i] for i in range(len(mbs))]).cpu()  # in micro-batch order
    out = out if batch.is_packed else out.reshape(batch.padded_shape)
    keys = {k: "sum" for k in ("num_tokens", "entropy_sum", "log_prob_sum")}
    if batch.rollout_log_probs is not None:
        keys.update(rollout_abs_diff_sum="sum", rollout_k3_sum="sum", rollout_tokens="sum")
    metrics = _finish(reduce_to_all_ranks(reports, keys), None)
    metrics.update(_padding_metrics(mbs), num_microbatches=float(len(mbs)))
    return (out if is_last_stage_rank() else None), metrics


def train_step(chunks: list[DistributedDataParallel], optimizer, scheduler, batch: TrainBatch, *,
               batching: MicroBatchSettings, loss: LossSettings, logprob: LogProbSettings,
               with_entropy: bool = True, before_forward: BeforeForward | None = None) -> dict[str, float]:
    """One optimizer step on this DP rank's shard of a (mini-)batch; metrics on every rank.

    The last stage needs `batch.old_log_probs` (and `batch.ref_log_probs` with a KL penalty),
    except for the "ce" loss. `scheduler=None` leaves the learning rate where it is (warm start).
    with_entropy=False skips the entropy metric (a pass over the logits) when the forward-only
    pass already reported it.
    """
    spec = loss.spec
    if spec.function is not None and is_last_stage_rank():
        if batch.old_log_probs is None:
            raise ValueError("train_step needs batch.old_log_probs on the last pipeline stage: "
                             "compute them first (Actor.compute_old_log_probs)")
        if loss.kl_coef > 0 and batch.ref_log_probs is None:
            raise ValueError(f"kl_coef={loss.kl_coef} needs batch.ref_log_probs on the last pipeline "
                             "stage (Actor.compute_ref_log_probs)")
    correct = spec.function is not None and loss.corrects_mismatch
    if correct and batch.rollout_log_probs is None:
        raise ValueError(f"{loss.describe()}: the mismatch corrections need batch.rollout_log_probs")
    mbs = plan(batch, batching, forward_only=False)
    num_mb = len(mbs)
    per_token = loss.name == "ce" or loss.counts_tokens  # the mean runs over trained tokens
    local = int(batch.loss_mask.sum()) if per_token else batch.num_valid_sequences()
    if correct and is_last_stage_rank():  # MIS may leave rows (tokens) untrained: not counted
        # (per micro-batch: padded to its own rows only; filler rows train nothing)
        kept = [mismatch_correction(mb.needs("old_log_probs"), mb.needs("rollout_log_probs"), mb.loss_mask,
                                    **loss.mismatch_kwargs()).loss_mask for mb in mbs]
        local = sum(int(m.sum()) if per_token else int(m.any(dim=1).sum()) for m in kept)
    global_count = _global_count(local)
    # See the module docstring: cancels the schedule's 1/num_microbatches and DDP's 1/dp_size.
    scale = num_mb * ps.get_data_parallel_world_size() / max(global_count, 1)
    loss_fn, loss_kwargs = spec.loss_function(), loss.function_kwargs()
    cp_group = _cp_group()
    row_share = 1.0 if counts_rows(cp_group) else 0.0  # row totals: CP rank 0 reports them

    def loss_func(mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor):
        report = _token_totals(mb, log_probs, entropy)
        if loss_fn is None:  # ce: a token sum, each CP rank its own tokens
            total = -torch.where(mb.loss_mask, log_probs, 0).sum()
            trained = cp_sum(mb.loss_mask.sum(dim=1).to(total.dtype), cp_group)  # whole rows
            report["num_sequences"] = (trained > 0).sum().to(total.dtype) * row_share
        else:
            adv = mb.advantages
            if spec.advantages == "token" and adv.dim() == 1:
                adv = adv[:, None].expand_as(log_probs)  # one advantage per row, on every token
            mask, weights = mb.loss_mask, {}
            if correct:
                c = mismatch_correction(mb.needs("old_log_probs"), mb.needs("rollout_log_probs"), mb.loss_mask,
                                        **loss.mismatch_kwargs(), cp_group=cp_group)
                mask, weights = c.loss_mask, dict(token_weights=c.token_weights, row_weights=c.row_weights)
                report.update(c.totals)
            total, metrics = loss_fn(log_probs, mb.old_log_probs, adv, mask, reduction="sum",
                                     ref_log_probs=mb.ref_log_probs if loss.kl_coef > 0 else None,
                                     cp_group=cp_group, **loss_kwargs, **weights)
            report.update({k: metrics[k] for k in spec.reported_keys(loss.kl_coef > 0)})
        report["loss_sum"] = total.detach() * (1.0 if loss_fn is None else row_share)
        return total * scale, report

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = run_schedule(chunks, mbs, logprob, loss_func, forward_only=False,
                           with_entropy=with_entropy, before_forward=before_forward)
    refuse_non_finite(chunks, reports)  # a NaN is never applied, hence never synced (finite_step.py)
    update_ok, grad_norm, _ = optimizer.step()
    if grad_norm is None:  # megatron computes it only when clipping; report it anyway
        grad_norm = optimizer.get_grad_norm()
    lr = optimizer.param_groups[0]["lr"]
    if update_ok and scheduler is not None:
        scheduler.step(increment=1)
    metrics = _finish(reduce_to_all_ranks(reports, _metric_keys(loss, batch.rollout_log_probs is not None)),
                      loss.name, per_token)
    if not with_entropy:  # not computed (the fused path) or not asked for: not reported either
        metrics.pop("entropy_mean")
    metrics.update(grad_norm=float(grad_norm), lr=float(lr), update_successful=float(bool(update_ok)),
                   num_microbatches=float(num_mb), **_padding_metrics(mbs))
    return metrics

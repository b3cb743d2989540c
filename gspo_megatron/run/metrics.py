"""Per-step metrics: TensorBoard event files + a metrics.jsonl, both written by rank 0 only.

    writer = MetricsWriter(tensorboard_dir="runs/x", enabled=rank == 0)
    writer.log(step, {"rollout/reward_mean": 0.3, "time/rollout": 1.2})
    writer.close()
    # tensorboard --logdir runs/x

Tags are grouped `section/name` (rollout/, train/, time/, perf/) so TensorBoard shows one panel per
section. What the trainer logs each step (TAGS below documents every tag):
  rollout/  reward mean/std, accuracy, response length mean/max, partial-rollout and dropped-group counts
  train/    sequence clip fraction, sequence-ratio mean/min/max, KL (if on), grad norm, lr, entropy,
            train-vs-rollout log-prob |diff|, loss
  mismatch/ train/inference mismatch corrections (loss.tis_cap, seq_is_cap, mis_cap)
  routing/  MoE routing drift since pi_old, SGLang-vs-megatron routing, the replay self-check;
            per layer under routing_layers/ (scalars, and a TensorBoard histogram over layers)
  sync/     weight sync size and buckets
  time/     seconds per phase: rollout, log_probs, train, sync, checkpoint, step
  perf/     tokens/s (trained tokens / step time), rollout tokens/s, weight sync GB/s
The metrics.jsonl holds exactly the same numbers (one JSON object per step), for scripts and tests.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Mapping

import numpy as np

TAGS = {
    "rollout/reward_mean": "mean reward of the batch's responses",
    "rollout/reward_std": "std of the rewards (population)",
    "rollout/accuracy": "fraction of responses with reward >= 1 (verifiable tasks: correct)",
    "rollout/response_length_mean": "mean response length in tokens",
    "rollout/response_length_max": "longest response in tokens",
    "rollout/truncated_fraction": "fraction of responses cut by max_new_tokens",
    "rollout/groups_dropped": "groups dropped by dynamic sampling (all rewards equal)",
    "rollout/partial_resumed": "samples resumed from a partial rollout this step",
    "rollout/unrouted_dropped": "tokens dropped to be generated again: SGLang answered the abort "
                                "of a request it had retracted without their routes (moe.replay "
                                "or engine_routing; rollout/generation/requests.py)",
    "rollout/alignment_checked": "samples whose tokens, log-probs, weight versions and routes were "
                                 "checked for pairing this step (rollout/generation/alignment.py)",
    "rollout/misaligned": "of those, samples not paired (the log names the first position)",
    "rollout/partial_buffered": "groups left unfinished in the partial-rollout buffer",
    "rollout/reward_errors": "reward calls that failed: raised, returned a non-finite or non-number "
                             "value, ran past rollout.reward_timeout_s, or lost their worker (reward 0)",
    "reward/timeouts": "reward calls killed at rollout.reward_timeout_s (their worker replaced)",
    "reward/worker_restarts": "reward workers replaced this step (a timeout, or a worker that died: "
                              "os._exit, a segfault, the OOM killer)",
    "reward/sandbox_failures": "responses the code sandbox failed to start a run for, after its retries (not "
                               "the response's doing: no reward error; the run stops after 32 in a row)",
    "reward/groups_dropped_sandbox": "groups left out of the step because the code sandbox failed on one of "
                                     "their responses (never judged, so never a reward of 0)",
    "reward/p99_ms": "99th percentile of the scoring time per response",
    "time/reward_wait": "seconds the rollout loop waited on scoring with nothing left generating (what "
                     "scoring adds to the rollout phase)",
    "time/reward": "seconds the reward workers spent scoring this step's responses (summed over "
                   "workers; overlaps generation)",
    "distill/reverse_kl": "on-policy distillation: mean over trained tokens of log pi_student - "
                          "log pi_teacher on the student's samples (KL(student || teacher) per token)",
    "distill/teacher_time": "seconds of the teacher's prefill requests this step (summed over requests)",
    "distill/teacher_tokens_per_s": "tokens the teacher scored per second of request time",
    "rollout/turns_per_episode": "multi-turn: model turns per episode",
    "rollout/tool_calls_per_episode": "multi-turn: tool calls per episode",
    "rollout/env_token_fraction": "multi-turn: environment tokens / response tokens (not trained)",
    "rollout/reward_per_turn": "multi-turn: mean reward the environment gave per model turn",
    "rollout/episode_length_mean": "multi-turn: tokens per episode after the prompt (model + environment)",
    "rollout/env_error_fraction": "multi-turn: episodes ended by an environment that raised or "
                                  "returned a malformed step (reward 0; counted like reward errors)",
    "eval/accuracy": "held-out eval (eval: section): fraction of eval responses that are correct "
                     "(mean@n over eval.samples_per_prompt), logged with the step it precedes",
    "eval/pass@k": "fraction of eval prompts with a correct response among their n",
    "eval/reward_mean": "mean reward of the eval responses",
    "eval/response_length": "mean eval response length in tokens",
    "time/eval": "seconds of the held-out evaluation",
    "async/staleness_mean": "train.max_staleness > 0: mean over the trained samples of (weights "
                            "trained - the oldest version among the sample's trained tokens)",
    "async/staleness_max": "the largest such staleness (never above train.max_staleness)",
    "async/dropped_stale": "groups too stale to train, dropped this step (rollout.stale_policy=drop)",
    "async/regenerated_stale": "groups too stale to train, sent back to be generated again",
    "async/buffer_groups": "finished groups waiting for the trainer when the step took its batch",
    "async/rollout_busy": "fraction of the step's wall time the rollout thread was generating",
    "async/train_busy": "fraction of the step's wall time the trainer computed (log-probs, train, sync)",
    "async/overlap": "fraction of the step's wall time both were busy at once",
    "rollout/reward_clip_fraction": "rewards clipped by loss.reward_clip (after the reward norm)",
    "rollout/advantage_clip_fraction": "trained tokens whose advantage loss.advantage_clip clipped",
    "rollout/policy_lag_max": "most weight updates between the policy that sampled a trained token "
                              "and the current one (0 = on-policy; > 0 with partial rollouts)",
    "rollout/servers_live": "SGLang servers in service at the end of the rollout (rollout/servers/health.py: "
                            "out, rejoining and given-up ones do not count)",
    "rollout/server_failures": "servers taken out of service since the last step (a failed health "
                               "probe, a lost connection, a restart that failed)",
    "rollout/server_restarts": "restarts of servers the run launched, since the last step",
    "rollout/requests_resubmitted": "generation requests moved to another server because theirs was "
                                    "taken out while they ran, since the last step",
    "distill/teachers_live": "teacher servers in service at the end of the rollout (on-policy "
                             "distillation; out and given-up ones do not count)",
    "distill/teacher_failures": "teacher servers taken out of service since the last step (a failed "
                                "health probe, a lost connection, a restart that failed)",
    "distill/teacher_restarts": "restarts of teacher servers the run launched, since the last step",
    "distill/teacher_requests_resubmitted": "teacher scoring requests moved to another teacher server "
                                            "because theirs was taken out while they ran",
    "train/loss": "policy loss (mean over mini-batches)",
    "train/clip_fraction": "fraction of sequences clipped (gspo) / tokens (grpo, gspo_token)",
    "train/seq_ratio_mean": "mean sequence importance ratio s_i",
    "train/seq_ratio_min": "min s_i",
    "train/seq_ratio_max": "max s_i",
    "train/kl": "KL to the reference policy (when loss.kl_coef > 0)",
    "train/grad_norm": "global gradient norm before clipping (mean over mini-batches)",
    "train/lr": "learning rate",
    "train/entropy": "mean per-token entropy of the policy",
    "train/logprob_abs_diff": "mean |trainer log-prob - SGLang log-prob| over trainable tokens",
    "train/logprob_k3": "k3 estimate of KL(SGLang || trainer) per trainable token (mismatch.py)",
    "mismatch/abs_mean": "mean |log pi_old - log pi_engine| on the tokens the corrections saw",
    "mismatch/k3": "k3 estimate of KL(pi_engine || pi_old) per token, same tokens",
    "mismatch/tis_truncated_fraction": "tokens whose TIS weight exp(d) was capped at loss.tis_cap",
    "mismatch/seq_is_truncated_fraction": "sequences whose geometric-mean ratio was capped at "
                                          "loss.seq_is_cap",
    "mismatch/mis_masked_fraction": "tokens (or sequences, loss.mis_level) masked by loss.mis_cap",
    "routing/drift": "(token, layer) top-k expert sets on trained tokens that changed between "
                     "pi_old and the policy after the step's updates (GSPO paper §5.3)",
    "routing/engine_mismatch": "sets megatron's routers choose differently from SGLang's, same "
                               "tokens, in the old-log-prob pass (moe.engine_routing)",
    "routing/replay_mismatch": "with moe.replay: replayed sets that differ from SGLang's (a "
                               "self-check: always 0)",
    "routing/version_mismatch": "on 4 rows per rank, SGLang's recorded sets that differ from what "
                                "the weights of their token's version choose (the versions the "
                                "trainer still holds; 0 but near-ties when routes and tokens are "
                                "paired: actor/held/versioned_routes.py)",
    "time/routing_drift": "seconds of the forward-only routing drift pass (moe.drift)",
    "sync/gb": "GB of HF-named tensors sent per sync, by every sender to every server",
    "sync/bytes": "the same in bytes",
    "sync/rank0_bytes": "bytes trainer rank 0 sent itself (every owner sends its own: "
                        "sync.senders=owners)",
    "sync/senders": "trainer ranks that sent weights in the sync",
    "sync/changed_fraction": "elements of the sent tensors that differ, in the served dtype, from "
                             "the previous sync (1 for a whole sync), on every transport",
    "sync/full_syncs": "servers that got every tensor whole (the first sync, a server back, "
                       "after a failure, or a checksum mismatch); the others got deltas",
    "sync/checksum_mismatches": "tensors a server found different from the trainer's after "
                                "applying a delta (that server then gets a full sync)",
    "sync/buckets": "transfer buckets per sync (sync.bucket_mb each at most)",
    "sync/attempts": "passes of the weight sync: above 1 when a server was lost part-way and the "
                     "sync ran again on the others, or a checksum mismatch got a server a full pass",
    "time/rollout": "seconds generating + scoring",
    "time/log_probs": "seconds computing old log-probs",
    "time/ref_log_probs": "seconds computing the KL reference log-probs (when loss.kl_coef > 0)",
    "time/train": "seconds of the mini-batch updates",
    "time/sync": "seconds of the weight sync into SGLang",
    "time/checkpoint": "seconds saving a checkpoint",
    "time/step": "seconds of the whole step",
    "perf/tokens_per_s": "trained tokens (prompt + response) / step seconds",
    "batch/dp_token_imbalance": "max over mean of the real tokens per data-parallel rank, the worst "
                                "mini-batch of the step (1 = even; train.dp_balance shares the rows)",
    "batch/bytes_per_rank": "bytes of the rollout batch the fullest rank received (its own rows, packed: "
                            "actor/batching/transfer.py)",
    "time/batch_transfer": "seconds rank 0 spent packing the batch and sending the ranks their rows, "
                           "once per replica (its leader relays them; inside time/rollout)",
    "perf/rollout_tokens_per_s": "generated tokens / rollout seconds",
    "perf/sync_gb_per_s": "weight sync throughput into SGLang (GB of HF tensors / sync seconds)",
}


class MetricsWriter:
    """TensorBoard SummaryWriter + jsonl on rank 0; a no-op elsewhere (enabled=False)."""

    def __init__(self, tensorboard_dir: str | None, *, jsonl_path: str | None = None,
                 enabled: bool = True, purge_step: int | None = None):
        """purge_step: on resume, TensorBoard hides events at steps >= purge_step left by the
        interrupted run (SummaryWriter's purge_step), and the jsonl drops those lines."""
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            Path(tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(tensorboard_dir, purge_step=purge_step)
        if jsonl_path is None and tensorboard_dir:
            jsonl_path = os.path.join(tensorboard_dir, "metrics.jsonl")
        if jsonl_path:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if purge_step is not None and path.exists():
                keep = [ln for ln in path.read_text().splitlines()
                        if ln.strip() and json.loads(ln).get("step", 0) < purge_step]
                path.write_text("".join(ln + "\n" for ln in keep))
            self._jsonl = path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._tb is not None:
            wall = time.time()
            for tag, value in clean.items():
                if math.isfinite(value):
                    self._tb.add_scalar(tag, value, step, walltime=wall)
            for tag, values in per_layer_histograms(clean).items():
                self._tb.add_histogram(tag, np.asarray(values), step, walltime=wall)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


# Per-layer tags: one scalar per MoE layer i (only layers with compared tokens).
LAYER_TAGS = {
    "routing_layers/drift": "routing/drift of layer i",
    "routing_layers/engine_mismatch": "routing/engine_mismatch of layer i",
}


def documented(tag: str) -> bool:
    """The tag is in TAGS, is `<LAYER_TAGS key>_layer_<i>`, or an eval tag per data source
    (`eval/accuracy/<source>`, `eval/pass@k/<source>`)."""
    head, _, tail = tag.rpartition("_layer_")
    per_source = tag.startswith(("eval/accuracy/", "eval/pass@k/"))
    return tag in TAGS or (head in LAYER_TAGS and tail.isdigit()) or per_source


def per_layer_histograms(metrics: Mapping[str, float]) -> dict[str, list[float]]:
    """`routing_layers/drift_layer_<i>` scalars -> {"routing_layers/drift": [value per layer]}:
    one TensorBoard histogram per quantity, over the layers (the drift's spread across depth)."""
    out: dict[str, list[float]] = {}
    for tag, value in metrics.items():
        head, _, tail = tag.rpartition("_layer_")
        if head in LAYER_TAGS and tail.isdigit() and math.isfinite(value):
            out.setdefault(head, []).append(value)
    return out


def read_jsonl(path: str | Path, *, live: bool = False, steps_only: bool = False) -> list[dict[str, float]]:
    """The per-step records of a metrics.jsonl (the last record per step wins). live: the run is
    still writing it, so a last line without its newline is one being written and is left for the
    next read (it would be a JSON error here); a finished file is read whole. steps_only: only the
    records of training steps (is_step_record), not the final eval's (logged at step train.steps
    with eval/* metrics only); what a reader of step timings wants."""
    by_step: dict[int, dict[str, float]] = {}
    text = Path(path).read_text()
    if live and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            if steps_only and not is_step_record(rec):
                continue
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def is_step_record(rec: dict) -> bool:
    """A training step's record (it has the step's time), not an eval-only one."""
    return "time/step" in rec


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a TensorBoard log dir, read with tensorboard's own EventAccumulator:
    {tag: [(step, value), ...]} sorted by step (purged/duplicate steps resolved as TensorBoard does)."""
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        out[tag] = sorted((e.step, e.value) for e in acc.Scalars(tag))
    return out


def format_progress(step: int, total: int, m: Mapping[str, float]) -> str:
    """One line per step: step, reward (and the step's reward errors, when any), accuracy, length,
    clip fraction and seconds per phase."""
    def g(key: str, fmt: str) -> str:
        v = m.get(key)
        return format(v, fmt) if v is not None else "-"
    errors = m.get("rollout/reward_errors") or 0
    failed = f" ({errors:.0f} reward error{'s' if errors != 1 else ''})" if errors else ""
    return (f"step {step:>4}/{total} | reward {g('rollout/reward_mean', '.3f')}{failed} "
            f"acc {g('rollout/accuracy', '.2f')} len {g('rollout/response_length_mean', '.1f')} | "
            f"clip {g('train/clip_fraction', '.3f')} ratio {g('train/seq_ratio_mean', '.4f')} "
            f"gnorm {g('train/grad_norm', '.3f')} | rollout {g('time/rollout', '.1f')}s "
            f"logp {g('time/log_probs', '.1f')}s train {g('time/train', '.1f')}s "
            f"sync {g('time/sync', '.1f')}s step {g('time/step', '.1f')}s")

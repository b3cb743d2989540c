"""The GSPO RL loop, run by every trainer rank.

    gspo-megatron train examples/tiny_moe_larger_digit.yaml --set train.steps=3
    torchrun --nproc-per-node 2 $(which gspo-megatron) train CONFIG --set parallel.tensor=2

Rank 0 is also the driver: it owns the SGLang servers (started here, or attached by URL), the
prompts, rollouts and rewards, and sends each rank only its data-parallel share of the rollout
batch, balanced by work and packed (actor/transfer.py). `run_loop` below is the whole loop on one screen;
startup.py builds what it works with (and checks every input before anything is spent).
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from gspo_megatron.algorithms.distill import distillation_advantages
from gspo_megatron.config import RunConfig
from gspo_megatron.driver import DriverError, on_driver
from gspo_megatron.rollout_batch import sft_batch
from gspo_megatron.evaluation import eval_due
from gspo_megatron.metrics import format_progress
from gspo_megatron.startup import Run, begin_rl, export_hf, setup, teardown
from gspo_megatron.stop import GracefulStop, SignalExit
from gspo_megatron.sync.weight_sync import WeightSyncError
from rollout.client_errors import NoServerLeft
from rollout.health import EXIT_NO_SERVER


class PhaseTimer(dict):
    """Seconds per phase (`time/<phase>`), and when each phase ran (`spans`, monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: dict[str, list[tuple[float, float]]] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        m0 = time.monotonic()
        yield
        self[f"time/{phase}"] = self.get(f"time/{phase}", 0.0) + time.perf_counter() - t0
        self.spans.setdefault(phase, []).append((m0, time.monotonic()))


def run_loop(run: Run) -> None:
    cfg, actor, loop, stop = run.cfg, run.actor, run.loop, run.stop
    ckpt_time: dict[str, float] = {}
    saved = loop.step if run.resumed_from else None  # the step of the newest checkpoint
    staleness = cfg.train.max_staleness  # 0: the synchronous loop (rollout, train, sync in turn)
    if run.rank == 0 and loop.step < cfg.train.steps:
        print(f"[gspo] RL: steps {loop.step}..{cfg.train.steps - 1} ({cfg.loss.name}, "
              f"{'synchronous' if not staleness else f'asynchronous, max_staleness {staleness}'})", flush=True)
    if staleness and run.rank == 0:  # the rollout thread generates from here on (docs/async.md)
        run.driver.start_async(version=lambda: str(loop.weight_version))
    for step in range(loop.step, cfg.train.steps):
        if stop.agreed():  # SIGTERM / SIGUSR1 (stop.py): save below, then exit
            break
        t = PhaseTimer()
        live = loop.weight_version  # the weights the servers serve, and the trainer holds
        held_out = on_driver(run.rank, lambda: run.driver.evaluate(step)) if eval_due(cfg, step) else {}
        with t("step"):
            with t("rollout"):  # synchronous: rank 0 generates and scores; asynchronous: it takes
                # what the rollout thread finished; each rank receives only its rows (actor/transfer.py)
                got, saved = receive_rows(run, live, step, staleness, saved)
            if got is None:  # a signal interrupted the rollout: the step is abandoned
                if run.rank == 0:
                    print(f"[gspo] the rollout of step {step} was interrupted by the signal: the step "
                          "is abandoned (the resumed run draws its prompts again)", flush=True)
                break
            shard, batch_facts, transfer = got  # my DP rows of each mini-batch
            metrics = batch_facts["metrics"]
            with t("log_probs"):  # pi_old: forward-only recompute, or the engine's log-probs;
                # asynchronous: each token's from the weights of the version that generated it
                shard.old_log_probs, old = actor.compute_old_log_probs(
                    shard, versions=batch_facts["versions"] if staleness else None, live_version=live)
                if staleness and cfg.train.old_log_probs == "recompute":
                    actor.keep_version(live)  # for the stale tokens of the next steps
            if cfg.distill.teacher and shard.old_log_probs is not None:  # the last pipeline stage
                # on-policy distillation: each token's advantage gains log pi_teacher - log pi_old
                shard.advantages = distillation_advantages(
                    shard.token_advantages(), shard.old_log_probs, shard.teacher_log_probs, shard.loss_mask,
                    coef=cfg.distill.coef, reward_coef=cfg.distill.reward_coef)
            if cfg.loss.kl_coef > 0:
                with t("ref_log_probs"):  # the KL reference: forward-only with its weights swapped in
                    shard.ref_log_probs, _ = actor.compute_ref_log_probs(shard)
            with t("train"):  # k mini-batch GSPO updates (paper: 4)
                updates = [actor.train_step(mini) for mini in shard.mini_batches()]
            if actor.routing_settings.drift:
                with t("routing_drift"):  # forward-only: how many top-k sets moved since pi_old
                    old.update(actor.measure_routing_drift(shard))
            with t("sync"), run.driver.paused() if run.rank == 0 else nullcontext():
                loop.weight_version += 1  # new weights into SGLang (the rollout thread waits)
                sync = sync_weights(run, saved)
            loop.step = step + 1
        metrics.update(train_metrics(updates, old), **sync_metrics(sync), **t, **ckpt_time, **held_out)
        if staleness and run.rank == 0:
            metrics.update(overlap_metrics(t, run.driver.producer))
        metrics["perf/tokens_per_s"] = batch_facts["tokens"] / t["time/step"]
        metrics.update({"batch/dp_token_imbalance": shard.dp_token_imbalance,
                        "batch/bytes_per_rank": transfer["bytes_per_rank"],
                        "time/batch_transfer": transfer["batch_transfer_s"]})
        run.writer.log(step, metrics)  # before the checkpoint: a resume never loses a step's metrics
        if run.rank == 0 and cfg.logging.progress:
            print(format_progress(step, cfg.train.steps, metrics), flush=True)
        ckpt_time = {}
        if run.ckpt and (loop.step % cfg.checkpoint.interval == 0 or loop.step == cfg.train.steps):
            t0 = time.perf_counter()
            save_checkpoint(run)
            saved = loop.step
            ckpt_time = {"time/checkpoint": time.perf_counter() - t0}  # logged with the next step
    signum = stop.agreed()
    if not signum and eval_due(cfg, 0) and loop.step == cfg.train.steps:  # the final eval
        run.writer.log(loop.step, on_driver(run.rank, lambda: run.driver.evaluate(loop.step)))
    if signum:
        if run.ckpt and saved != loop.step:
            save_checkpoint(run)
            saved = loop.step
        raise SignalExit(signum, saved=f"step {saved}" if saved is not None else None)


# --- the pieces ------------------------------------------------------------------------------------
def train_metrics(updates: list[dict[str, float]], old: dict[str, float]) -> dict[str, float]:
    """Mini-batch metrics of the actor -> per-step TensorBoard scalars."""
    def mean(k: str) -> float | None:
        vals = [u[k] for u in updates if k in u]
        return sum(vals) / len(vals) if vals else None
    out = {
        "train/loss": mean("loss"), "train/clip_fraction": mean("clip_fraction"),
        "train/seq_ratio_mean": mean("seq_ratio_mean"),
        "train/seq_ratio_min": min((u["seq_ratio_min"] for u in updates if "seq_ratio_min" in u),
                                   default=None),
        "train/seq_ratio_max": max((u["seq_ratio_max"] for u in updates if "seq_ratio_max" in u),
                                   default=None),
        "train/grad_norm": mean("grad_norm"), "train/lr": updates[-1].get("lr"),
        "train/entropy": old.get("entropy_mean", mean("entropy_mean")),
        "train/kl": mean("kl"),
        # The first (on-policy) pass compares trainer and SGLang on the same weights.
        "train/logprob_abs_diff": old.get("logprob_abs_diff_vs_rollout",
                                          mean("logprob_abs_diff_vs_rollout")),
        "train/logprob_k3": old.get("logprob_k3_vs_rollout", mean("logprob_k3_vs_rollout")),
    }
    # Train/inference mismatch corrections (loss.tis_cap / seq_is_cap / mis_cap), per update.
    for key in ("mismatch_abs_mean", "mismatch_k3", "tis_truncated_fraction",
                "seq_is_truncated_fraction", "mis_masked_fraction"):
        out[f"mismatch/{key.removeprefix('mismatch_')}"] = mean(key)
    # MoE routing (moe: section): drift since pi_old, SGLang vs megatron, the replay self-check.
    for key, value in old.items():
        if key.startswith("routing_") and not key.endswith("_sets"):
            name = key.removeprefix("routing_")
            out[f"routing/{name}" if "_layer/" not in name else
                f"routing_layers/{name.replace('_layer/', '_layer_')}"] = value
    return {k: v for k, v in out.items() if v is not None}


class ServersLost(RuntimeError):
    """No SGLang server came back within rollout.server_wait_s: the run ends with EXIT_NO_SERVER
    (a Slurm requeue retries it, launch/slurm/job.sh) after a checkpoint of its last step."""


def receive_rows(run: Run, live: int, step: int, staleness: int, saved: int | None):
    """actor.receive_rows of the step's rollout, surviving the loss of every server
    (rollout/health.py): every rank saves the last finished step (unless saved already), rank 0
    waits up to rollout.server_wait_s for a server to come back, the weights are synced into it,
    and the step's rollout starts again (its prompts were put back: none is lost or repeated).
    Past the wait: ServersLost on every rank; a signal meanwhile: SignalExit. Returns (what
    receive_rows returned, the step of the newest checkpoint)."""
    for _ in range(run.cfg.rollout.server_max_restarts_per_run + 2):  # bounded, whatever happens
        try:
            return run.actor.receive_rows(run.rank, lambda: rollout_on_driver(run, live, step, staleness),
                                          num_mini_batches=run.cfg.train.mini_batches), saved
        except (NoServerLeft, DriverError) as e:
            if not isinstance(e, NoServerLeft) and e.kind != NoServerLeft.__name__:
                raise
        if run.ckpt and saved != run.loop.step:
            save_checkpoint(run)
            saved = run.loop.step
        await_a_server(run, saved)
        with run.driver.paused() if run.rank == 0 else nullcontext():
            sync_weights(run, saved, again=True)  # the servers back get the policy
        on_driver(run.rank, run.driver.restart_rollouts)
    raise ServersLost(f"no rollout completed after {run.cfg.rollout.server_max_restarts_per_run + 2} "
                      f"servers came back ({on_driver(run.rank, lambda: run.driver.pool.summary())})")


def sync_weights(run: Run, saved: int | None, again: bool = False) -> dict[str, float]:
    """run.sync.sync of the trainer's version; when no server is left to take it (one lost while
    the trainer trained, and not back yet), wait for one (await_a_server), then sync again. Not
    saved first: the step is half done (trained, not synced), a resume redoes it from `saved`.
    A signal during that wait ends the step without the sync ({"deferred": 1.0}; the loop saves
    it as trained and the resumed run syncs its servers at start, startup.begin_rl), except for a
    resync of servers that came back (again=True): SignalExit."""
    for _ in range(run.cfg.rollout.server_max_restarts_per_run + 2):  # bounded, whatever happens
        try:
            return run.sync.sync(run.loop.weight_version, again=again)
        except WeightSyncError as e:
            if not e.no_server:
                raise
        if not await_a_server(run, saved, finish_on_signal=not again):
            # a signal, and no server to take the trained weights: the step ends here, saved as
            # trained; the resumed run loads them into its servers at start (startup.py)
            if run.rank == 0:
                print(f"[gspo] a stop signal while no SGLang server could take weight version "
                      f"{run.loop.weight_version}: the step ends without the sync; the resumed run "
                      "syncs its servers at start", flush=True)
            return {"deferred": 1.0}
    raise ServersLost(f"no weight sync took hold after {run.cfg.rollout.server_max_restarts_per_run + 2} "
                      f"servers came back ({on_driver(run.rank, lambda: run.driver.pool.summary())})")


def await_a_server(run: Run, saved: int | None, finish_on_signal: bool = False) -> bool:
    """Every rank: rank 0 waits up to rollout.server_wait_s for a server to come back (True); a
    signal meanwhile is SignalExit, or False with finish_on_signal (the caller ends its step); none
    back is ServersLost (exit 75, after the one line)."""
    back = on_driver(run.rank, lambda: run.driver.wait_for_server(run.stop.requested))
    signum = run.stop.agreed()
    if signum and finish_on_signal:
        return False
    if signum:
        raise SignalExit(signum, saved=f"step {saved}" if saved is not None else None)
    if not back:
        what = on_driver(run.rank, lambda: no_server_marker(run))
        kept = f"; the checkpoint of step {saved} resumes it" if saved is not None else ""
        raise ServersLost(f"no SGLang server in service after waiting rollout.server_wait_s="
                          f"{run.cfg.rollout.server_wait_s:g} s ({what}){kept}; exiting with "
                          f"{EXIT_NO_SERVER} (retryable: launch/slurm/job.sh requeues on it)")


NO_SERVER_MARKER = "NO_SERVER_LEFT"


def no_server_marker(run: Run) -> str:
    """Rank 0, before any rank exits 75: writes checkpoint.dir/NO_SERVER_LEFT, which tells
    launch/slurm/job.sh to requeue whatever exit code srun reports (srun --kill-on-bad-exit may
    SIGKILL rank 0 once the others have exited); returns what happened to each server."""
    what = run.driver.pool.summary()
    if run.cfg.checkpoint.dir:
        (Path(run.cfg.checkpoint.dir) / NO_SERVER_MARKER).write_text(what + "\n")
    return what


def trained_versions(batch) -> list[int]:
    """The weight versions among the batch's trained tokens, ascending."""
    return torch.unique(batch.weight_versions[batch.loss_mask & (batch.weight_versions >= 0)]).tolist()


def rollout_on_driver(run: Run, live: int, step: int, staleness: int):
    """Rank 0: the step's rollout batch and what every rank needs of the whole batch (its metrics,
    its tokens and, asynchronous, the weight versions it trains), or None when a signal
    interrupted the rollout."""
    got = run.driver.rollout_batch(str(live), step, should_stop=run.stop.requested,
                                   oldest_version=oldest_usable_version(run, live) if staleness else None)
    if got is None:
        return None
    batch, metrics = got
    return batch, {"metrics": metrics, "versions": trained_versions(batch) if staleness else None,
                   "tokens": float(batch.lengths.sum())}


def oldest_usable_version(run: Run, live: int) -> int:
    """The oldest version a sample may come from at `live`: max_staleness back, and, when pi_old is
    recomputed, no older than the weights kept (after a resume, none from before it)."""
    oldest = live - run.cfg.train.max_staleness
    if run.cfg.train.old_log_probs == "recompute":
        oldest = max(oldest, min(run.actor.kept_versions() + [live]))
    return oldest


def overlap_metrics(t: PhaseTimer, producer) -> dict[str, float]:
    """Busy fractions of the rollout thread and the trainer over the step, and their overlap."""
    start, end = t.spans["step"][0]
    train = [s for phase, spans in t.spans.items() if phase not in ("step", "rollout") for s in spans]
    rollout = producer.busy_spans(start, end)
    wall = max(end - start, 1e-9)
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in train for c, d in rollout)
    return {"async/rollout_busy": sum(b - a for a, b in rollout) / wall,
            "async/train_busy": sum(b - a for a, b in train) / wall, "async/overlap": both / wall}


def sync_metrics(report: dict[str, float]) -> dict[str, float]:
    """The weight sync's report (rank 0's view) -> TensorBoard scalars (none for a deferred one)."""
    if report.get("deferred"):
        return {}
    return {"perf/sync_gb_per_s": report["gb_per_s"], "sync/gb": report["bytes"] / 1e9,
            "sync/buckets": report["buckets"], "sync/attempts": report["attempts"]}


def save_checkpoint(run: Run) -> None:
    if run.rank == 0:
        state = run.driver.state()
        run.loop.data_cursor, run.loop.rollout_buffer = state["stream"], state["manager"]
    run.ckpt.save(run.loop.step, run.actor, run.loop)


def warm_start(run: Run) -> None:
    """Supervised warm start: `warm_start_steps` cross-entropy steps on the prompt file's answers
    (teaches a tiny random model the answer format). Uses the RL optimizer at warm_start_lr, then
    resets it, so RL starts from a fresh optimizer and its own learning-rate schedule."""
    cfg, actor = run.cfg, run.actor
    n = cfg.train.warm_start_batch_size
    if run.rank == 0:
        print(f"[gspo] warm start: {cfg.train.warm_start_steps} supervised steps on the prompt set's "
              f"answers ({n} examples each), then RL", flush=True)
    for k in range(cfg.train.warm_start_steps):
        if run.stop.agreed():  # nothing of RL to save yet: a rerun warm-starts again, the same way
            raise SignalExit(run.stop.signum)
        examples = on_driver(run.rank, lambda: run.driver.warm_start_examples(n, offset=k * n))
        m = actor.sft_step(actor.shard(sft_batch(examples)), lr=cfg.train.warm_start_lr)
        if run.rank == 0 and cfg.logging.progress and (k % 10 == 0 or k == cfg.train.warm_start_steps - 1):
            print(f"warm start {k + 1}/{cfg.train.warm_start_steps} | ce {m['loss']:.3f}", flush=True)
    actor.reset_optimizer()


def train(cfg: RunConfig) -> int:
    """Run the whole job on this rank; returns the process exit code."""
    run = None
    stop = GracefulStop(enabled=cfg.checkpoint.save_on_signal)  # first, so setup is covered too
    try:
        run = setup(cfg, stop)  # every input checked, then actor, servers, weights (initial or resumed)
        if run.resumed_from is None and cfg.train.warm_start_steps > 0:
            warm_start(run)
        begin_rl(run)     # the KL reference, and the servers get the policy RL starts from
        run_loop(run)
        if cfg.checkpoint.export_hf:
            run.export_src = run.final_model_checkpoint()  # collective
    finally:
        teardown(run)
        stop.restore()
    if run is not None and run.rank == 0 and cfg.checkpoint.export_hf:
        export_hf(run.export_src, cfg)  # one process, no process group
    return 0

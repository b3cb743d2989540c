"""The GSPO RL loop, run by every trainer rank.

    gspo-megatron train examples/tiny_moe_larger_digit.yaml --set train.steps=3
    torchrun --nproc-per-node 2 $(which gspo-megatron) train CONFIG --set parallel.tensor=2

Rank 0 is also the driver (driver/): it owns the SGLang servers (started here, or attached by URL),
the prompts, rollouts and rewards, and sends each rank only its data-parallel share of the rollout
batch, balanced by work and packed (actor/batching/transfer.py). `run_loop` below is the whole loop on one
screen; run/ builds what it works with (setup.py, after every check in preflight.py), keeps it
going when servers are lost (recovery.py) and shapes its metrics (loop_metrics.py).
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext

from gspo_megatron.actor.reward_kl import reward_kl_advantages
from gspo_megatron.algorithms.distill import distillation_advantages
from gspo_megatron.config import RunConfig
from gspo_megatron.driver.evaluation import eval_due
from gspo_megatron.driver.warm_start import sft_batch
from gspo_megatron.parallel.rank_zero import on_driver
from gspo_megatron.run.loop_metrics import PhaseTimer, step_scalars
from gspo_megatron.run.metrics import format_progress
from gspo_megatron.run.recovery import no_server_left, receive_rows, sync_weights
from gspo_megatron.run.model_files import export_hf, export_peft, final_model_checkpoint
from gspo_megatron.run.setup import Run, begin_rl, setup, teardown
from gspo_megatron.run.signals import GracefulStop, SignalExit


def run_loop(run: Run) -> None:
    cfg, actor, loop, stop = run.cfg, run.actor, run.loop, run.stop
    ckpt_time: dict[str, float] = {}
    saved = loop.step if run.resumed_from else None  # the step of the newest checkpoint
    staleness = cfg.train.max_staleness  # 0: the synchronous loop (rollout, train, sync in turn)
    if run.rank == 0 and loop.step < cfg.train.steps:
        print(f"[gspo] RL: steps {loop.step}..{cfg.train.steps - 1} ({cfg.loss.name}, "
              f"{'synchronous' if not staleness else f'asynchronous, max_staleness {staleness}'})", flush=True)
    if staleness and run.rank == 0:  # the rollout thread generates from here on (docs/async.md)
        run.rank0_driver.start_async(version=lambda: str(loop.weight_version))
    for step in range(loop.step, cfg.train.steps):
        if stop.agreed():  # SIGTERM / SIGUSR1 (run/signals.py): save below, then exit
            break
        t = PhaseTimer()
        live = loop.weight_version  # the weights the servers serve, and the trainer holds
        held_out = on_driver(run.rank, lambda: run.rank0_driver.evaluate(step)) if eval_due(cfg, step) else {}
        with t("step"):
            with t("rollout"):  # synchronous: rank 0 generates and scores; asynchronous: it takes
                # what the rollout thread finished; each rank receives only its rows (actor/batching/transfer.py),
                # and a step whose servers are all lost waits for one to come back (run/recovery.py)
                got, saved = receive_rows(run, live, step, staleness, saved)
            if got is None:  # a signal interrupted the rollout: the step is abandoned
                if run.rank == 0:
                    print(f"[gspo] the rollout of step {step} was interrupted by the signal: the step "
                          "is abandoned (the resumed run draws its prompts again)", flush=True)
                break
            shard, batch_facts, transfer = got  # my DP rows of each mini-batch
            with t("log_probs"):  # pi_old: forward-only recompute, or the engine's log-probs;
                # asynchronous: each token's from the weights of the version that generated it
                shard.old_log_probs, old = actor.compute_old_log_probs(
                    shard, versions=batch_facts["versions"] if staleness else None, live_version=live)
                if shard.routed_experts is not None:  # the engine's routes against their versions' weights
                    old.update(actor.measure_version_mismatch(shard, batch_facts["versions"], live))
                if staleness and cfg.train.old_log_probs == "recompute":
                    actor.keep_version(live)  # for the stale tokens of the next steps
            if cfg.distill.teacher and shard.old_log_probs is not None:  # the last pipeline stage
                # on-policy distillation: each token's advantage gains log pi_teacher - log pi_old
                shard.advantages = distillation_advantages(
                    shard.token_advantages(), shard.old_log_probs, shard.teacher_log_probs, shard.loss_mask,
                    coef=cfg.distill.coef, reward_coef=cfg.distill.reward_coef)
            if cfg.loss.reference_reason:
                with t("ref_log_probs"):  # the KL reference: forward-only with its weights swapped in
                    shard.ref_log_probs, _ = actor.compute_ref_log_probs(shard)
            if cfg.loss.kl_in_reward:  # the KL in the reward: advantages on the last stage, over DP
                shard.advantages = reward_kl_advantages(shard, cfg.loss, cfg.rollout.group_size)
            with t("train"):  # k mini-batch GSPO updates (paper: 4)
                updates = [actor.train_step(mini) for mini in shard.mini_batches()]
            if actor.routing_settings.drift:
                with t("routing_drift"):  # forward-only: how many top-k sets moved since pi_old
                    old.update(actor.measure_routing_drift(shard))
            with t("sync"), run.rank0_driver.paused() if run.rank == 0 else nullcontext():
                loop.weight_version += 1  # new weights into SGLang (the rollout thread waits)
                sync = sync_weights(run, saved)
            loop.step = step + 1
        producer = run.rank0_driver.producer if staleness and run.rank == 0 else None
        metrics = step_scalars(batch_facts["metrics"], updates, old, sync, t, batch_facts["tokens"], shard,
                               transfer, producer)
        metrics.update(ckpt_time, **held_out)
        run.writer.log(step, metrics)  # before the checkpoint: a resume never loses a step's metrics
        if run.rank == 0 and cfg.logging.progress:
            print(format_progress(step, cfg.train.steps, metrics), flush=True)
        ckpt_time = {}
        if run.ckpt and (loop.step % cfg.checkpoint.interval == 0 or loop.step == cfg.train.steps):
            t0 = time.perf_counter()
            run.save_checkpoint()
            saved = loop.step
            ckpt_time = {"time/checkpoint": time.perf_counter() - t0}  # logged with the next step
        if run.lost is not None:  # no server took this step's weights (recovery.sync_weights)
            if saved != loop.step:
                run.save_checkpoint()
                saved = loop.step
            raise no_server_left(run.lost, saved)
    signum = stop.agreed()
    if not signum and eval_due(cfg, 0) and loop.step == cfg.train.steps:  # the final eval
        run.writer.log(loop.step, on_driver(run.rank, lambda: run.rank0_driver.evaluate(loop.step)))
    if signum:
        if run.ckpt and saved != loop.step:
            run.save_checkpoint()
            saved = loop.step
        raise SignalExit(signum, saved=f"step {saved}" if saved is not None else None)


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
        signum = run.stop.agreed()
        if signum:  # nothing of RL to save yet: a rerun warm-starts again, the same way
            raise SignalExit(signum, unsaved="stopped in the warm start, nothing of RL to save "
                             "(the same command warm-starts again)")
        examples = on_driver(run.rank, lambda: run.rank0_driver.warm_start_examples(n, offset=k * n))
        m = actor.sft_step(actor.shard(sft_batch(examples)), lr=cfg.train.warm_start_lr)
        if run.rank == 0 and cfg.logging.progress and (k % 10 == 0 or k == cfg.train.warm_start_steps - 1):
            print(f"warm start {k + 1}/{cfg.train.warm_start_steps} | ce {m['loss']:.3f}", flush=True)
    actor.reset_optimizer()


def train(cfg: RunConfig) -> int:
    """Run the whole job on this rank; returns the process exit code: 0, or 128 + the signal that
    stopped it (after saving; Ctrl-C, SIGINT, is 130). A GspoError propagates (cli.main says it)."""
    try:
        return _train(cfg)
    except SignalExit as e:
        if e.saved:
            what = (f"saved a checkpoint of {e.saved} in {cfg.checkpoint.dir}; exiting with {e.exit_code} "
                    "(the same command resumes)")
        elif e.unsaved:
            what = f"{e.unsaved}; exiting with {e.exit_code}"
        else:
            what = f"exiting with {e.exit_code}, " + (
                "nothing saved: checkpoint.dir is null (the same command starts again from step 0)"
                if not cfg.checkpoint.dir else "nothing new to save (the same command resumes)")
        print(f"gspo-megatron: {e.args[0].split(':')[0]} (rank {os.environ.get('RANK', '0')}): {what}",
              file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"gspo-megatron: interrupted (rank {os.environ.get('RANK', '0')})", file=sys.stderr)
        return 130


def _train(cfg: RunConfig) -> int:
    run = None
    stop = GracefulStop(enabled=cfg.checkpoint.save_on_signal)  # first, so setup is covered too
    try:
        run = setup(cfg, stop)  # every input checked, then actor, servers, weights (initial or resumed)
        if run.resumed_from is None and cfg.train.warm_start_steps > 0:
            warm_start(run)
        begin_rl(run)     # the KL reference, and the servers get the policy RL starts from
        run_loop(run)
        if cfg.checkpoint.export_hf:
            run.export_src = final_model_checkpoint(run)  # collective
        if cfg.lora.export_peft:
            export_peft(run)  # collective
    finally:
        teardown(run)
        stop.restore()
    if run is not None and run.rank == 0 and cfg.checkpoint.export_hf and run.export_src is not None:
        export_hf(run.export_src, cfg)  # one process, no process group
    return 0

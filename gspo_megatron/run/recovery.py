"""A step's rows and weights when SGLang servers are lost (rollout/servers/health.py takes them out, restarts
those the run launched): the loop goes on once a server is back, or ends with exit 75.

    got, saved = receive_rows(run, live, step, staleness, saved)   # every rank: its rows
    report = sync_weights(run, saved)                              # every rank: the weight sync

With no server left in service, every rank saves the last finished step (unless saved already),
rank 0 waits up to rollout.server_wait_s for one to come back, the weights are synced into it, and
the step's rollout starts again (its prompts were put back: none is lost or repeated). Past the
wait every rank raises ServersLost (exit 75, which launch/slurm/job.sh requeues); a signal meanwhile
is SignalExit. On-policy distillation's teacher servers take the same path (NoTeacherLeft), without
the weight sync: they never hold the student's weights.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from gspo_megatron.parallel.rank_zero import DriverError, on_driver
from gspo_errors import GspoError, InputError
from gspo_megatron.run.setup import Run
from gspo_megatron.run.signals import SignalExit
from gspo_megatron.sync.weight_sync import WeightSyncError
from rollout.servers.errors import NoServerLeft, NoTeacherLeft
from rollout.servers.health import EXIT_NO_SERVER


LOST = {NoServerLeft.__name__, NoTeacherLeft.__name__}  # DriverError.kind of a rank 0 without servers


class ServersFailOnInputs(InputError, RuntimeError):
    """The servers the run launched died of the same exception after a restart, on the same
    requests (rollout/servers/health.py): a failure of the inputs that a requeue meets again, so
    exit 2, never 75."""


class ServersLost(GspoError, RuntimeError):
    """No SGLang server came back within rollout.server_wait_s: the run ends with EXIT_NO_SERVER
    (a Slurm requeue retries it, launch/slurm/job.sh) after a checkpoint of its last step."""

    exit_code = EXIT_NO_SERVER
    what = ""
    """Which servers are out and why, for the line said again once a checkpoint keeps the step."""


def no_server_left(what: str, saved: int | None) -> ServersLost:
    """The one line of a run no server came back to: `what`, the checkpoint that resumes it, the
    exit code and the requeue."""
    kept = f"; the checkpoint of step {saved} resumes it" if saved is not None else ""
    lost = ServersLost(f"{what}{kept}; exiting with {EXIT_NO_SERVER} (retryable: launch/slurm/job.sh "
                       "requeues on it)")
    lost.what = what
    return lost


def receive_rows(run: Run, live: int, step: int, staleness: int, saved: int | None):
    """actor.receive_rows of the step's rollout, surviving the loss of every server
    (rollout/servers/health.py): every rank saves the last finished step (unless saved already), rank 0
    waits up to rollout.server_wait_s for a server to come back, the weights are synced into it,
    and the step's rollout starts again (its prompts were put back: none is lost or repeated).
    Past the wait: ServersLost on every rank; a signal meanwhile: SignalExit. Returns (what
    receive_rows returned, the step of the newest checkpoint)."""
    for _ in range(run.cfg.rollout.server_max_restarts_per_run + 2):  # bounded, whatever happens
        try:
            return run.actor.receive_rows(run.rank, lambda: rollout_on_driver(run, live, step, staleness),
                                          num_mini_batches=run.cfg.train.mini_batches), saved
        except (NoServerLeft, DriverError) as e:
            if not isinstance(e, NoServerLeft) and e.kind not in LOST:
                raise
        if run.ckpt and saved != run.loop.step:
            run.save_checkpoint()
            saved = run.loop.step
        await_a_server(run, saved)
        if on_driver(run.rank, lambda: run.rank0_driver.policy_needs_sync()):  # not when a teacher was lost
            with run.rank0_driver.paused() if run.rank == 0 else nullcontext():
                sync_weights(run, saved, again=True)  # the servers back get the policy
        on_driver(run.rank, lambda: run.rank0_driver.restart_rollouts())
    raise ServersLost(f"no rollout completed after {run.cfg.rollout.server_max_restarts_per_run + 2} "
                      f"servers came back ({on_driver(run.rank, lambda: run.rank0_driver.lost_servers()[1])})")


def sync_weights(run: Run, saved: int | None, again: bool = False) -> dict[str, float]:
    """run.sync.sync of the trainer's version; when no server is left to take it (one lost while
    the trainer trained, and not back yet), wait for one (await_a_server), then sync again. Not
    saved first: the step is half done (trained, not synced), a resume redoes it from `saved`.
    A signal during that wait ends the step without the sync ({"deferred": 1.0}; the loop saves
    it as trained and the resumed run syncs its servers at start, setup.begin_rl), except for a
    resync of servers that came back (again=True): SignalExit. No server back within the wait:
    the step ends the same way, its reason kept in `run.lost`, and the loop saves the trained step
    before it raises it (the resumed run syncs its servers at start): a server lost in the sync
    costs no trained step, nor, before the first checkpoint, the whole run."""
    for _ in range(run.cfg.rollout.server_max_restarts_per_run + 2):  # bounded, whatever happens
        try:
            return run.sync.sync(run.loop.weight_version, again=again)
        except WeightSyncError as e:
            if not e.no_server:
                raise
        try:
            back = await_a_server(run, saved, finish_on_signal=not again)
        except ServersLost as lost:
            if again or run.ckpt is None:
                raise
            run.lost = lost.what
            return {"deferred": 1.0}
        if not back:
            # a signal, and no server to take the trained weights: the step ends here, saved as
            # trained; the resumed run loads them into its servers at start (setup.begin_rl)
            if run.rank == 0:
                print(f"[gspo] a stop signal while no SGLang server could take weight version "
                      f"{run.loop.weight_version}: the step ends without the sync; the resumed run "
                      "syncs its servers at start", flush=True)
            return {"deferred": 1.0}
    raise ServersLost(f"no weight sync took hold after {run.cfg.rollout.server_max_restarts_per_run + 2} "
                      f"servers came back ({on_driver(run.rank, lambda: run.rank0_driver.pool.summary())})")


def await_a_server(run: Run, saved: int | None, finish_on_signal: bool = False) -> bool:
    """Every rank: rank 0 waits up to rollout.server_wait_s for a server to come back (True); a
    signal meanwhile is SignalExit, or False with finish_on_signal (the caller ends its step); none
    back is ServersLost (exit 75, after the one line)."""
    back, waited = on_driver(run.rank, lambda: run.rank0_driver.wait_for_server(run.stop.requested))
    signum = run.stop.agreed()
    if signum and finish_on_signal:
        return False
    if signum:
        raise SignalExit(signum, saved=f"step {saved}" if saved is not None else None)
    if not back:
        failure = on_driver(run.rank, lambda: input_failure(run))
        if failure is not None:
            kept = f"; the checkpoint of step {saved} is kept" if saved is not None else ""
            raise ServersFailOnInputs(f"{failure}: the same failure after a restart is the inputs' (the model, its "
                                      f"config, the prompts), not a lost server; fix them and rerun{kept} (not "
                                      "retried: exit 2)")
        kind, what = on_driver(run.rank, lambda: no_server_marker(run))
        wait_s = run.cfg.rollout.server_wait_s
        how = (f"after waiting rollout.server_wait_s={wait_s:g} s" if waited >= wait_s else
               "and none can come back")  # each past its restart bound: no reason to wait
        raise no_server_left(f"no {kind} in service {how} ({what})", saved)
    return True


def input_failure(run: Run) -> str | None:
    """Rank 0: when a role's servers are all gone and those the run launched died the same way
    twice (ServerPool.input_failure), the line that says so; else None."""
    for pool in run.rank0_driver.pools_without_server():
        failure = pool.input_failure()
        if failure is not None:
            return f"no {pool.role.name} in service: each died the same way after a restart ({failure})"
    return None


NO_SERVER_MARKER = "NO_SERVER_LEFT"


def no_server_marker(run: Run) -> tuple[str, str]:
    """Rank 0, before any rank exits 75: writes checkpoint.dir/NO_SERVER_LEFT, which tells
    launch/slurm/job.sh to requeue whatever exit code srun reports (srun --kill-on-bad-exit may
    SIGKILL rank 0 once the others have exited); returns (which servers are missing: "SGLang
    server" or "teacher server", what happened to each of them)."""
    kind, what = run.rank0_driver.lost_servers()
    if run.cfg.checkpoint.dir:
        (Path(run.cfg.checkpoint.dir) / NO_SERVER_MARKER).write_text(what + "\n")
    return kind, what


def trained_versions(batch) -> list[int]:
    """The weight versions among the batch's trained tokens, ascending."""
    return torch.unique(batch.weight_versions[batch.loss_mask & (batch.weight_versions >= 0)]).tolist()


def rollout_on_driver(run: Run, live: int, step: int, staleness: int):
    """Rank 0: the step's rollout batch and what every rank needs of the whole batch (its metrics,
    its tokens and, asynchronous, the weight versions it trains), or None when a signal
    interrupted the rollout."""
    got = run.rank0_driver.rollout_batch(str(live), step, should_stop=run.stop.requested,
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

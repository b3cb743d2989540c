"""Graceful stop on SIGTERM / SIGUSR1 / SIGINT (Ctrl-C): save, then exit with the signal's status.

    stop = GracefulStop(enabled=cfg.checkpoint.save_on_signal)
    ...                                  # the loop asks stop.agreed() at its safe points
    raise SignalExit(stop.signum)        # after the save: exit code 128 + signal number

Slurm preemption, `scancel` and the time limit (`#SBATCH --signal=B:USR1@300` in the launch
scripts, which then SIGTERM the trainer step and give it GSPO_STOP_GRACE seconds) all send a signal
first and SIGKILL later. On the first signal the RL loop (trainer.run_loop):
- during a rollout: aborts the in-flight generation requests and abandons the step; the prompt
  stream and the partial-rollout buffer go back to where the step began, so the resumed run
  draws the same prompts again (nothing is lost, nothing trained twice);
- later in a step (old log-probs, train, sync): finishes the step (its updates are committed to
  the servers by the sync) and its metrics;
then saves a checkpoint of the last finished step (unless one was just written) and exits with
128 + the signal number (143 for SIGTERM, 138 for SIGUSR1, 130 for Ctrl-C). Ctrl-C is a signal a
user sends too: the SGLang servers and reward workers the run starts lead sessions of their own, so
the terminal's SIGINT reaches the trainer alone, which saves as for SIGTERM. Under torchrun,
torchrun itself answers Ctrl-C by sending its workers SIGTERM, their second signal: they exit at
once, as torchrun expects. The bound: the abort and drain of a
rollout (seconds; request_timeout_s at worst), or the rest of one step's train and sync, plus one
checkpoint save. A second signal exits at once (SignalExit raised in the handler; the servers this
run started are still stopped on the way out).

Every rank takes part: the signal may reach only some ranks (a `kill` of rank 0), so the loop asks
`agreed()`, an all-reduce (MAX) over the default group, at the same points on every rank.
"""
from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class SignalExit(BaseException):
    """The run stops because of a signal; exit code 128 + signum. A BaseException: no
    `except Exception` on the way out may swallow it."""

    def __init__(self, signum: int, saved: str | None = None, unsaved: str | None = None) -> None:
        """saved: what was saved ("step 3"); unsaved: why nothing was, said to the user instead."""
        self.signum, self.saved, self.unsaved = signum, saved, unsaved
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped" + (f" after saving {saved}" if saved else ""))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """Records the first SIGTERM / SIGUSR1 / SIGINT; a second one raises SignalExit at once."""

    def __init__(self, enabled: bool = True) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise SignalExit(signum, unsaved="a second signal: exiting at once, nothing saved")
        self.signum = signum
        print(f"[gspo] {signal.Signals(signum).name}: saving at the next safe point, then exiting "
              "(a second signal exits at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """This rank received a signal (no communication)."""
        return self.signum is not None

    def agreed(self) -> int | None:
        """Collective over the default group: the signal any rank received, or None."""
        mine = self.signum or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            from gspo_megatron.parallel.comm import comm_device
            t = torch.tensor([mine], dtype=torch.int64, device=comm_device(None))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            mine = int(t.item())
        if mine and self.signum is None:
            self.signum = mine  # another rank's signal stops this one too
        return mine or None

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

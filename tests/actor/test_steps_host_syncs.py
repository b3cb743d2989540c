"""The project's device-to-host synchronisations per step are a constant: not one per micro-batch,
not one per layer (on an H100 the packed step left the GPU idle 60% of the time).

On CPU nothing waits for a device, so the test counts the calls that would wait on a GPU:
`Tensor.item`, `tolist`, `cpu` and the conversions `int()`, `float()`, `bool()`, `operator.index`
of a tensor, made from the project's own code (gspo_megatron/). It counts from the moment the
schedule starts: planning (actor/batching/token_budget.py, packing.py) reads the rank's batch while it is
still on the host, before any tensor moves to the device (forward.py: `next(data_iterator).to(device)`).
The count of the train step and of the forward-only log-prob pass must not change with the number
of micro-batches (1 or 4) or of layers (2 or 4). megatron-core's own calls are counted too and
printed (their per-micro-batch ones are the dispatcher's; the note in docs/performance.md).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import run_distributed

PROJECT = str(Path(__file__).resolve().parents[2] / "gspo_megatron")
CONVERSIONS = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__")


class SyncCounter:
    """Counts the conversions above per calling line while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.project: collections.Counter = collections.Counter()
        self.megatron: collections.Counter = collections.Counter()
        self._saved: dict[str, Any] = {}

    def __enter__(self):
        for name in CONVERSIONS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t, *a, _original=original, _name=name, **k):
                frame = sys._getframe(1)
                # cpu_compat's TorchFunctionMode re-dispatches the call it intercepted: the
                # caller's own call is counted already (CPU only; it does not run on a GPU).
                if self.on and not frame.f_code.co_filename.endswith("cpu_compat.py"):
                    where = f"{frame.f_code.co_filename}:{frame.f_lineno} {_name}"
                    if frame.f_code.co_filename.startswith(PROJECT):
                        self.project[where.removeprefix(PROJECT + "/")] += 1
                    elif "megatron/core" in frame.f_code.co_filename:
                        self.megatron[where.split("megatron/core/")[-1]] += 1
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _batch(rows: int = 8, seq: int = 24):
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, seq + 1, (rows,), generator=g)
    t = torch.arange(seq)[None]
    return TrainBatch(tokens=torch.randint(0, 512, (rows, seq), generator=g), lengths=lengths,
                      loss_mask=(t >= 6) & (t < lengths[:, None]),
                      advantages=torch.randn(rows, generator=g),
                      rollout_log_probs=torch.full((rows, seq), -2.0))


def _count(rank, world, layers: int, micro_batch_size: int):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings, steps
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    actor = Actor(tiny_hf_config(num_hidden_layers=layers), ParallelLayout(),
                  optimizer=OptimizerSettings(optimizer="adam", lr=1e-3),
                  loss=LossSettings(name="gspo"), micro_batch_size=micro_batch_size)
    out = {}
    with actor, SyncCounter() as counter:
        plan = steps.plan

        def counted_plan(*a, **k):  # host work on the host batch: not counted
            was, counter.on = counter.on, False
            try:
                return plan(*a, **k)
            finally:
                counter.on = was
        steps.plan = counted_plan
        try:
            for phase in ("log_probs", "train"):
                shard = actor.shard(_batch())
                if phase == "train":
                    shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
                counter.project.clear(), counter.megatron.clear()
                counter.on = True
                if phase == "train":
                    m = actor.train_step(shard)
                else:
                    _, m = actor.compute_old_log_probs(shard)
                counter.on = False
                out[phase] = dict(project=dict(counter.project), megatron=dict(counter.megatron),
                                  num_microbatches=m["num_microbatches"])
        finally:
            steps.plan = plan
    return out


@pytest.mark.slow
def test_project_syncs_per_step_do_not_grow_with_micro_batches_or_layers():
    runs = {(layers, mbs): run_distributed(_count, 1, (layers, mbs), timeout=300)[0]
            for layers, mbs in ((2, 8), (2, 2), (4, 2))}
    for phase in ("log_probs", "train"):
        assert runs[(2, 8)][phase]["num_microbatches"] == 1.0
        assert runs[(2, 2)][phase]["num_microbatches"] == 4.0
        counts = {key: r[phase]["project"] for key, r in runs.items()}
        for key, c in counts.items():
            print(phase, key, "project:", sum(c.values()), c)
            print(phase, key, "megatron:", sum(runs[key][phase]["megatron"].values()), runs[key][phase]["megatron"])
        assert counts[(2, 8)] == counts[(2, 2)], f"{phase}: syncs grow with micro-batches"
        assert counts[(2, 2)] == counts[(4, 2)], f"{phase}: syncs grow with layers"
        assert sum(counts[(2, 8)].values()) > 0  # the counter sees the step's metrics


def test_counter_sees_a_sync_in_project_code():
    """The counter itself: a conversion in project code is seen per call; one here is not."""
    from gspo_megatron.actor.batching.balance import row_work
    with SyncCounter() as counter:
        counter.on = True
        torch.ones(1).item()  # the test's own: not counted
        assert sum(counter.project.values()) == 0
        row_work(torch.tensor([5, 7, 6, 9]), "tokens")  # float() of each row's length
        one = sum(counter.project.values())
        row_work(torch.tensor([5, 7, 6, 9, 4, 8]), "tokens")
        assert one >= 2 and sum(counter.project.values()) == one + one * 3 // 2

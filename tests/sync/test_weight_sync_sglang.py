"""Weight sync into a real SGLang server: after a GSPO step under TP2, each transport (disk, tensor,
distributed over gloo) makes the server's log-probs of its own generation equal the trainer's
(1e-4), with a new weight version each time. (A sync that fails part-way: test_sync_disk_full.py,
test_weight_sync_owners.py, test_weight_sync_server_lost.py.)

One spawn of 2 trainer ranks, the session's tiny-Qwen3 server (restored to its weights after).
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from fixtures_models import hf_response_logprobs, tiny_model_dir

pytestmark = pytest.mark.slow
PROMPT = [5, 77, 301, 12, 9, 140, 33]


def _trainer_log_probs(actor, tokens: list[int], n_prompt: int) -> torch.Tensor | None:
    from gspo_megatron.actor.batching.batch import TrainBatch

    t = torch.tensor([tokens])
    batch = TrainBatch(tokens=t, lengths=torch.tensor([len(tokens)]),
                       loss_mask=torch.arange(len(tokens))[None] >= n_prompt,
                       advantages=torch.zeros(1))
    batch.old_log_probs, _ = actor.compute_old_log_probs(batch)
    return batch.old_log_probs[0, n_prompt:] if actor.is_last_stage else None


def _gspo_step(actor, seed: int) -> None:
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 512, (4, 24), generator=g)
    batch = TrainBatch(tokens=tokens, lengths=torch.full((4,), 24),
                       loss_mask=torch.arange(24)[None].expand(4, 24) >= 8,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_log_probs, _ = actor.compute_old_log_probs(batch)
    actor.train_step(batch)


def _body(rank, world, ckpt, url, disk_root):
    from gspo_megatron.actor import actor as actor_mod
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.algorithms.registry import LossSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config, load_model
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import DiskTransport, DistributedTransport, TensorTransport, WeightSync
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = actor_mod.Actor(hf, ParallelLayout(tensor=2), micro_batch_size=2,
                            optimizer=OptimizerSettings(lr=2e-3, clip_grad=0.0),
                            loss=LossSettings(name="gspo"))
    load_model(actor.chunks, ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    transports = {} if rank else {
        "disk": DiskTransport(pool, disk_root, f"{ckpt}/hf"),
        "tensor": TensorTransport(pool),
        "distributed": DistributedTransport(pool),
    }

    def server_generation(report=None):
        out = [None]
        if rank == 0:
            gen = pool.generate(PROMPT, {"max_new_tokens": 16, "temperature": 1.0,
                                         "ignore_eos": True})
            out = [(gen.output_ids, torch.tensor(gen.logprobs), list(pool.weight_versions().values()), report)]
        torch.distributed.broadcast_object_list(out, src=0)
        return out[0]

    results = {}
    previous = server_generation()  # the server's original weights = the trainer's before step 1
    for step, name in enumerate(["disk", "tensor", "distributed"], start=1):
        _gspo_step(actor, seed=step)
        # The step moved the weights: the trainer no longer agrees with the not yet synced server.
        moved = _trainer_log_probs(actor, PROMPT + previous[0], len(PROMPT))
        moved = None if moved is None else (moved - previous[1]).abs().max().item()
        sync = WeightSync(actor.chunks, hf, transports.get(name), pool, bucket_bytes=100_000)
        report = sync.sync(version=f"step{step}-{name}")
        previous = output_ids, server_lp, versions, report = server_generation(report)
        mine = _trainer_log_probs(actor, PROMPT + output_ids, len(PROMPT))
        results[name] = (server_lp, mine, versions, report, moved)

    return results


def test_gspo_step_then_sync_per_transport(qwen3_server, tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from rollout.servers.pool import ServerPool

    hf_dir = tiny_model_dir("qwen3", 0)  # what the session server serves
    url = qwen3_server.server_urls[0]
    pool = ServerPool([url])
    base = [5, 77, 301]
    ckpt = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    try:
        results = run_distributed(_body, 2, (str(ckpt), url, str(tmp_path / "disk")), timeout=600)
    finally:  # the session server must serve the seed-0 weights again
        pool.continue_generation()
        pool.update_weights_from_disk(str(hf_dir), weight_version="default")
    r0 = results[0]
    for step, name in enumerate(["disk", "tensor", "distributed"], start=1):
        server_lp, trainer_lp, versions, report, moved = r0[name]
        assert versions == [f"step{step}-{name}"]
        assert report["buckets"] > 1 and report["bytes"] > 0
        worst = (server_lp - trainer_lp).abs().max().item()
        assert moved > 1e-3, f"{name}: the GSPO step changed log-probs by only {moved:.3g}"
        assert worst < 1e-4, f"{name}: max |sglang - trainer| log-prob {worst:.3g}"
        print(f"{name}: step moved log-probs by {moved:.3g}; |sglang - trainer| <= {worst:.3g}; "
              f"sync {report['seconds']:.2f} s")
    # The restored server computes what transformers computes on the seed-0 model again.
    again = pool.generate(base, {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True})
    ref = hf_response_logprobs(hf_dir, base, again.output_ids)
    assert max(abs(a - b) for a, b in zip(again.logprobs, ref)) < 1e-4
